"""The most attention each cached entry receives from a chunk of queries (KVzip's context-reconstruction score,
docs/policies.md §6.13: the queries are those of the model repeating the context, kvpass/runtime/reconstruction.py).

With the logits and masks of ``chunk_attention`` (the cache's C slots first, then the chunk's T keys), for batch
row b, KV head g and cache slot s:

    top[b, g, s] = max over query heads h in group g and real query rows i of A_h[i, s]        -> [B, Hkv, C] fp32

where A_h is the attention of ``chunk_attention`` (fp32 softmax over cache + chunk, the log-weight of merged entries
included): the probability mass query i puts on entry s, normalised over every key it sees. Pad query rows and empty
slots give 0. ``lse``: the rows' base-2 log-sum-exps [B, Hq, T] that ``chunk_attention`` returned (pad rows +inf);
the reference computes its own softmax (the result is the same).
Shapes: q: [B, Hq, T, D]; k: [B, Hkv, T, D]; pad: [B] int64; k_cache: [B, Hkv, C, D]; log_weight: [B, Hkv, C] fp32;
position: [B, Hkv, C] int64; pos: [B, T] int64.

On CUDA, without window or softcap and given ``lse``: one Triton pass over the cache (``cache_attention_max_triton``:
per block of slots, every query row m of the group, top_s = max_m 2^(s2_ms - lse2_m)). Otherwise the reference, in
blocks of query rows. Traffic: reads q and the cache's K once per block of slots; C * G * T dot products.
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


def chunk_attention_max_reference(q: Tensor, k: Tensor, pad: Tensor, k_cache: Tensor, log_weight: Tensor,
                                  position: Tensor, pos: Tensor, scale: float, window: int | None = None,
                                  softcap: float | None = None, lse: Tensor | None = None) -> Tensor:
    b, _, t, _ = q.shape
    hkv, c = k_cache.shape[1], k_cache.shape[2]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    real_row = torch.arange(t, device=q.device)[None, :] >= pad[:, None]          # [B, T]
    out = torch.zeros(b, hkv, c, dtype=acc, device=q.device)
    for rows, s in chunk_logit_blocks(q, k, pad, k_cache, log_weight, position, pos, scale, window, softcap):
        p = torch.softmax(s, dim=-1)[..., :c] * real_row[:, None, None, rows, None]    # [B, Hkv, G, n, C]
        out = torch.maximum(out, p.amax(dim=(2, 3)))
    return out if acc == torch.float64 else out.float()


# Program (block of slots, (b, g)): every query row m of the group (head g*G + m // T, token m % T):
#     top_j = max_m 2^(log2e (scale q_m . k_j + lw_j) - lse2_m)        (lse2 = +inf on pad rows: 0)
# The tiles are reduced elementwise into a [BLOCK_M, BLOCK_N] accumulator whose rows are reduced once at the end.
@triton.jit
def _cache_attention_max_kernel(Q, K, LW, LSE, TOP, sqb, sqh, sqt, sqd, skb, skh, skc, skd, slb, slh, slc,
                                HKV, G, T, C, scale, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                                BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT: tl.constexpr):
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
    top = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for m0 in range(0, G * T, BLOCK_M):
        m = m0 + tl.arange(0, BLOCK_M)
        m_ok = m < G * T
        head = g * G + m // T
        tok = m % T
        q = tl.load(Q + b * sqb + head[:, None] * sqh + tok[:, None] * sqt + d[None, :] * sqd,
                    mask=m_ok[:, None] & d_ok[None, :], other=0.0)
        lse = tl.load(LSE + (b * HKV * G + head) * T + tok, mask=m_ok, other=float("inf"))
        x = _dot(q, tl.trans(kt), DOT) * (scale * 1.4426950408889634) + lw2[None, :] - lse[:, None]
        top = tl.maximum(top, tl.exp2(x))
    tl.store(TOP + (b * HKV + g) * C + j, tl.max(top, axis=0), mask=j_ok)


_CACHE_ATTENTION_MAX_CONFIG = (64, 128, 4, 2)     # (BLOCK_M, BLOCK_N, num_warps, num_stages) on CUDA


def cache_attention_max_triton(q: Tensor, k_cache: Tensor, log_weight: Tensor, lse: Tensor, scale: float, *,
                               block_m: int | None = None, block_n: int | None = None, num_warps: int | None = None,
                               num_stages: int | None = None) -> Tensor:
    """[B, Hkv, C] fp32: each slot's largest attention from the rows of ``q`` [B, Hq, T, D], each row normalised by
    ``lse`` [B, Hq, T] (+inf rows give 0); no mask (every live slot precedes every query; empty slots lw = -inf)."""
    require_triton()
    b, hq, t, d = q.shape
    hkv, c = k_cache.shape[1], k_cache.shape[2]
    if k_cache.shape != (b, hkv, c, d) or hq % hkv or tuple(log_weight.shape) != (b, hkv, c) \
            or tuple(lse.shape) != (b, hq, t):
        raise ValueError(f"q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, log_weight {tuple(log_weight.shape)} and "
                         f"lse {tuple(lse.shape)} do not match ([B, Hq, T, D], [B, Hkv, C, D], [B, Hkv, C], [B, Hq, T])")
    for name, x in (("q", q), ("k_cache", k_cache), ("log_weight", log_weight), ("lse", lse)):
        check_device(name, x, q.device)
    cfg = launch_config(_CACHE_ATTENTION_MAX_CONFIG, q.device.type == "cuda", block_m, block_n, num_warps, num_stages)
    top = torch.empty(b, hkv, c, device=q.device, dtype=torch.float32)
    lw = log_weight.float()
    lse = lse.float().contiguous()
    _cache_attention_max_kernel[(triton.cdiv(c, cfg["BLOCK_N"]), b * hkv)](
        q, k_cache, lw, lse, top, *q.stride(), *k_cache.stride(), *lw.stride(), hkv, hq // hkv, t, c, float(scale),
        HEAD_DIM=d, BLOCK_D=max(16, next_pow2(d)), DOT=dot_mode(q), **cfg)
    return top


def chunk_attention_max_cuda(q: Tensor, k: Tensor, pad: Tensor, k_cache: Tensor, log_weight: Tensor,
                             position: Tensor, pos: Tensor, scale: float, window: int | None = None,
                             softcap: float | None = None, lse: Tensor | None = None) -> Tensor:
    if lse is None or window is not None or softcap is not None or k_cache.shape[2] == 0:
        return chunk_attention_max_reference(q, k, pad, k_cache, log_weight, position, pos, scale, window, softcap)
    return cache_attention_max_triton(q, k_cache, log_weight, lse, scale)


@torch.library.custom_op("kvpass::chunk_attention_max", mutates_args=())
def chunk_attention_max(q: Tensor, k: Tensor, pad: Tensor, k_cache: Tensor, log_weight: Tensor, position: Tensor,
                        pos: Tensor, scale: float, window: int | None = None, softcap: float | None = None,
                        lse: Tensor | None = None) -> Tensor:
    return chunk_attention_max_reference(q, k, pad, k_cache, log_weight, position, pos, scale, window, softcap, lse)


@chunk_attention_max.register_fake
def _(q, k, pad, k_cache, log_weight, position, pos, scale, window=None, softcap=None, lse=None):
    return q.new_empty(k.shape[0], k.shape[1], k_cache.shape[2], dtype=torch.float32)


if HAS_TRITON:
    @chunk_attention_max.register_kernel("cuda")
    def _(q, k, pad, k_cache, log_weight, position, pos, scale, window=None, softcap=None, lse=None):
        return chunk_attention_max_cuda(q, k, pad, k_cache, log_weight, position, pos, scale, window, softcap, lse)
