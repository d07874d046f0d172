"""Accumulated attention column sums of the prefill (H2O, D2O, CaM, KVMerger; docs/policies.md §0.4).

For batch b, KV head g and key j:

    col_sum[b, g, j] = mean_{h in group g} sum_i A_h[i, j]

where A_h is the prefill attention of query head h with the mask of ``prefill_attention``
(causal, left pads, optional window, optional softcap). Pad query rows contribute nothing.
Computed in blocks of query rows with an fp32 softmax: never materialises the T x T matrix of
all heads at once. Shapes: q: [B, Hq, T, D]; k: [B, Hkv, T, D]; pad: [B] int64 -> [B, Hkv, T] fp32.

On CUDA the per-head sums come from ``head_column_sums_triton``: two flash-attention-style passes
(row log-sum-exps, then column sums of exp(s - lse)), tiles of q.k^T on the tensor cores, no T x T
buffer, about the work of one attention forward.
"""

from __future__ import annotations

from collections.abc import Iterator

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
from kvpass.kernels.decode_attention import _dot, _tanh, dot_mode
from kvpass.kernels.prefill_attention import prefill_mask


def head_column_sums(q: Tensor, k: Tensor, pad: Tensor, scale: float, window: int | None = None,
                     softcap: float | None = None, block: int = 256, lse: Tensor | None = None) -> Tensor:
    """c[b, h, j] = sum over real query rows i of A_h[i, j], per query head: [B, Hq, T] fp32.
    The Triton kernels on CUDA (given ``lse``, the rows' base-2 log-sum-exps [B, Hq, T] from
    ``prefill_attention_lse``, only the column pass runs); elsewhere ``head_column_sums_rows``, which
    computes its own softmax (``lse`` is an optimisation: the result is the same)."""
    if q.device.type == "cuda" and HAS_TRITON:
        return head_column_sums_triton(q, k, pad, scale, window, softcap, lse=lse)
    return head_column_sums_rows(q, k, pad, scale, window, softcap, block)


def masked_logit_blocks(q: Tensor, k: Tensor, pad: Tensor, scale: float, window: int | None = None,
                        softcap: float | None = None, block: int = 256) -> Iterator[tuple[slice, Tensor]]:
    """The prefill logits in row blocks of ``block`` queries, fp32 (float64 for float64 inputs):
    (rows, s [B, Hkv, G, len(rows), end]) over the keys up to the block's last row (causal: the later ones
    are masked anyway), -inf where ``prefill_mask`` forbids. Never the T x T matrix of all heads at once."""
    b, hq, t, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    mask = prefill_mask(pad, t, window)                                  # [B, 1, T, T]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    kf = k.to(acc)
    for start in range(0, t, block):
        rows = slice(start, start + block)
        nrows = q[:, :, rows].shape[2]
        end = start + nrows                       # causal: rows < end attend to keys < end only
        qb = q[:, :, rows].to(acc).reshape(b, hkv, group * nrows, d)
        s = torch.matmul(qb, kf[:, :, :end].transpose(-1, -2)) * scale     # [B, Hkv, G*rows, end]
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        yield rows, s.reshape(b, hkv, group, nrows, end).masked_fill(~mask[:, :, None, rows, :end], float("-inf"))


def head_column_sums_rows(q: Tensor, k: Tensor, pad: Tensor, scale: float, window: int | None = None,
                          softcap: float | None = None, block: int = 256) -> Tensor:
    """``head_column_sums`` in plain torch: ``masked_logit_blocks`` with an fp32 softmax (float64 for
    float64 inputs); pad query rows contribute nothing."""
    b, hq, t, _ = q.shape
    real_row = torch.arange(t, device=q.device)[None, :] >= pad[:, None]  # [B, T]
    out = torch.zeros(b, hq, t, dtype=torch.float64 if q.dtype == torch.float64 else torch.float32, device=q.device)
    for rows, s in masked_logit_blocks(q, k, pad, scale, window, softcap, block):
        end = s.shape[-1]
        p = torch.softmax(s, dim=-1) * real_row[:, None, None, rows, None]
        out[:, :, :end] += p.sum(dim=3).reshape(b, hq, end)
    return out


# --------------------------------------------------------------------------------------- Triton
# Query head h (KV head g = h // G) of batch row b, rows i, keys j, base 2 (x2 = x * log2 e):
#     s2_ij = log2e * scale * q_i . k_j   (softcap c: log2e * c * tanh(scale * q_i . k_j / c))
#     allowed(i, j) = pad <= j <= i and (no window or i - j < window); pad rows (i < pad) are skipped
# pass 1, one program per (b, h, block of rows):  lse2_i = log2 sum_{j allowed} 2^(s2_ij)  (online max)
# pass 2, one program per (b, h, block of keys):  c_j = sum_{i >= pad, allowed} 2^(s2_ij - lse2_i)
#     (the tiles of 2^(s2 - lse2) are added up elementwise in a [BLOCK_M, BLOCK_N] accumulator; its rows are
#     summed once, at the end)
# Each pass visits only the tiles under the causal (and window) band: about one attention forward.
# A program's own operand (pass 1: its q rows; pass 2: its keys) is loaded once; the tiles that lie
# wholly inside the band (every pair allowed) skip the mask, so only the tiles on the diagonal, the pad
# edge and the window edge build it. Pad rows need no mask in pass 2: their lse2 is +inf (they add 0).


@triton.jit
def _load_rows(X, b, h, r0, sxb, sxh, sxt, sxd, T, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
               BLOCK_D: tl.constexpr):
    """Rows [r0, r0 + BLOCK) of head h of batch row b: [BLOCK, BLOCK_D] (zeros past T and HEAD_DIM)."""
    r = r0 + tl.arange(0, BLOCK)
    dd = tl.arange(0, BLOCK_D)
    return tl.load(X + b * sxb + h * sxh + r[:, None] * sxt + dd[None, :] * sxd,
                   mask=(r[:, None] < T) & (dd[None, :] < HEAD_DIM), other=0.0)


@triton.jit
def _masked(s2, i0, j0, pad, T, WINDOW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """s2 with -inf where (i, j) is not allowed (and on pad rows and rows past T)."""
    i = i0 + tl.arange(0, BLOCK_M)
    j = j0 + tl.arange(0, BLOCK_N)
    allowed = (j[None, :] <= i[:, None]) & (j[None, :] >= pad) & (i[:, None] >= pad) & (i[:, None] < T)
    if WINDOW > 0:
        allowed = allowed & (i[:, None] - j[None, :] < WINDOW)
    return tl.where(allowed, s2, float("-inf"))


@triton.jit
def _tile_logits2(q, k, i0, j0, pad, T, scale, softcap, WINDOW: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, HAS_SOFTCAP: tl.constexpr, DOT: tl.constexpr, MASK: tl.constexpr):
    """Base-2 logits of rows [i0, i0 + BLOCK_M) (q) x keys [j0, j0 + BLOCK_N) (k): [BLOCK_M, BLOCK_N] fp32,
    -inf where not allowed if MASK (a tile inside the band needs none)."""
    s = _dot(q, tl.trans(k), DOT) * scale
    if HAS_SOFTCAP:
        s = softcap * _tanh(s / softcap)
    s2 = s * 1.4426950408889634
    if MASK:
        s2 = _masked(s2, i0, j0, pad, T, WINDOW, BLOCK_M, BLOCK_N)
    return s2


@triton.jit
def _lse_tile(q, k_base, i0, j0, m, l_sum, pad, T, skt, skd, scale, softcap, HEAD_DIM: tl.constexpr,
              WINDOW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
              HAS_SOFTCAP: tl.constexpr, DOT: tl.constexpr, MASK: tl.constexpr):
    """Online log-sum-exp: fold key tile [j0, j0 + BLOCK_N) into the rows' running (max, sum)."""
    k = _load_rows(k_base, 0, 0, j0, 0, 0, skt, skd, T, HEAD_DIM, BLOCK_N, BLOCK_D)
    s2 = _tile_logits2(q, k, i0, j0, pad, T, scale, softcap, WINDOW, BLOCK_M, BLOCK_N, HAS_SOFTCAP, DOT, MASK)
    m_new = tl.maximum(m, tl.max(s2, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    return m_new, l_sum * tl.exp2(m - m_safe) + tl.sum(tl.exp2(s2 - m_safe[:, None]), axis=1)


@triton.jit
def _row_lse_kernel(Q, K, PAD, LSE, sqb, sqh, sqt, sqd, skb, skh, skt, skd, HQ, G, T, scale, softcap,
                    HEAD_DIM: tl.constexpr, WINDOW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_D: tl.constexpr, HAS_SOFTCAP: tl.constexpr, DOT: tl.constexpr):
    bh = tl.program_id(1)
    b, h = bh // HQ, bh % HQ
    g = h // G
    i0 = tl.program_id(0) * BLOCK_M
    pad = tl.load(PAD + b)
    lo = pad
    if WINDOW > 0:
        lo = tl.maximum(lo, i0 - WINDOW + 1)
    lo = (lo // BLOCK_N) * BLOCK_N
    hi = tl.minimum(i0 + BLOCK_M, T)
    # key tiles [a, bnd) lie inside the band for every row of this block: j0 >= pad, j0 + BLOCK_N - 1 <= i0
    # (causal) and i0 + BLOCK_M - 1 - j0 < WINDOW. (A block holding pad rows, i0 < pad, has none.)
    first = pad
    if WINDOW > 0:
        first = tl.maximum(first, i0 + BLOCK_M - WINDOW)
    a = tl.minimum(tl.maximum(tl.cdiv(first, BLOCK_N) * BLOCK_N, lo), hi)
    bnd = tl.minimum(tl.maximum(((i0 + 1) // BLOCK_N) * BLOCK_N, a), hi)
    q = _load_rows(Q, b, h, i0, sqb, sqh, sqt, sqd, T, HEAD_DIM, BLOCK_M, BLOCK_D)
    k_base = K + b * skb + g * skh
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    for j0 in range(lo, a, BLOCK_N):
        m, l_sum = _lse_tile(q, k_base, i0, j0, m, l_sum, pad, T, skt, skd, scale, softcap, HEAD_DIM, WINDOW,
                             BLOCK_M, BLOCK_N, BLOCK_D, HAS_SOFTCAP, DOT, True)
    for j0 in range(a, bnd, BLOCK_N):
        m, l_sum = _lse_tile(q, k_base, i0, j0, m, l_sum, pad, T, skt, skd, scale, softcap, HEAD_DIM, WINDOW,
                             BLOCK_M, BLOCK_N, BLOCK_D, HAS_SOFTCAP, DOT, False)
    for j0 in range(bnd, hi, BLOCK_N):
        m, l_sum = _lse_tile(q, k_base, i0, j0, m, l_sum, pad, T, skt, skd, scale, softcap, HEAD_DIM, WINDOW,
                             BLOCK_M, BLOCK_N, BLOCK_D, HAS_SOFTCAP, DOT, True)
    i = i0 + tl.arange(0, BLOCK_M)
    lse = tl.where(l_sum > 0, m + tl.log2(tl.maximum(l_sum, 1e-30)), float("inf"))    # +inf: row adds nothing
    tl.store(LSE + bh * T + i, lse, mask=i < T)


@triton.jit
def _column_tile(q_base, lse_base, k, i0, j0, pad, T, sqt, sqd, scale, softcap, HEAD_DIM: tl.constexpr,
                 WINDOW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                 HAS_SOFTCAP: tl.constexpr, DOT: tl.constexpr, MASK: tl.constexpr):
    """2^(s2_ij - lse2_i) of rows [i0, i0 + BLOCK_M) x the tile's keys: [BLOCK_M, BLOCK_N] fp32. The caller
    adds the tiles up elementwise and sums the rows once at the end (no cross-warp reduction per tile).
    Without a softcap s2_ij - lse2_i is one multiply-add of the dot product (scale and log2 e folded)."""
    q = _load_rows(q_base, 0, 0, i0, 0, 0, sqt, sqd, T, HEAD_DIM, BLOCK_M, BLOCK_D)
    i = i0 + tl.arange(0, BLOCK_M)
    lse = tl.load(lse_base + i, mask=i < T, other=float("inf"))
    if HAS_SOFTCAP:
        x = _tile_logits2(q, k, i0, j0, pad, T, scale, softcap, WINDOW, BLOCK_M, BLOCK_N, HAS_SOFTCAP, DOT,
                          MASK) - lse[:, None]
    else:
        x = _dot(q, tl.trans(k), DOT) * (scale * 1.4426950408889634) - lse[:, None]
        if MASK:
            x = _masked(x, i0, j0, pad, T, WINDOW, BLOCK_M, BLOCK_N)
    return tl.exp2(x)


@triton.jit
def _column_sum_kernel(Q, K, PAD, LSE, COL, sqb, sqh, sqt, sqd, skb, skh, skt, skd, HQ, G, T, scale, softcap,
                       HEAD_DIM: tl.constexpr, WINDOW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_D: tl.constexpr, HAS_SOFTCAP: tl.constexpr, DOT: tl.constexpr):
    bh = tl.program_id(1)
    b, h = bh // HQ, bh % HQ
    g = h // G
    j0 = tl.program_id(0) * BLOCK_N
    pad = tl.load(PAD + b)
    lo = (tl.maximum(j0, pad) // BLOCK_M) * BLOCK_M
    hi = T
    if WINDOW > 0:
        hi = tl.minimum(T, j0 + BLOCK_N - 1 + WINDOW)
    # row tiles [a, bnd) lie inside the band for every key of this block (no pad keys here):
    # i0 >= j0 + BLOCK_N - 1 (causal) and i0 + BLOCK_M - 1 - j0 < WINDOW
    a = tl.minimum(tl.maximum(tl.cdiv(j0 + BLOCK_N - 1, BLOCK_M) * BLOCK_M, lo), hi)
    a = tl.where(j0 < pad, hi, a)
    bnd = hi
    if WINDOW > 0:
        bnd = tl.cdiv(j0 + WINDOW - BLOCK_M + 1, BLOCK_M) * BLOCK_M
    bnd = tl.minimum(tl.maximum(bnd, a), hi)
    k = _load_rows(K, b, g, j0, skb, skh, skt, skd, T, HEAD_DIM, BLOCK_N, BLOCK_D)
    q_base = Q + b * sqb + h * sqh
    lse_base = LSE + bh * T
    col = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for i0 in range(lo, a, BLOCK_M):
        col += _column_tile(q_base, lse_base, k, i0, j0, pad, T, sqt, sqd, scale, softcap, HEAD_DIM, WINDOW,
                            BLOCK_M, BLOCK_N, BLOCK_D, HAS_SOFTCAP, DOT, True)
    for i0 in range(a, bnd, BLOCK_M):
        col += _column_tile(q_base, lse_base, k, i0, j0, pad, T, sqt, sqd, scale, softcap, HEAD_DIM, WINDOW,
                            BLOCK_M, BLOCK_N, BLOCK_D, HAS_SOFTCAP, DOT, False)
    for i0 in range(bnd, hi, BLOCK_M):
        col += _column_tile(q_base, lse_base, k, i0, j0, pad, T, sqt, sqd, scale, softcap, HEAD_DIM, WINDOW,
                            BLOCK_M, BLOCK_N, BLOCK_D, HAS_SOFTCAP, DOT, True)
    j = j0 + tl.arange(0, BLOCK_N)
    tl.store(COL + bh * T + j, tl.sum(col, axis=0), mask=j < T)


# (BLOCK_M, BLOCK_N, num_warps, num_stages) per pass on CUDA: the fastest of a sweep on an H200 at T = 32k,
# Hq 32, Hkv 8, D 128, bf16 (benchmarks/probes/decode_fusion_and_prefill_stats.py: pass 1 10.6 ms, from 16.3
# before the band tiles skipped the mask; pass 2 9.1 ms, from 18.8 before that and 14.0 before its 2D
# accumulator, 10.7 with it at pass 1's blocks). The interpreter: 16s. Pass 1 runs only without an lse given.
# Pass 2 re-swept on an H100 (benchmarks/probes/column_pass_sweep.py, with scale, log2 e and lse in one
# multiply-add): 2 stages 8.1 ms, 3 stages 8.8; neither ex2.approx.ftz.f32 (8.3), ex2.approx.f16x2 (9.5-10.1)
# nor issuing the next tile's dot before this tile's exponentials (8.4-9.1) was faster. The exponentials are
# not what bounds it (benchmarks/probes/column_pass_exp_split.py): the same loop with none at all takes 7.95 ms
# (9.46 with them, in 64 + 64-key tiles); moving some of them onto the FMA units as a polynomial is slower
# (9.7-13.4), and so are the key block as the MMA's M side with per-tile row sums (8.6-14.4) and Triton's
# warp specialisation (12.6, or no compile).
_ROW_LSE_CONFIG = (128, 64, 8, 3)
_COLUMN_SUM_CONFIG = (64, 128, 4, 2)


def _launch_args(q: Tensor, k: Tensor, pad: Tensor, scale: float, window: int | None, softcap: float | None):
    b, hq, t, d = q.shape
    hkv = k.shape[1]
    if k.shape != (b, hkv, t, d) or hq % hkv:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} do not match (k must be [B, Hkv, T, D], Hkv | Hq)")
    for name, x in (("q", q), ("k", k), ("pad", pad)):
        check_device(name, x, q.device)
    args = (*q.stride(), *k.stride(), hq, hq // hkv, t, float(scale), float(softcap) if softcap is not None else 1.0)
    meta = dict(HEAD_DIM=d, WINDOW=int(window or 0), BLOCK_D=max(16, next_pow2(d)), HAS_SOFTCAP=softcap is not None,
                DOT=dot_mode(q))
    return pad.to(torch.int64).contiguous(), args, meta


def row_lse_triton(q: Tensor, k: Tensor, pad: Tensor, scale: float, window: int | None = None,
                   softcap: float | None = None, *, block_m: int | None = None, block_n: int | None = None) -> Tensor:
    """Pass 1: lse2[b, h, i] = log2 sum_{j allowed} 2^(s2_ij), +inf on pad rows: [B, Hq, T] fp32."""
    require_triton()
    pad, args, meta = _launch_args(q, k, pad, scale, window, softcap)
    b, hq, t, _ = q.shape
    cfg = launch_config(_ROW_LSE_CONFIG, q.device.type == "cuda", block_m, block_n)
    lse = torch.empty(b, hq, t, device=q.device, dtype=torch.float32)
    _row_lse_kernel[(triton.cdiv(t, cfg["BLOCK_M"]), b * hq)](q, k, pad, lse, *args, **meta, **cfg)
    return lse


def head_column_sums_triton(q: Tensor, k: Tensor, pad: Tensor, scale: float, window: int | None = None,
                            softcap: float | None = None, *, lse: Tensor | None = None, block_m: int | None = None,
                            block_n: int | None = None, num_warps: int | None = None,
                            num_stages: int | None = None) -> Tensor:
    """``head_column_sums`` by the Triton passes: [B, Hq, T] fp32. ``lse``: the rows' base-2 log-sum-exps
    [B, Hq, T] (+inf on pad rows) where the prefill attention already gave them
    (``prefill_attention_lse``); else pass 1 computes them first."""
    if lse is None:
        lse = row_lse_triton(q, k, pad, scale, window, softcap, block_m=block_m, block_n=block_n)
    require_triton()
    pad, args, meta = _launch_args(q, k, pad, scale, window, softcap)
    b, hq, t, _ = q.shape
    if tuple(lse.shape) != (b, hq, t) or lse.dtype != torch.float32:
        raise ValueError(f"lse must be [B, Hq, T] = {(b, hq, t)} float32, got {tuple(lse.shape)} {lse.dtype}")
    check_device("lse", lse, q.device)
    cfg = launch_config(_COLUMN_SUM_CONFIG, q.device.type == "cuda", block_m, block_n, num_warps, num_stages)
    col = torch.empty(b, hq, t, device=q.device, dtype=torch.float32)
    _column_sum_kernel[(triton.cdiv(t, cfg["BLOCK_N"]), b * hq)](q, k, pad, lse.contiguous(), col, *args, **meta, **cfg)
    return col


def attention_column_sums_reference(q: Tensor, k: Tensor, pad: Tensor, scale: float, window: int | None = None,
                                    softcap: float | None = None, block: int = 256, lse: Tensor | None = None) -> Tensor:
    b, hq, t, _ = q.shape
    hkv = k.shape[1]
    c = head_column_sums(q, k, pad, scale, window, softcap, block, lse)
    return c.reshape(b, hkv, hq // hkv, t).mean(dim=2)


@torch.library.custom_op("kvpass::attention_column_sums", mutates_args=())
def attention_column_sums(q: Tensor, k: Tensor, pad: Tensor, scale: float, window: int | None = None,
                          softcap: float | None = None, lse: Tensor | None = None) -> Tensor:
    return attention_column_sums_reference(q, k, pad, scale, window, softcap, lse=lse)


@attention_column_sums.register_fake
def _(q, k, pad, scale, window=None, softcap=None, lse=None):
    return q.new_empty(k.shape[0], k.shape[1], k.shape[2], dtype=torch.float32)
