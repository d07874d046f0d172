"""StreamingLLM (Xiao et al. 2024): attention sinks plus a recent window."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvpass.cache import LayerCache, keep_slots
from kvpass.kernels.lowest_slots import lowest_slots
from kvpass.policies.base import Policy, require
from kvpass.policies.selection import fill_evicted_slots, fills_in_place


@dataclass(frozen=True)
class StreamingLLM(Policy):
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
        age = torch.where(cache.live, cache.position, torch.iinfo(torch.long).max)
        oldest = lowest_slots(age, min(self.sinks + extra, c))[..., self.sinks:]    # one Triton launch on CUDA
        fill_evicted_slots(cache, oldest, keep)                                     # the n oldest leave
