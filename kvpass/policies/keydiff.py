"""KeyDiff (Park et al. 2025, "KeyDiff: Key Similarity-Based KV Cache Eviction"; docs/policies.md §6.12)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from kvpass.cache import LayerCache, keep_slots
from kvpass.policies.base import Policy, require
from kvpass.policies.selection import kept_slots, select_kept


def key_diversity_score(k: Tensor, live: Tensor) -> Tensor:
    """-cos(k_j, a) per slot, fp32, where a is the mean of the row's live unit keys (the anchor): keys pointing
    away from the others score highest. k: [B, Hkv, C, D]; live: [B, Hkv, C] bool -> [B, Hkv, C]."""
    unit = torch.nn.functional.normalize(k.float(), dim=-1) * live[..., None]
    anchor = torch.nn.functional.normalize(unit.sum(2, keepdim=True), dim=-1)        # [B, Hkv, 1, D]
    return -(unit @ anchor.transpose(-1, -2))[..., 0]


@dataclass(frozen=True)
class KeyDiff(Policy):
    """Keep the ``keep`` entries whose keys are least similar to the row's mean key direction (§6.12): keys that
    differ from the rest draw attention the others cannot stand in for, so no statistic and no query is needed
    (query-agnostic: the prompt compresses the same whatever follows it). The first ``sinks`` and the newest
    ``recent`` entries are always kept [OURS, as ``knorm``'s]. Plain attention, nothing merged.

    Parameters
    ----------
    sinks: first tokens always kept (the paper: 0).
    recent: newest entries always kept, clamped to ``keep - sinks`` (the paper: 0).
    interval: decode steps between compressions (the paper compresses the prompt in blocks, not the decode).
    """

    name: ClassVar[str] = "keydiff"
    section: ClassVar[str] = "§6.12"
    summary: ClassVar[str] = "keep the keys least similar to the mean key and the 32 newest; no statistic"
    sinks: int = 4
    recent: int = 32
    interval: int = 16

    def __post_init__(self) -> None:
        super().__post_init__()
        for field in ("sinks", "recent"):
            value = getattr(self, field)
            require(isinstance(value, int) and value >= 0, f"keydiff: {field} must be an int >= 0, got {value!r}")

    def min_budget(self) -> int:
        return self.sinks + 1

    def compress(self, cache: LayerCache, keep: int) -> LayerCache:
        """cache: k, v [B, Hkv, C, D] in sequence order -> capacity min(keep, C), the kept entries in order."""
        sinks = min(self.sinks, keep)
        score = key_diversity_score(cache.k, cache.live)
        kept = select_kept(score, cache.length, keep, sinks, min(self.recent, keep - sinks))
        return keep_slots(cache, kept_slots(kept, keep))
