"""StreamingLLM (Xiao et al. 2024): attention sinks plus a recent window."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvpass.cache import LayerCache, keep_slots
from kvpass.policies.base import Policy, require


@dataclass(frozen=True)
class StreamingLLM(Policy):
    """Keep the first ``sinks`` tokens and the most recent ``keep - sinks`` ones; drop the middle
    (policies.md §6.2). No scores. Positions stay absolute (the spec's default; the original's
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
