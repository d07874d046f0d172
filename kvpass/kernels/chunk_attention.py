"""Attention of a chunk of prompt queries over a layer's cache and over the chunk itself (chunked prefill,
kvpass/runtime/chunked_prefill.py).

A chunk is T consecutive prompt tokens of every batch row (left-padded: row b's first ``pad[b]`` are
padding), prefilled after the row's earlier tokens went into the layer's cache (and were perhaps
compressed: merged entries carry a log-weight, evicted ones are gone). For batch row b, query head h
(KV head g = h // G) and a real query row i (pad[b] <= i < T), with positions pos[b, i]:

    cache slot s < C:  s_is = scale q_i . kc_s (softcap c: c tanh(. / c)) + log_weight[b, g, s],
                       allowed iff the slot is live (log_weight > -inf) and
                       (window is None or pos[b, i] - position[b, g, s] < window)
    chunk key j < T:   s_ij = scale q_i . k_j (softcap), allowed iff ``prefill_mask(pad, T, window)``
    o_i = softmax over the allowed keys of s, applied to their values
    lse2_i = log2 sum over the allowed keys of 2^(log2e s)              (base 2, as ``prefill_attention_lse``)

Every cache entry precedes every chunk token, so the cache part has no causal mask; the log-weight is the
bias of merged entries, as in ``decode_attention``. Pad query rows attend to themselves only (as in
``prefill_attention``), never to the cache, and their lse2 is +inf (they add nothing to column sums).
With an empty cache (C = 0, or no live slot) this is ``prefill_attention_lse`` of the chunk.

Shapes: q: [B, Hq, T, D]; k, v: [B, Hkv, T, D]; pad: [B] int64; k_cache, v_cache: [B, Hkv, C, D];
log_weight: [B, Hkv, C] fp32; position: [B, Hkv, C] int64 (-1 empty); pos: [B, T] int64. Returns
(o [B, Hq, T, D], lse2 [B, Hq, T] fp32).

On CUDA, without window or softcap, the chunk part is ``prefill_attention_lse`` (causal, cuDNN / SDPA), the
cache part one Triton flash pass with the log-weight bias (``cache_attention_triton``: all G query heads of
a KV head as G*T rows of one program grid, so the cache is never repeated per query head), and the two are
merged by their log-sum-exps. Otherwise the reference, in blocks of query rows.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from kvpass.cache import EMPTY
from kvpass.kernels._triton import (
    HAS_TRITON,
    check_device,
    launch_config,
    next_pow2,
    require_triton,
    tl,
    triton,
)
from kvpass.kernels.decode_attention import LOG2E, _dot, dot_mode
from kvpass.kernels.prefill_attention import prefill_mask


def chunk_logit_blocks(q: Tensor, k: Tensor, pad: Tensor, k_cache: Tensor, log_weight: Tensor, position: Tensor,
                       pos: Tensor, scale: float, window: int | None = None, softcap: float | None = None,
                       block: int = 256, rows: slice | None = None) -> Iterator[tuple[slice, Tensor]]:
    """The logits of the module docstring in blocks of ``block`` query rows (of ``rows``, default all):
    (rows, s [B, Hkv, G, len(rows), C + T]), the C cache slots first, with the log-weight added, -inf where
    not allowed; fp32 (float64 for float64 inputs). Never more than one block of rows at a time."""
    b, hq, t, d = q.shape
    hkv, c = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    keys = torch.cat([k_cache.to(acc), k.to(acc)], dim=2)                      # [B, Hkv, C + T, D]
    live = log_weight > EMPTY                                                  # [B, Hkv, C]
    bias = torch.where(live, log_weight, 0.0).to(acc)
    chunk_allowed = prefill_mask(pad, t, window)                               # [B, 1, T, T]
    real_row = torch.arange(t, device=q.device)[None, :] >= pad[:, None]       # [B, T]
    wanted = rows if rows is not None else slice(0, t)
    first, last = wanted.indices(t)[:2]
    for start in range(first, last, block):
        part = slice(start, min(start + block, last))
        n = part.stop - part.start
        qb = q[:, :, part].to(acc).reshape(b, hkv, group * n, d)
        s = torch.matmul(qb, keys.transpose(-1, -2)) * scale                    # [B, Hkv, G*n, C + T]
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        s = s.reshape(b, hkv, group, n, c + t)
        cache_ok = live[:, :, None, :] & real_row[:, None, part, None]          # [B, Hkv, n, C]
        if window is not None:
            cache_ok = cache_ok & ((pos[:, None, part, None] - position[:, :, None, :]) < window)
        allowed = torch.cat([cache_ok, chunk_allowed[:, :, part].expand(b, hkv, n, t)], dim=-1)
        s = torch.cat([s[..., :c] + bias[:, :, None, None, :], s[..., c:]], dim=-1)
        yield part, s.masked_fill(~allowed[:, :, None], float("-inf"))


def chunk_attention_reference(q: Tensor, k: Tensor, v: Tensor, pad: Tensor, k_cache: Tensor, v_cache: Tensor,
                              log_weight: Tensor, position: Tensor, pos: Tensor, scale: float,
                              window: int | None = None, softcap: float | None = None) -> tuple[Tensor, Tensor]:
    b, hq, t, d = q.shape
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    values = torch.cat([v_cache.to(acc), v.to(acc)], dim=2)[:, :, None]        # [B, Hkv, 1, C + T, D]
    o = torch.empty_like(q)
    lse = torch.empty(b, hq, t, dtype=acc, device=q.device)
    for rows, s in chunk_logit_blocks(q, k, pad, k_cache, log_weight, position, pos, scale, window, softcap):
        n = rows.stop - rows.start
        o[:, :, rows] = torch.matmul(torch.softmax(s, dim=-1), values).reshape(b, hq, n, d).to(q.dtype)
        lse[:, :, rows] = torch.logsumexp(s, dim=-1).reshape(b, hq, n) * LOG2E
    pad_row = torch.arange(t, device=q.device)[None, :] < pad[:, None]
    return o, lse.masked_fill(pad_row[:, None, :], float("inf")).to(torch.float32)


# --------------------------------------------------------------------------------------- Triton
# The cache part alone. Program (row block, (b, g)): rows m of the group's G*T query rows (query head
# g*G + m // T, token m % T), every slot j of KV head g, base 2:
#     s2_mj = log2e (scale q_m . k_j + lw_j)       (lw = -inf: an empty slot, p = 0)
#     online softmax over the slots: o_m = sum_j 2^(s2_mj - lse2_m) v_j,  lse2_m = log2 sum_j 2^(s2_mj)
# A row without a live slot gets o = 0 and lse2 = -inf (it weighs nothing in the merge).
@triton.jit
def group_query_rows(Q, sqb, sqh, sqt, sqd, HKV, G, T, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_D: tl.constexpr):
    """This program's (block program_id(0) of the G*T query rows of (b, g) = program_id(1)): b, g (64-bit offsets:
    B*Hkv*C*D may pass 2^31), each row m's head g*G + m // T and token m % T, which rows are real, the head
    dimension's lanes and which are real, and the rows' queries [BLOCK_M, BLOCK_D] (0 where not real)."""
    pid_bg = tl.program_id(1)
    b = (pid_bg // HKV).to(tl.int64)
    g = (pid_bg % HKV).to(tl.int64)
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < G * T
    head = g * G + m // T
    tok = m % T
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(Q + b * sqb + head[:, None] * sqh + tok[:, None] * sqt + d[None, :] * sqd,
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    return b, g, head, tok, m_ok, d, d_ok, q


@triton.jit
def _cache_attention_kernel(Q, K, V, LW, OUT, LSE, sqb, sqh, sqt, sqd, skb, skh, skc, skd, svb, svh, svc, svd,
                            slb, slh, slc, sob, soh, sot, sod, HKV, G, T, C, scale,
                            HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_D: tl.constexpr, DOT: tl.constexpr):
    b, g, head, tok, m_ok, d, d_ok, q = group_query_rows(Q, sqb, sqh, sqt, sqd, HKV, G, T, HEAD_DIM, BLOCK_M, BLOCK_D)
    mx = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for j0 in range(0, C, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        j_ok = j < C
        kt = tl.load(K + b * skb + g * skh + j[:, None] * skc + d[None, :] * skd,
                     mask=j_ok[:, None] & d_ok[None, :], other=0.0)
        lw = tl.load(LW + b * slb + g * slh + j * slc, mask=j_ok, other=float("-inf"))
        s2 = (_dot(q, tl.trans(kt), DOT) * scale + lw[None, :]) * 1.4426950408889634
        new = tl.maximum(mx, tl.max(s2, axis=1))
        safe = tl.where(new == float("-inf"), 0.0, new)
        alpha = tl.exp2(mx - safe)
        p = tl.exp2(s2 - safe[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        vt = tl.load(V + b * svb + g * svh + j[:, None] * svc + d[None, :] * svd,
                     mask=j_ok[:, None] & d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(vt.dtype), vt, DOT)
        mx = new
    o = acc / tl.maximum(total, 1e-30)[:, None]
    tl.store(OUT + b * sob + head[:, None] * soh + tok[:, None] * sot + d[None, :] * sod, o.to(OUT.dtype.element_ty),
             mask=m_ok[:, None] & d_ok[None, :])
    lse = tl.where(total > 0, mx + tl.log2(tl.maximum(total, 1e-30)), float("-inf"))
    tl.store(LSE + (b * HKV * G + head) * T + tok, lse, mask=m_ok)


# (BLOCK_M, BLOCK_N, num_warps, num_stages) on CUDA; the interpreter's are small.
_CACHE_ATTENTION_CONFIG = (64, 64, 4, 2)


def cache_attention_triton(q: Tensor, k_cache: Tensor, v_cache: Tensor, log_weight: Tensor, scale: float, *,
                           block_m: int | None = None, block_n: int | None = None, num_warps: int | None = None,
                           num_stages: int | None = None) -> tuple[Tensor, Tensor]:
    """The cache part: (o [B, Hq, T, D], lse2 [B, Hq, T] fp32) of every query row over the live cache slots,
    with the log-weight bias and no mask (-inf and o = 0 for a row of a KV head without a live slot). The keywords
    override the launch (benchmarks/probes/chunk_kernels_sweep.py)."""
    require_triton()
    b, hq, t, d = q.shape
    hkv, c = k_cache.shape[1], k_cache.shape[2]
    if k_cache.shape != (b, hkv, c, d) or v_cache.shape != k_cache.shape or hq % hkv \
            or tuple(log_weight.shape) != (b, hkv, c):
        raise ValueError(f"q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)} and "
                         f"log_weight {tuple(log_weight.shape)} do not match ([B, Hq, T, D], [B, Hkv, C, D] twice, "
                         "[B, Hkv, C], Hkv | Hq)")
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("log_weight", log_weight)):
        check_device(name, x, q.device)
    cfg = launch_config(_CACHE_ATTENTION_CONFIG, q.device.type == "cuda", block_m, block_n, num_warps, num_stages)
    o = torch.empty_like(q)
    lse = torch.empty(b, hq, t, device=q.device, dtype=torch.float32)
    group = hq // hkv
    lw = log_weight.float()
    _cache_attention_kernel[(triton.cdiv(group * t, cfg["BLOCK_M"]), b * hkv)](
        q, k_cache, v_cache, lw, o, lse, *q.stride(), *k_cache.stride(), *v_cache.stride(), *lw.stride(),
        *o.stride(), hkv, group, t, c, float(scale),
        HEAD_DIM=d, BLOCK_D=max(16, next_pow2(d)), DOT=dot_mode(q), **cfg)
    return o, lse


def merge_by_lse(o_a: Tensor, lse_a: Tensor, o_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """The attention over the union of two disjoint key sets from each set's (o [B, H, T, D], lse2 [B, H, T]):
    o = (2^lse_a o_a + 2^lse_b o_b) / (2^lse_a + 2^lse_b), lse2 = log2(2^lse_a + 2^lse_b). Finite lse_a
    (every real row attends to itself); lse_b = -inf weighs nothing."""
    top = torch.maximum(lse_a, lse_b)
    wa, wb = torch.exp2(lse_a - top), torch.exp2(lse_b - top)
    total = wa + wb
    o = (o_a.float() * (wa / total)[..., None] + o_b.float() * (wb / total)[..., None]).to(o_a.dtype)
    return o, top + torch.log2(total)


def chunk_attention_cuda(q: Tensor, k: Tensor, v: Tensor, pad: Tensor, k_cache: Tensor, v_cache: Tensor,
                         log_weight: Tensor, position: Tensor, pos: Tensor, scale: float,
                         window: int | None = None, softcap: float | None = None) -> tuple[Tensor, Tensor]:
    """The chunk part by ``prefill_attention_lse`` and the cache part by ``cache_attention_triton``, merged by
    their log-sum-exps; pad rows keep the chunk part alone (+inf). With a window or softcap: the reference."""
    if window is not None or softcap is not None or k_cache.shape[2] == 0:
        return chunk_attention_reference(q, k, v, pad, k_cache, v_cache, log_weight, position, pos, scale, window,
                                         softcap)
    from kvpass.kernels.prefill_attention_lse import prefill_attention_lse_cuda

    o_chunk, lse_chunk = prefill_attention_lse_cuda(q, k, v, pad, scale)
    o_cache, lse_cache = cache_attention_triton(q, k_cache, v_cache, log_weight, scale)
    pad_row = (torch.arange(q.shape[2], device=q.device)[None, :] < pad[:, None])[:, None, :]   # [B, 1, T]
    lse_chunk = torch.where(pad_row, 0.0, lse_chunk)              # +inf on pad rows would poison the merge
    o, lse = merge_by_lse(o_chunk, lse_chunk, o_cache, lse_cache)
    o = torch.where(pad_row[..., None], o_chunk, o)
    return o, torch.where(pad_row, float("inf"), lse).contiguous()


@torch.library.custom_op("kvpass::chunk_attention", mutates_args=())
def chunk_attention(q: Tensor, k: Tensor, v: Tensor, pad: Tensor, k_cache: Tensor, v_cache: Tensor,
                    log_weight: Tensor, position: Tensor, pos: Tensor, scale: float, window: int | None = None,
                    softcap: float | None = None) -> tuple[Tensor, Tensor]:
    return chunk_attention_reference(q, k, v, pad, k_cache, v_cache, log_weight, position, pos, scale, window,
                                     softcap)


@chunk_attention.register_fake
def _(q, k, v, pad, k_cache, v_cache, log_weight, position, pos, scale, window=None, softcap=None):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


if HAS_TRITON:
    @chunk_attention.register_kernel("cuda")
    def _(q, k, v, pad, k_cache, v_cache, log_weight, position, pos, scale, window=None, softcap=None):
        return chunk_attention_cuda(q, k, v, pad, k_cache, v_cache, log_weight, position, pos, scale, window, softcap)
