"""Attention column sums of a layer's recent decode queries over its cache, all at once (deferred scores).

A policy that adds every decode step's attention row into ``col_sum`` but reads it only when it compresses
(``Policy.deferred_scores``: D2O with ``interval`` m > 1) need not compute the rows at every step: the decode
graph keeps each step's query (``write_query``) and this op gives the sum of their rows when the layer is next
compressed. For batch row b, KV head g, slot j and every kept query i (position p_i >= 0) of the G query heads h
of group g:

    s_hij = scale * q_{b,h,i} . k_{b,g,j} + log_weight_{b,g,j}    (softcap c: c tanh(s / c) before the log-weight)
            = -inf where position_{b,g,j} > p_i                    (a slot written after step i)
    col[b, g, j] = (1/G) sum_h sum_i softmax_j(s_hij)                                        -> [B, Hkv, C] fp32

The runtime computes it before every compression of the layer (and when the ring is full), so between the
steps and now nothing was merged, moved or evicted: the slots of positions <= p_i are exactly those step i
attended (its own key included), with the same log-weights, and ``col`` is the sum of the steps'
``decode_attention(..., want_scores=True)`` rows up to rounding (tests/kernels/test_recent_query_column_sums.py).
Ring slots of position -1 (empty) add nothing.

Shapes: q: [B, Hq, m, D]; q_position: [B, m] int64; k_cache: [B, Hkv, C, D]; log_weight: [B, Hkv, C] fp32;
position: [B, Hkv, C] int64 (-1: empty slot).

On CUDA without softcap: two Triton passes over the keys, the rows' masked base-2 log-sum-exps
(``_recent_lse_kernel``, a block of the group's G*m query rows and a split of the slots a program, the splits
combined by ``_combine_lse_kernel``), then the column sums
(``cache_column_sums_triton`` with the position mask). A step's own pass reads K and V once; this reads K twice
per m steps, at a cost that does not grow with m (tensor-core work of G*m rows a key).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvpass.kernels._triton import (
    HAS_TRITON,
    check_device,
    launch_config,
    next_pow2,
    require_triton,
    tl,
    triton,
    whole_tile_splits,
)
from kvpass.kernels.chunk_attention import group_query_rows
from kvpass.kernels.chunk_column_sums import cache_column_sums_triton
from kvpass.kernels.decode_attention import _dot, _sm_count, dot_mode

ROW_BLOCK = 64                 # query rows the reference holds logits for at once: [B, Hkv, ROW_BLOCK, C]


def recent_query_column_sums_reference(q: Tensor, q_position: Tensor, k_cache: Tensor, log_weight: Tensor,
                                       position: Tensor, scale: float, softcap: float | None = None) -> Tensor:
    b, hq, m, d = q.shape
    hkv = k_cache.shape[1]
    g = hq // hkv
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    rows = q.reshape(b, hkv, g * m, d).to(acc)                # row r: head g*G + r // m, query r % m
    row_pos = q_position.repeat(1, g)                          # [B, G*m]
    k, lw = k_cache.to(acc), log_weight.to(acc)[:, :, None, :]
    out = torch.zeros(b, hkv, k_cache.shape[2], dtype=acc, device=q.device)
    for r0 in range(0, g * m, ROW_BLOCK):
        p_rows = row_pos[:, None, r0:r0 + ROW_BLOCK, None]     # [B, 1, n, 1]
        s = torch.matmul(rows[:, :, r0:r0 + ROW_BLOCK], k.transpose(-1, -2)) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        s = (s + lw).masked_fill(position[:, :, None, :] > p_rows, float("-inf"))
        p = torch.softmax(s, dim=-1)
        out += torch.where(p_rows >= 0, p, 0.0).sum(dim=2)     # empty ring slots (NaN rows) add nothing
    out = out / g
    return out if acc == torch.float64 else out.float()


# Program (block of query rows, (b, g), split s of the slots [s * CHUNK, (s + 1) * CHUNK)); row r: head g*G + r // m,
# query r % m of position p_r, over the split's slots j with kpos_j <= p_r:
#     x_rj = log2e (scale q_r . k_j + lw_j);   M_rs = max_j x_rj;   L_rs = sum_j 2^(x_rj - M_rs)
# online over blocks of slots (running max and sum, as flash attention; no V). Splitting the slots keeps the GPU
# busy at batch 1 (B Hkv G m / BLOCK_M programs alone were 32 long loops for Llama-3.1-8B). Then per row
#     lse2_r = M_r + log2 sum_s L_rs 2^(M_rs - M_r),  M_r = max_s M_rs    (+inf: no such slot, or p_r < 0)
@triton.jit
def _recent_lse_kernel(Q, QPOS, K, LW, KPOS, PART_M, PART_L, sqb, sqh, sqt, sqd, skb, skh, skc, skd, HKV, G, T, C,
                       CHUNK, SPLITS, scale, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_D: tl.constexpr, DOT: tl.constexpr):
    b, g, head, tok, r_ok, d, d_ok, q = group_query_rows(Q, sqb, sqh, sqt, sqd, HKV, G, T, HEAD_DIM, BLOCK_M, BLOCK_D)
    split = tl.program_id(2)
    lo = split * CHUNK
    hi = tl.minimum(lo + CHUNK, C)
    qpos = tl.load(QPOS + b * T + tok, mask=r_ok, other=-1)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    for j0 in range(lo, hi, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        j_ok = j < hi
        k = tl.load(K + b * skb + g * skh + j[:, None] * skc + d[None, :] * skd, mask=j_ok[:, None] & d_ok[None, :],
                    other=0.0)
        lw2 = tl.load(LW + (b * HKV + g) * C + j, mask=j_ok, other=float("-inf")) * 1.4426950408889634
        kpos = tl.load(KPOS + (b * HKV + g) * C + j, mask=j_ok, other=0)
        x = _dot(q, tl.trans(k), DOT) * (scale * 1.4426950408889634) + lw2[None, :]
        x = tl.where(kpos[None, :] <= qpos[:, None], x, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(x, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp2(m_i - m_safe) + tl.sum(tl.exp2(x - m_safe[:, None]), 1)
        m_i = m_new
    at = ((b * HKV * G + head) * T + tok) * SPLITS + split
    tl.store(PART_M + at, m_i, mask=r_ok)
    tl.store(PART_L + at, l_i, mask=r_ok)


@triton.jit
def _combine_lse_kernel(PART_M, PART_L, QPOS, LSE, ROWS, HQ, T, SPLITS, BLOCK_R: tl.constexpr,
                        BLOCK_S: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)         # rows (b, h, i) of [B, Hq, T], flat
    r_ok = r < ROWS
    s = tl.arange(0, BLOCK_S)
    at = r[:, None] * SPLITS + s[None, :]
    ok = r_ok[:, None] & (s < SPLITS)[None, :]
    m_s = tl.load(PART_M + at, mask=ok, other=float("-inf"))
    l_s = tl.load(PART_L + at, mask=ok, other=0.0)
    m = tl.max(m_s, 1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    l_i = tl.sum(l_s * tl.exp2(m_s - m_safe[:, None]), 1)
    qpos = tl.load(QPOS + (r // (HQ * T)) * T + r % T, mask=r_ok, other=-1)
    seen = (l_i > 0.0) & (qpos >= 0)
    lse = tl.where(seen, m + tl.log2(tl.where(seen, l_i, 1.0)), float("inf"))
    tl.store(LSE + r, lse, mask=r_ok)


_LSE_CONFIG = (64, 128, 4, 3)    # (BLOCK_M, BLOCK_N, num_warps, num_stages) on CUDA: recent-query-column-sums-sweep-nvidia-h200.json
# The column pass's query tile on CUDA (the chunked prefill's column sums keep 64): an H200 sweep of the whole op at
# C 6.5k (recent-query-column-sums-sweep-* in benchmarks/results/) took 348 against 403 us at B 32, m 16,
# 28 against 29 us at B 1, m 16, and 941 against 951 us at B 32, m 64.
_COLUMN_BLOCK_M = 32


def recent_query_column_sums_triton(q: Tensor, q_position: Tensor, k_cache: Tensor, log_weight: Tensor,
                                    position: Tensor, scale: float, *, block_m: int | None = None,
                                    block_n: int | None = None, splits: int | None = None) -> Tensor:
    """The reference's sums (no softcap) in two Triton passes over the keys; [B, Hkv, C] fp32. ``splits``: parts of
    the slots the log-sum-exp pass runs in (default: about two programs an SM on CUDA, 1 elsewhere)."""
    require_triton()
    b, hq, t, d = q.shape
    hkv, c = k_cache.shape[1], k_cache.shape[2]
    if (k_cache.shape != (b, hkv, c, d) or hq % hkv or tuple(q_position.shape) != (b, t)
            or tuple(log_weight.shape) != (b, hkv, c) or tuple(position.shape) != (b, hkv, c)):
        raise ValueError(f"recent_query_column_sums: q [B, Hq, m, D] = {tuple(q.shape)} needs q_position [B, m], "
                         f"k_cache [B, Hkv, C, D], log_weight and position [B, Hkv, C]; got {tuple(q_position.shape)}, "
                         f"{tuple(k_cache.shape)}, {tuple(log_weight.shape)}, {tuple(position.shape)}")
    for name, x in (("q_position", q_position), ("k_cache", k_cache), ("log_weight", log_weight),
                    ("position", position)):
        check_device(name, x, q.device)
    cfg = launch_config(_LSE_CONFIG, q.device.type == "cuda", block_m, block_n)
    q_position, position = q_position.long().contiguous(), position.long().contiguous()
    lw = log_weight.float().contiguous()
    row_blocks = triton.cdiv((hq // hkv) * t, cfg["BLOCK_M"])
    if splits is None:                     # about two programs an SM, whole tiles of slots
        splits = triton.cdiv(2 * _sm_count(q.device), row_blocks * b * hkv) if q.device.type == "cuda" else 1
    chunk, splits = whole_tile_splits(c, min(splits, 64), cfg["BLOCK_N"])
    part_m = torch.empty(b, hq, t, splits, device=q.device, dtype=torch.float32)
    part_l = torch.empty_like(part_m)
    _recent_lse_kernel[(row_blocks, b * hkv, splits)](
        q, q_position, k_cache, lw, position, part_m, part_l, *q.stride(), *k_cache.stride(), hkv, hq // hkv, t, c,
        chunk, splits, float(scale), HEAD_DIM=d, BLOCK_D=max(16, next_pow2(d)), DOT=dot_mode(q), **cfg)
    lse = torch.empty(b, hq, t, device=q.device, dtype=torch.float32)
    rows = b * hq * t
    block_r = 64
    _combine_lse_kernel[(triton.cdiv(rows, block_r),)](part_m, part_l, q_position, lse, rows, hq, t, splits,
                                                        BLOCK_R=block_r, BLOCK_S=next_pow2(splits))
    column_m = block_m or (_COLUMN_BLOCK_M if q.device.type == "cuda" else None)
    return cache_column_sums_triton(q, k_cache, lw, lse, scale, q_position=q_position, position=position,
                                    block_m=column_m, block_n=block_n)


@torch.library.custom_op("kvpass::recent_query_column_sums", mutates_args=())
def recent_query_column_sums(q: Tensor, q_position: Tensor, k_cache: Tensor, log_weight: Tensor, position: Tensor,
                             scale: float, softcap: float | None = None) -> Tensor:
    return recent_query_column_sums_reference(q, q_position, k_cache, log_weight, position, scale, softcap)


@recent_query_column_sums.register_fake
def _(q, q_position, k_cache, log_weight, position, scale, softcap=None):
    return q.new_empty(k_cache.shape[0], k_cache.shape[1], k_cache.shape[2], dtype=torch.float32)


if HAS_TRITON:
    @recent_query_column_sums.register_kernel("cuda")
    def _(q, q_position, k_cache, log_weight, position, scale, softcap=None):
        if softcap is not None or k_cache.shape[2] == 0:
            return recent_query_column_sums_reference(q, q_position, k_cache, log_weight, position, scale, softcap)
        return recent_query_column_sums_triton(q, q_position, k_cache, log_weight, position, scale)
