"""H2O, Heavy-Hitter Oracle (Zhang et al. 2023; docs/policies.md §6.1)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

from kvpass.cache import LayerCache, keep_slots
from kvpass.policies.base import Policy, Stat, require
from kvpass.policies.capabilities import RaggedRows
from kvpass.policies.selection import (
    compress_into_top,
    compress_rows_into_top,
    keep_priority,
    kept_slots,
    rows_in_one_call_in_place,
    select_kept,
)


@dataclass(frozen=True)
class H2O(Policy, RaggedRows):
    """Keep the newest ``floor(recent_ratio * keep)`` entries plus the heavy hitters: the largest
    accumulated attention ``col_sum`` (prefill column sums + every decode row, group mean §0.5) among
    the rest (§6.1). Follows D2O's H2O baseline, variant (a): the same budget in every layer, no
    forced sinks, one eviction per decode step (interval 1). Plain attention, nothing merged.

    Parameters
    ----------
    recent_ratio: share of the budget for the recent window (paper default split 1:1 -> 0.5).
    sinks: first tokens always kept (H2O: 0).
    interval: decode steps between compressions; 1 = the paper's one-in-one-out.
    """

    name: ClassVar[str] = "h2o"
    section: ClassVar[str] = "§6.1"
    summary: ClassVar[str] = "heavy hitters by accumulated attention + recent window"
    stats: ClassVar[frozenset[Stat]] = frozenset({Stat.COLUMN_SUM})
    recent_ratio: float = 0.5
    sinks: int = 0
    interval: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        require(0.0 <= self.recent_ratio <= 1.0, f"h2o: recent_ratio must lie in [0, 1], got {self.recent_ratio!r}")
        require(isinstance(self.sinks, int) and self.sinks >= 0, f"h2o: sinks must be an int >= 0, got {self.sinks!r}")

    def protected(self, keep: int | Tensor) -> tuple[int, int] | tuple[Tensor, Tensor]:
        """(sinks, recent): the entries a row of ``keep`` keeps whatever their scores; for keep [B] int64 (each
        row's own budget), each [B, 1, 1], the same products and truncation in fp64."""
        if isinstance(keep, Tensor):
            recent = (keep.double() * self.recent_ratio).long()
            return (keep - recent).clamp(max=self.sinks).view(-1, 1, 1), recent.view(-1, 1, 1)
        recent = int(keep * self.recent_ratio)
        return min(self.sinks, keep - recent), recent

    def priority(self, cache: LayerCache, keep: int | Tensor) -> Tensor:
        """[B, Hkv, C] fp64: +inf protected, accumulated attention, -inf empty (``keep_priority``); what
        the head-adaptive wrapper (``adakv``) ranks across heads. ``keep``: an int, or [B] int64 (per row)."""
        return keep_priority(cache.slot_meta[Stat.COLUMN_SUM.value], cache.length, *self.protected(keep),
                             cache.position)

    def compress(self, cache: LayerCache, keep: int) -> LayerCache:
        """cache: k, v [B, Hkv, C, D]; slot_meta['col_sum'] [B, Hkv, C] fp32 -> capacity min(keep, C)."""
        kept = select_kept(cache.slot_meta[Stat.COLUMN_SUM.value], cache.length, keep, *self.protected(keep),
                           cache.position)
        return keep_slots(cache, kept_slots(kept, keep))

    def compress_into(self, cache: LayerCache, keep: int) -> None:
        """The runtime's call: ``compress``'s entries in the same buffers, holes filled (``compress_into_top``)."""
        compress_into_top(self, H2O, cache, keep)

    def rows_in_one_call(self, budgets: Sequence[int], capacities: Sequence[int]) -> bool:
        """Rows of budgets of their own (prompts of different lengths) in one call, inside the CUDA-graphed step
        (``rows_in_one_call_in_place``)."""
        return rows_in_one_call_in_place(self, H2O, budgets, capacities)

    def compress_rows_into(self, cache: LayerCache, keep: Tensor) -> None:
        """``compress_into`` with row b's own budget keep[b] ([B] int64): each due row as alone (its own
        ``protected`` entries), the others left as they are (``compress_rows_into_top``). No host sync."""
        compress_rows_into_top(self, cache, keep)
