"""The k lowest keys of each row, as slots: what an in-place eviction needs (the n <= k entries it drops).

For every row r of key [R, C] (fp32 or int64) the slots of its k smallest keys, in ascending order of
(key, slot), so equal keys come lower slot first:

    out[r, i] = the slot j of the i-th smallest (key[r, j], j)          i < k <= C

Shapes: key [..., C] -> out [..., k] int64. The reference is a stable sort of the row. On CUDA, for rows of
up to MAX_TRITON_SLOTS keys, one Triton program per row holds the row in registers and picks the k slots one
after the other: a decode-time compression evicts a handful of entries (k = the interval, 16 by default) from
thousands, where torch's sort and top-k of a few long rows run one block a row (~80-110 us for 8 rows of 6.5k
on an H200, benchmarks/probes/compress_into_timing.py). Traffic: C keys read once, k slots written.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvpass.kernels._triton import HAS_TRITON, check_device, next_pow2, require_triton, tl, triton

MAX_TRITON_SLOTS = 16384          # a row held in the registers of one program of 16 warps (32 keys a thread)


def lowest_slots_reference(key: Tensor, k: int) -> Tensor:
    """A stable ascending sort of each row, its first k slots."""
    return key.sort(dim=-1, stable=True).indices[..., :k]


# Program r holds row r, x_j = KEY[r, j] for j < C, and picks k slots in order of (x_j, j): with the last pick
# (p, s), the next is the smallest key among the slots after it, x_j > p or (x_j == p and j > s), and of those
# equal to that minimum, the lowest slot (two reductions a pick; a pick is never taken twice, even where keys
# equal the masked lanes' SENTINEL, the largest key of the dtype).
@triton.jit
def _lowest_slots_kernel(KEY, OUT, C, K, skr, sor, SENTINEL, BLOCK_C: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_C)
    valid = offs < C
    x = tl.load(KEY + r * skr + offs, mask=valid, other=SENTINEL)
    p = tl.min(tl.where(valid, x, SENTINEL), 0)
    s = -1
    for i in range(0, K):
        after = valid & ((x > p) | ((x == p) & (offs > s)))
        p = tl.min(tl.where(after, x, SENTINEL), 0)
        s = tl.min(tl.where(after & (x == p), offs, BLOCK_C), 0)
        tl.store(OUT + r * sor + i, s.to(tl.int64))


def lowest_slots_triton(key: Tensor, k: int) -> Tensor:
    """One launch, one program per row (rows of at most MAX_TRITON_SLOTS keys)."""
    require_triton()
    check_device("key", key, key.device)
    c = key.shape[-1]
    if key.dtype not in (torch.float32, torch.int64):
        raise ValueError(f"lowest_slots: key must be float32 or int64, got {key.dtype}")
    if not 0 <= k <= c or c > MAX_TRITON_SLOTS:
        raise ValueError(f"lowest_slots: need 0 <= k <= C <= {MAX_TRITON_SLOTS}, got k={k}, C={c}")
    rows = key.reshape(-1, c)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(*key.shape[:-1], k, dtype=torch.long, device=key.device)
    if k == 0 or rows.shape[0] == 0:
        return out
    sentinel = float("inf") if key.dtype == torch.float32 else torch.iinfo(torch.int64).max
    block = max(16, next_pow2(c))
    _lowest_slots_kernel[(rows.shape[0],)](rows, out, c, k, rows.stride(0), k, sentinel, BLOCK_C=block,
                                           num_warps=16 if block >= 8192 else (8 if block >= 2048 else 4))
    return out


@torch.library.custom_op("kvpass::lowest_slots", mutates_args=())
def lowest_slots(key: Tensor, k: int) -> Tensor:
    return lowest_slots_reference(key, k)


@lowest_slots.register_fake
def _(key, k):
    return key.new_empty(*key.shape[:-1], k, dtype=torch.long)


if HAS_TRITON:
    @lowest_slots.register_kernel("cuda")
    def _(key, k):
        if key.dtype in (torch.float32, torch.int64) and key.shape[-1] <= MAX_TRITON_SLOTS:
            return lowest_slots_triton(key, k)
        return lowest_slots_reference(key, k)
