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
    (evictions of one call give the values the streaming cache would have reached one eviction at a
    time: ``merged_values`` solves that recurrence in blocks instead of looping over evictions).
    Keys of evicted entries are discarded; ``col_sum`` is not changed; attention is plain. Near the end
    of a row fewer than m targets exist: those present get v[e] / m each [OURS]. Draws are seeded
    per (position, KV head) (``hashed_uniform``).

    Parameters
    ----------
    sinks: attention sinks always kept (4, Chelsea's setting).
    merge_window: m, the retained entries a dropped value is spread over (streaming version: 16).
    seed: seed of the Bernoulli draws.
    interval: decode steps between compressions; 1 = the streaming cache's one-in-one-out.
    block: slots per triangular solve of the replayed merges (``merged_values``); speed only, the
        result does not depend on it beyond rounding [OURS].
    first_compression: "prefill" (kvpass's contract: the budget holds from the first step) or "decode":
        the prompt is compressed after the first decode step, which attends the whole prompt (the layer
        holds prompt + 1 entries until then; ``Policy.prompt_compression_deferred``). "decode" is the timing
        of kvpress's ``CAMPress``, a decoding press whose hook compresses after each step's attention, so
        its first generated token after the prompt's is computed on the full cache [OURS as an option;
        docs/quality.md, "kvpass against kvpress on the very same cases"].
    """

    name: ClassVar[str] = "cam"
    section: ClassVar[str] = "§6.4"
    summary: ClassVar[str] = "sinks + recent window; evicted values merged into the next retained ones"
    stats: ClassVar[frozenset[Stat]] = frozenset({Stat.COLUMN_SUM})
    sinks: int = 4
    merge_window: int = 16
    seed: int = 0
    interval: int = 1
    block: int = 256
    first_compression: str = "prefill"

    def __post_init__(self) -> None:
        super().__post_init__()
        require(isinstance(self.sinks, int) and self.sinks >= 0, f"cam: sinks must be an int >= 0, got {self.sinks!r}")
        require(isinstance(self.merge_window, int) and self.merge_window >= 1,
                f"cam: merge_window must be an int >= 1, got {self.merge_window!r}")
        require(isinstance(self.block, int) and self.block >= 1, f"cam: block must be an int >= 1, got {self.block!r}")
        require(isinstance(self.seed, int), f"cam: seed must be an int, got {self.seed!r}")
        require(self.first_compression in ("prefill", "decode"),
                f"cam: first_compression must be 'prefill' or 'decode', got {self.first_compression!r}")

    def prompt_compression_deferred(self) -> bool:
        return self.first_compression == "decode"

    def compress(self, cache: LayerCache, keep: int) -> LayerCache:
        """cache: k, v [B, Hkv, C, D]; slot_meta['col_sum'] [B, Hkv, C] fp32 -> capacity min(keep, C)."""
        sinks = min(self.sinks, keep - 1)
        length = cache.length                                                   # [B, Hkv]
        c = cache.capacity
        j = torch.arange(min(keep, c), device=length.device)
        idx = torch.where((j < sinks) | (length[..., None] <= keep), j, length[..., None] - keep + j)
        v = merged_values(cache, keep, sinks, self.merge_window, self.seed, self.block)
        merged = LayerCache(k=cache.k, v=v.to(cache.v.dtype), log_weight=cache.log_weight, length=length,
                            position=cache.position, slot_meta=cache.slot_meta, state=cache.state)
        return keep_slots(merged, idx)


def merge_draws(cache: LayerCache, keep: int, sinks: int, m: int, seed: int) -> Tensor:
    """[B, Hkv, C] fp64: 1 where the entry in that slot leaves the window in this call (slots
    [sinks, sinks + length - keep)) and its Bernoulli draw says merge, else 0. The draw of slot e compares
    ``hashed_uniform`` with p = clamp(acc[e] / mean(acc over its present targets e+1 .. e+m), 0, 1)."""
    length = cache.length[..., None]                                            # [B, Hkv, 1]
    c = cache.capacity
    e = torch.arange(c, device=length.device)
    acc = cache.slot_meta[Stat.COLUMN_SUM.value].double()
    acc = torch.where(e < length, acc, 0.0)                                      # absent targets count nothing
    csum = torch.nn.functional.pad(acc.cumsum(-1), (1, 0))                       # csum[i] = sum(acc[:i])
    stop = torch.minimum(e + 1 + m, length)                                      # targets e+1 .. stop-1
    count = (stop - e - 1).clamp(min=0)
    total = csum.gather(-1, stop.clamp(max=c)) - csum[..., 1:]                   # sum(acc[e+1 : stop])
    p = torch.nan_to_num((acc / (total / count)).clamp(0.0, 1.0), nan=0.0)
    head = torch.arange(length.shape[1], device=length.device)[None, :, None]
    draw = hashed_uniform(cache.position, head.expand_as(cache.position), seed) < p
    leaving = (e >= sinks) & (e < sinks + (length - keep).clamp(min=0))
    return (draw & leaving).double()


def merged_values(cache: LayerCache, keep: int, sinks: int, m: int, seed: int, block: int) -> Tensor:
    """The values after replaying every eviction of one call: v: [B, Hkv, C, D] fp64.

    Slots leave in sequence order and each adds v/m to the next m slots, so with a[i] = 1 for a slot that
    leaves and merges, the final values solve the banded recurrence
        x[j] = v[j] + sum_{i = j - m}^{j - 1} a[i] x[i] / m,
    i.e. (I - L) x = v with L strictly lower triangular and banded. Solved block by block (``block``
    slots at a time, the m slots before a block carried in as fixed rows): a few batched triangular
    solves instead of one Python step per evicted entry. Only slots up to the last leaving one + m
    change; the bound ``C - keep`` on the leaving count is a shape, so nothing reads data back to the
    host (a decode-time compression stays inside a CUDA graph)."""
    c = cache.capacity
    v = cache.v.double()
    a = merge_draws(cache, keep, sinks, m, seed)                                # [B, Hkv, C]
    end = min(c, sinks + max(c - keep, 0) + m)                                   # slots past it receive nothing
    if end <= sinks + 1:
        return v.clone()
    x = v.clone()
    for start in range(sinks + 1, end, block):
        stop = min(start + block, end)
        lo = max(start - m, 0)
        n_fixed, n = start - lo, stop - lo
        r = torch.arange(n, device=v.device)
        gap = r[:, None] - r[None, :]                                            # row (receiver) - column (giver)
        band = ((gap > 0) & (gap <= m) & (r[:, None] >= n_fixed)).double() / m   # [n, n]
        lower = band * a[:, :, lo:stop, None].transpose(-1, -2)                  # [B, Hkv, n, n]
        eye = torch.eye(n, dtype=v.dtype, device=v.device)
        rhs = torch.cat([x[:, :, lo:start], v[:, :, start:stop]], dim=2)
        x[:, :, start:stop] = torch.linalg.solve_triangular(eye - lower, rhs, upper=False,
                                                             unitriangular=True)[:, :, n_fixed:]
    return x
