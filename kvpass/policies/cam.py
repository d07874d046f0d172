"""CaM, Cache Merging (Zhang et al., ICML 2024; docs/policies.md §6.4)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from kvpass.cache import LayerCache, keep_slots
from kvpass.policies.base import Policy, Stat, require


def hashed_uniform(position: Tensor, head: Tensor, seed: int) -> Tensor:
    """A deterministic uniform in [0, 1) per (absolute position, KV head, seed), fp64: CaM's seeded
    Bernoulli draws (§0.7), independent of the batch size and of the other rows (integer hash)."""
    mask = 0xFFFFFFFF
    x = (position.long() * 0x9E3779B1 + head.long() * 0x85EBCA77 + seed * 0xC2B2AE3D + 0x165667B1) & mask
    for mul in (0x7FEB352D, 0x846CA68B):
        x = x ^ (x >> 16)
        x = (x * mul) & mask
    x = x ^ (x >> 16)
    return x.double() / 2.0**32


@dataclass(frozen=True)
class CaM(Policy):
    """StreamingLLM eviction (``sinks`` first tokens + the newest ``keep - sinks``) plus CaM's value
    merging, streaming version (§6.4, the default there): when entry e leaves the recent window, with
    acc = accumulated attention (``col_sum``, group mean §0.5) and the next ``merge_window`` = m slots
    e+1 .. e+m,

        p = clamp(acc[e] / mean(acc[e+1 .. e+m]), 0, 1)   (NaN -> 0),  mask ~ Bernoulli(p) per head,
        v[e+1 .. e+m] += mask * v[e] / m

    Entries leave in sequence order and the targets may leave later, carrying what they received
    (evictions of one call are replayed one by one, as the streaming cache would have done them).
    Keys of evicted entries are discarded; ``col_sum`` is not changed; attention is plain. Near the end
    of a row fewer than m targets exist: those present get v[e] / m each [OURS]. Draws are seeded
    per (position, KV head) (``hashed_uniform``).

    Parameters
    ----------
    sinks: attention sinks always kept (4, Chelsea's setting).
    merge_window: m, the retained entries a dropped value is spread over (streaming version: 16).
    seed: seed of the Bernoulli draws.
    interval: decode steps between compressions; 1 = the streaming cache's one-in-one-out.
    """

    name: ClassVar[str] = "cam"
    section: ClassVar[str] = "§6.4"
    summary: ClassVar[str] = "sinks + recent window; evicted values merged into the next retained ones"
    stats: ClassVar[frozenset[Stat]] = frozenset({Stat.COLUMN_SUM})
    sinks: int = 4
    merge_window: int = 16
    seed: int = 0
    interval: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        require(isinstance(self.sinks, int) and self.sinks >= 0, f"cam: sinks must be an int >= 0, got {self.sinks!r}")
        require(isinstance(self.merge_window, int) and self.merge_window >= 1,
                f"cam: merge_window must be an int >= 1, got {self.merge_window!r}")
        require(isinstance(self.seed, int), f"cam: seed must be an int, got {self.seed!r}")

    def compress(self, cache: LayerCache, keep: int) -> LayerCache:
        """cache: k, v [B, Hkv, C, D]; slot_meta['col_sum'] [B, Hkv, C] fp32 -> capacity min(keep, C)."""
        sinks = min(self.sinks, keep - 1)
        m = self.merge_window
        length = cache.length                                                   # [B, Hkv]
        n_evict = (length - keep).clamp(min=0)
        c = cache.capacity
        acc = cache.slot_meta[Stat.COLUMN_SUM.value].double()
        v = cache.v.double().clone()
        head = torch.arange(length.shape[1], device=length.device)[None, :].expand_as(length)
        # a static bound (capacity - keep >= every row's n_evict) instead of n_evict.max(): no host sync,
        # so the decode step (one iteration) stays inside the CUDA graph; extra offsets are masked (``on``)
        for offset in range(max(c - keep, 0) if n_evict.numel() else 0):
            e = sinks + offset
            targets = slice(e + 1, min(e + 1 + m, c))
            present = (torch.arange(targets.start, targets.stop, device=v.device) < length[..., None])   # [B, Hkv, m']
            mean = (acc[:, :, targets] * present).sum(-1) / present.sum(-1)
            p = torch.nan_to_num((acc[:, :, e] / mean).clamp(0.0, 1.0), nan=0.0)
            draw = hashed_uniform(cache.position[:, :, e], head, self.seed) < p
            on = draw & (offset < n_evict)                                       # [B, Hkv]
            v[:, :, targets] += (on[..., None] & present)[..., None] * v[:, :, e:e + 1] / m
        j = torch.arange(min(keep, c), device=v.device)
        idx = torch.where((j < sinks) | (length[..., None] <= keep), j, length[..., None] - keep + j)
        merged = LayerCache(k=cache.k, v=v.to(cache.v.dtype), log_weight=cache.log_weight, length=length,
                            position=cache.position, slot_meta=cache.slot_meta, state=cache.state)
        return keep_slots(merged, idx)
