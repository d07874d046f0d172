"""StreamingLLM (Xiao et al. 2024): attention sinks plus a recent window."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from kvpass.cache import LayerCache, keep_slots
from kvpass.kernels.lowest_slots import lowest_slots
from kvpass.policies.base import Policy, require
from kvpass.policies.capabilities import RaggedRows
from kvpass.policies.selection import (
    fill_evicted_rows,
    fill_evicted_slots,
    fills_in_place,
    rows_in_one_call_in_place,
)


@dataclass(frozen=True)
class StreamingLLM(Policy, RaggedRows):
    """Keep the first ``sinks`` tokens and the most recent ``keep - sinks`` ones; drop the middle
    (docs/policies.md §6.2). No scores. Positions stay absolute (the spec's default; the original's
    in-cache position shift is not implemented).

    Parameters
    ----------
    sinks: attention-sink tokens always kept (paper: 4).
    interval: decode steps between evictions; the paper evicts one token per step (interval 1),
        the default 16 evicts 16 at a time, so the window breathes between budget and budget + 16.
    """

    name: ClassVar[str] = "streamingllm"
    section: ClassVar[str] = "§6.2"
    summary: ClassVar[str] = "attention sinks + recent window"
    sinks: int = 4
    interval: int = 16

    def __post_init__(self) -> None:
        super().__post_init__()
        require(isinstance(self.sinks, int) and self.sinks >= 0, f"streamingllm: sinks must be an int >= 0, got {self.sinks!r}")

    def min_budget(self) -> int:
        return self.sinks + 1

    def compress(self, cache: LayerCache, keep: int) -> LayerCache:
        """Slots [0, sinks) and [length - (keep - sinks), length) of each row; rows already within
        ``keep`` are unchanged. cache: [B, Hkv, C, ...] -> capacity ``keep``."""
        j = torch.arange(keep, device=cache.k.device)                         # [keep]
        length = cache.length[:, :, None]                                     # [B, Hkv, 1]
        recent = length - keep + j                                            # shifts the tail to the end
        idx = torch.where((j < self.sinks) | (length <= keep), j, recent)
        return keep_slots(cache, idx)

    def compress_into(self, cache: LayerCache, keep: int) -> None:
        """The runtime's call, in place and O(C - keep) moves: each row over ``keep`` evicts its
        n = length - keep oldest non-sink entries (by position: the slots need not be in sequence order),
        the live entries of slots [keep, C) that stay move into the evicted slots below ``keep``, and
        slots [keep, C) are emptied. Same entries as ``compress`` (tested as sets); no copy of the window,
        no host sync. cache: [B, Hkv, C, ...]."""
        c = cache.capacity
        extra = c - keep
        if extra <= 0:
            return
        if not fills_in_place(self, StreamingLLM, cache):
            super().compress_into(cache, keep)              # a subclass's own compress, or views: the generic path
            return
        fill_evicted_slots(cache, self._oldest(cache, extra), keep)                  # the n oldest leave

    def _oldest(self, cache: LayerCache, n: int) -> Tensor:
        """[B, Hkv, n] each row's n oldest live non-sink slots (by position; the sinks are each row's lowest
        positions), oldest first: one Triton launch on CUDA."""
        age = torch.where(cache.live, cache.position, torch.iinfo(torch.long).max)
        return lowest_slots(age, min(self.sinks + n, cache.capacity))[..., self.sinks:]

    def rows_in_one_call(self, budgets: Sequence[int], capacities: Sequence[int]) -> bool:
        """Rows of budgets of their own (a batch of prompts of different lengths) in one call where each row
        compresses when it holds its budget + ``interval`` entries (or never: a capacity within its budget):
        ``compress_rows_into``, in the layer's own buffers, inside the CUDA-graphed step. Rows of one budget keep
        ``compress_into`` (False here)."""
        return rows_in_one_call_in_place(self, StreamingLLM, budgets, capacities)

    def compress_rows_into(self, cache: LayerCache, keep: Tensor) -> None:
        """``compress_into`` with row b's own budget keep[b] ([B] int64): a row holding keep[b] + interval entries
        (due) evicts its ``interval`` oldest non-sink entries and its survivors above keep[b] move into their slots,
        as it would alone in a layer of capacity keep[b] + interval (``fill_evicted_rows``); every other row is left
        as it is. No host sync. cache: [B, Hkv, C, ...]."""
        fill_evicted_rows(cache, self._oldest(cache, self.interval), keep, self.interval)
