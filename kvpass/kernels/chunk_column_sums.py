"""Attention column sums of a prefill chunk over a layer's cache and the chunk (chunked prefill; H2O, D2O,
CaM, KVMerger accumulate them over the chunks as over decode steps; docs/policies.md §0.4).

With the logits and masks of ``chunk_attention`` (the cache's C slots first, then the chunk's T keys),
for batch row b, KV head g and key j:

    col[b, g, j] = mean_{h in group g} sum over real query rows i of A_h[i, j]          -> [B, Hkv, C + T] fp32

where A_h is the attention of ``chunk_attention`` (fp32 softmax over cache + chunk, the log-weight of
merged entries included). Pad query rows add nothing. ``lse``: the rows' base-2 log-sum-exps [B, Hq, T] that
``chunk_attention`` returned; the reference computes its own softmax (the result is the same).
Shapes: q: [B, Hq, T, D]; k: [B, Hkv, T, D]; pad: [B] int64; k_cache: [B, Hkv, C, D]; log_weight:
[B, Hkv, C] fp32; position: [B, Hkv, C] int64; pos: [B, T] int64.

On CUDA, without window or softcap and given ``lse``: the chunk's columns come from the prefill column pass
(``head_column_sums_triton`` with these log-sum-exps, so normalised over cache + chunk) and the cache's from
one Triton pass (``cache_column_sums_triton``: per block of slots, every query row of the group,
c_j = sum_m 2^(s2_mj - lse2_m)). Otherwise the reference, in blocks of query rows.
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
)
from kvpass.kernels.chunk_attention import chunk_logit_blocks
from kvpass.kernels.decode_attention import _dot, dot_mode


def chunk_column_sums_reference(q: Tensor, k: Tensor, pad: Tensor, k_cache: Tensor, log_weight: Tensor,
                                position: Tensor, pos: Tensor, scale: float, window: int | None = None,
                                softcap: float | None = None, lse: Tensor | None = None) -> Tensor:
    b, hq, t, _ = q.shape
    hkv, c = k_cache.shape[1], k_cache.shape[2]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    real_row = torch.arange(t, device=q.device)[None, :] >= pad[:, None]          # [B, T]
    out = torch.zeros(b, hkv, c + t, dtype=acc, device=q.device)
    for rows, s in chunk_logit_blocks(q, k, pad, k_cache, log_weight, position, pos, scale, window, softcap):
        p = torch.softmax(s, dim=-1) * real_row[:, None, None, rows, None]         # [B, Hkv, G, n, C + T]
        out += p.sum(dim=3).mean(dim=2)
    return out if acc == torch.float64 else out.float()


# Program (block of slots, (b, g)): every query row m of the group (head g*G + m // T, token m % T):
#     col_j = (1/G) sum_m 2^(log2e (scale q_m . k_j + lw_j) - lse2_m)     (lse2 = +inf on pad rows: adds 0)
# With MASK_POS, only over the rows whose query position qpos_m >= the slot's position kpos_j (the decode steps'
# queries of ``recent_query_column_sums``: a slot written after a step was not in its row).
# The tiles are added up elementwise in a [BLOCK_M, BLOCK_N] accumulator whose rows are summed once at the end.
@triton.jit
def _cache_column_sum_kernel(Q, K, LW, LSE, COL, QPOS, KPOS, sqb, sqh, sqt, sqd, skb, skh, skc, skd, slb, slh, slc,
                             HKV, G, T, C, scale, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT: tl.constexpr,
                             MASK_POS: tl.constexpr):
    pid_bg = tl.program_id(1)
    b = (pid_bg // HKV).to(tl.int64)
    g = (pid_bg % HKV).to(tl.int64)
    j = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    j_ok = j < C
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    kt = tl.load(K + b * skb + g * skh + j[:, None] * skc + d[None, :] * skd, mask=j_ok[:, None] & d_ok[None, :],
                 other=0.0)
    lw2 = tl.load(LW + b * slb + g * slh + j * slc, mask=j_ok, other=float("-inf")) * 1.4426950408889634
    if MASK_POS:
        kpos = tl.load(KPOS + (b * HKV + g) * C + j, mask=j_ok, other=0)
    col = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for m0 in range(0, G * T, BLOCK_M):
        m = m0 + tl.arange(0, BLOCK_M)
        m_ok = m < G * T
        head = g * G + m // T
        tok = m % T
        q = tl.load(Q + b * sqb + head[:, None] * sqh + tok[:, None] * sqt + d[None, :] * sqd,
                    mask=m_ok[:, None] & d_ok[None, :], other=0.0)
        lse = tl.load(LSE + (b * HKV * G + head) * T + tok, mask=m_ok, other=float("inf"))
        x = _dot(q, tl.trans(kt), DOT) * (scale * 1.4426950408889634) + lw2[None, :] - lse[:, None]
        if MASK_POS:
            qpos = tl.load(QPOS + b * T + tok, mask=m_ok, other=-1)
            x = tl.where(kpos[None, :] <= qpos[:, None], x, float("-inf"))
        col += tl.exp2(x)
    tl.store(COL + (b * HKV + g) * C + j, tl.sum(col, axis=0) / G, mask=j_ok)


_CACHE_COLUMN_SUM_CONFIG = (64, 128, 4, 2)     # (BLOCK_M, BLOCK_N, num_warps, num_stages) on CUDA


def cache_column_sums_triton(q: Tensor, k_cache: Tensor, log_weight: Tensor, lse: Tensor, scale: float, *,
                             q_position: Tensor | None = None, position: Tensor | None = None,
                             block_m: int | None = None, block_n: int | None = None, num_warps: int | None = None,
                             num_stages: int | None = None) -> Tensor:
    """The cache part of the column sums: [B, Hkv, C] fp32, each query row normalised by ``lse`` [B, Hq, T]
    (+inf rows add nothing); no mask (every live slot precedes every query; empty slots have lw = -inf), or,
    given ``q_position`` [B, T] and ``position`` [B, Hkv, C] int64, only the slots of positions <= the row's."""
    require_triton()
    b, hq, t, d = q.shape
    hkv, c = k_cache.shape[1], k_cache.shape[2]
    if k_cache.shape != (b, hkv, c, d) or hq % hkv or tuple(log_weight.shape) != (b, hkv, c) \
            or tuple(lse.shape) != (b, hq, t):
        raise ValueError(f"q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, log_weight {tuple(log_weight.shape)} and "
                         f"lse {tuple(lse.shape)} do not match ([B, Hq, T, D], [B, Hkv, C, D], [B, Hkv, C], [B, Hq, T])")
    for name, x in (("q", q), ("k_cache", k_cache), ("log_weight", log_weight), ("lse", lse)):
        check_device(name, x, q.device)
    cfg = launch_config(_CACHE_COLUMN_SUM_CONFIG, q.device.type == "cuda", block_m, block_n, num_warps, num_stages)
    col = torch.empty(b, hkv, c, device=q.device, dtype=torch.float32)
    lw = log_weight.float()
    lse = lse.float().contiguous()
    masked = q_position is not None
    if masked:
        if position is None or tuple(q_position.shape) != (b, t) or tuple(position.shape) != (b, hkv, c):
            raise ValueError(f"the position mask needs q_position [B, T] = {(b, t)} and position [B, Hkv, C] = "
                             f"{(b, hkv, c)}; got {None if q_position is None else tuple(q_position.shape)}, "
                             f"{None if position is None else tuple(position.shape)}")
        q_position, position = q_position.long().contiguous(), position.long().contiguous()
    _cache_column_sum_kernel[(triton.cdiv(c, cfg["BLOCK_N"]), b * hkv)](
        q, k_cache, lw, lse, col, q_position if masked else lse, position if masked else lse,
        *q.stride(), *k_cache.stride(), *lw.stride(), hkv, hq // hkv, t, c, float(scale),
        HEAD_DIM=d, BLOCK_D=max(16, next_pow2(d)), DOT=dot_mode(q), MASK_POS=masked, **cfg)
    return col


def chunk_column_sums_cuda(q: Tensor, k: Tensor, pad: Tensor, k_cache: Tensor, log_weight: Tensor,
                           position: Tensor, pos: Tensor, scale: float, window: int | None = None,
                           softcap: float | None = None, lse: Tensor | None = None) -> Tensor:
    if lse is None or window is not None or softcap is not None or k_cache.shape[2] == 0:
        return chunk_column_sums_reference(q, k, pad, k_cache, log_weight, position, pos, scale, window, softcap)
    from kvpass.kernels.attention_column_sums import head_column_sums_triton

    b, hq, t, _ = q.shape
    hkv = k.shape[1]
    lse = lse.float().contiguous()
    own = head_column_sums_triton(q, k, pad, scale, lse=lse).reshape(b, hkv, hq // hkv, t).mean(dim=2)
    return torch.cat([cache_column_sums_triton(q, k_cache, log_weight, lse, scale), own], dim=-1)


@torch.library.custom_op("kvpass::chunk_column_sums", mutates_args=())
def chunk_column_sums(q: Tensor, k: Tensor, pad: Tensor, k_cache: Tensor, log_weight: Tensor, position: Tensor,
                      pos: Tensor, scale: float, window: int | None = None, softcap: float | None = None,
                      lse: Tensor | None = None) -> Tensor:
    return chunk_column_sums_reference(q, k, pad, k_cache, log_weight, position, pos, scale, window, softcap, lse)


@chunk_column_sums.register_fake
def _(q, k, pad, k_cache, log_weight, position, pos, scale, window=None, softcap=None, lse=None):
    return q.new_empty(k.shape[0], k.shape[1], k_cache.shape[2] + k.shape[2], dtype=torch.float32)


if HAS_TRITON:
    @chunk_column_sums.register_kernel("cuda")
    def _(q, k, pad, k_cache, log_weight, position, pos, scale, window=None, softcap=None, lse=None):
        return chunk_column_sums_cuda(q, k, pad, k_cache, log_weight, position, pos, scale, window, softcap, lse)
