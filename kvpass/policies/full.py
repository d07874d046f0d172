"""The uncompressed cache: every token is kept. The reference the other policies are measured
against; reproduces plain transformers token for token."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvpass.cache import LayerCache
from kvpass.policies.base import Policy


@dataclass(frozen=True)
class Full(Policy):
    """No compression (docs/policies.md §8.1, the identity every method must reproduce)."""

    name: ClassVar[str] = "full"
    section: ClassVar[str] = "§8.1 (identity)"
    summary: ClassVar[str] = "keep every token; the full-cache reference"
    compresses: ClassVar[bool] = False

    def compress(self, cache: LayerCache, keep: int) -> LayerCache:
        return cache
