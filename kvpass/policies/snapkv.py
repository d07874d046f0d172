"""SnapKV (Li et al. 2024; docs/policies.md §6.3)."""

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
class SnapKV(Policy, RaggedRows):
    """Keep the observation window (the last ``window`` prompt tokens) plus the top ``keep - window``
    earlier positions by pooled window scores: the attention of the last ``window`` prompt queries,
    fp32 softmax, group mean (§0.5), ``pool``-pooled with ``kernel`` (``Stat.WINDOW_SCORES``, §6.3).

    SnapKV compresses the prompt only and lets decode grow the cache. kvpass's budget counts prompt +
    generated tokens and must hold at every step, so when decode fills the buffer (every ``interval``
    steps) the same rule runs again [OURS]: the newest ``window`` entries are kept and the rest compete
    on their prefill scores; generated tokens have score 0, so those older than the window leave first.
    If ``keep <= window`` only the newest ``keep`` entries are kept [OURS].

    Parameters
    ----------
    window: observation window w (official default 32).
    kernel: pooling kernel, odd (official default 5; the issue's EMS setting 7). The default policy
        (``kvpass.DEFAULT_POLICY``) uses 31, wide enough to keep a 7-token answer whole (§6.3).
    pool: "avg" (official default) or "max".
    interval: decode steps between compressions.
    """

    name: ClassVar[str] = "snapkv"
    section: ClassVar[str] = "§6.3"
    summary: ClassVar[str] = "observation-window scores, pooled; prefill selection"
    stats: ClassVar[frozenset[Stat]] = frozenset({Stat.WINDOW_SCORES})
    window: int = 32
    kernel: int = 7
    pool: str = "avg"
    interval: int = 16

    def __post_init__(self) -> None:
        super().__post_init__()
        require(isinstance(self.window, int) and self.window >= 1, f"{self.name}: window must be an int >= 1, got {self.window!r}")
        require(isinstance(self.kernel, int) and self.kernel >= 1 and self.kernel % 2 == 1,
                f"{self.name}: kernel must be an odd int >= 1, got {self.kernel!r}")
        require(self.pool in ("avg", "max"), f"{self.name}: pool must be 'avg' or 'max', got {self.pool!r}")

    def stat_options(self, stat: Stat) -> dict[str, object]:
        return {"obs_window": self.window, "kernel": self.kernel, "pool": self.pool}

    def priority(self, cache: LayerCache, keep: int | Tensor) -> Tensor:
        """[B, Hkv, C] fp64: +inf for the newest ``min(window, keep)`` entries, pooled window scores, -inf
        empty (``keep_priority``); what the head-adaptive wrapper (``adakv``) ranks across heads. ``keep``: an int,
        or [B] int64 (each row's own budget)."""
        recent = keep.clamp(max=self.window).view(-1, 1, 1) if isinstance(keep, Tensor) else min(self.window, keep)
        return keep_priority(cache.slot_meta[Stat.WINDOW_SCORES.value], cache.length, 0, recent, cache.position)

    def compress(self, cache: LayerCache, keep: int) -> LayerCache:
        """cache: k, v [B, Hkv, C, D]; slot_meta['window_scores'] [B, Hkv, C] fp32 -> capacity min(keep, C)."""
        recent = min(self.window, keep)
        kept = select_kept(cache.slot_meta[Stat.WINDOW_SCORES.value], cache.length, keep, 0, recent, cache.position)
        return keep_slots(cache, kept_slots(kept, keep))

    def compress_into(self, cache: LayerCache, keep: int) -> None:
        """The runtime's call: ``compress``'s entries in the same buffers, holes filled (``compress_into_top``)."""
        compress_into_top(self, SnapKV, cache, keep)

    def rows_in_one_call(self, budgets: Sequence[int], capacities: Sequence[int]) -> bool:
        """Rows of budgets of their own (prompts of different lengths) in one call, inside the CUDA-graphed step
        (``rows_in_one_call_in_place``)."""
        return rows_in_one_call_in_place(self, SnapKV, budgets, capacities)

    def compress_rows_into(self, cache: LayerCache, keep: Tensor) -> None:
        """``compress_into`` with row b's own budget keep[b] ([B] int64): each due row as alone, the others left as
        they are (``compress_rows_into_top``). No host sync."""
        compress_rows_into_top(self, cache, keep)
