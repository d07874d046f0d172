"""Knorm (Devoto et al. 2024; kvpress's KnormPress; docs/policies.md §6.9)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvpass.cache import LayerCache, keep_slots
from kvpass.policies.base import Policy, require
from kvpass.policies.selection import kept_slots, select_kept


def key_norm_score(k: torch.Tensor) -> torch.Tensor:
    """-||k|| per slot, fp32 (the smallest norms score highest). k: [B, Hkv, C, D] -> [B, Hkv, C]."""
    return -torch.linalg.vector_norm(k.float(), dim=-1)


@dataclass(frozen=True)
class Knorm(Policy):
    """Keep the ``keep`` entries whose keys have the smallest L2 norm (§6.9): keys of low norm draw
    high attention, so the norm stands in for attention scores and no statistic is needed. Norms of
    the cached (post-RoPE) keys in fp32, equal to the pre-RoPE norms (RoPE rotates channel pairs).
    The first ``sinks`` entries and the last ``recent`` (default 32) are always kept [OURS options; kvpress:
    none]. kvpress compresses the prompt only; kvpass runs the same rule whenever a layer has grown
    ``interval`` entries past its budget [OURS], and the recent window keeps that from evicting the tokens
    just fed (a question fed after compression, the newest generated tokens), which kvpress never evicts.
    ``recent=0`` is kvpress's rule. Plain attention, nothing merged.

    Parameters
    ----------
    sinks: first tokens always kept (kvpress: 0).
    recent: newest entries always kept, clamped to ``keep - sinks`` (kvpass: 32; kvpress: 0). With 0 the decode-time
        compressions evict the newest tokens by their norm: low budgets stutter (docs/quality.md,
        "Degeneration check") and a question fed after compression is evicted as it arrives (quality suite,
        query-agnostic at 0.5: 4.3% with 0, 22.7% with 32, kvpress's KnormPress 21.7%).
    interval: decode steps between compressions.
    """

    name: ClassVar[str] = "knorm"
    section: ClassVar[str] = "§6.9"
    summary: ClassVar[str] = "keep the keys of smallest L2 norm and the 32 newest; no statistic"
    sinks: int = 0
    recent: int = 32
    interval: int = 16

    def __post_init__(self) -> None:
        super().__post_init__()
        require(isinstance(self.sinks, int) and self.sinks >= 0, f"knorm: sinks must be an int >= 0, got {self.sinks!r}")
        require(isinstance(self.recent, int) and self.recent >= 0, f"knorm: recent must be an int >= 0, got {self.recent!r}")

    def min_budget(self) -> int:
        return self.sinks + 1

    def compress(self, cache: LayerCache, keep: int) -> LayerCache:
        """cache: k, v [B, Hkv, C, D] -> capacity min(keep, C), the kept entries in sequence order."""
        sinks = min(self.sinks, keep)
        kept = select_kept(key_norm_score(cache.k), cache.length, keep, sinks, min(self.recent, keep - sinks))
        return keep_slots(cache, kept_slots(kept, keep))
