"""Decode attention over a quantized cache (kvpass/quantization): ``decode_attention`` reading 8-bit entries and their
per-(token, head) scales directly.

With k_j = kq_j * ks_j and v_j = vq_j * vs_j (codes times scale, ``dequantize_entries``), exactly ``decode_attention``:

    s_j = scale * q . k_j = scale * (q . kq_j) * ks_j           (softcap c: c * tanh(s_j / c))
    p_j = softmax_j(s_j + log_weight_j);   o = sum_j p_j v_j = sum_j (p_j vs_j) vq_j

Shapes: q: [B, Hq, T, D] (the model's dtype); k, v: [B, Hkv, C, D] int8 or float8_e4m3fn codes; k_scale, v_scale:
[B, Hkv, C] (the model's dtype); log_weight: [B, Hkv, C] fp32. o: [B, Hq, T, D]; scores as ``decode_attention``'s.
Traffic: 2*B*Hkv*C*(D + 2) bytes a step in bf16, 0.51x of the bf16 cache's 4*B*Hkv*C*D at D = 128.

The reference decodes K and V exactly (fp32 products, fp64 for fp64 queries) and runs ``decode_attention_reference``'s
math. On CUDA the Triton kernel is ``decode_attention``'s split-K flash decoding with the tiles loaded as codes: each
K tile converted to q's dtype (exact: e4m3 and int8 values are bf16 and fp16 values), q . kq on tensor cores, each
logit column times its slot's scale; each probability column times the slot's V scale before p @ vq. The splits are
merged by ``decode_attention``'s merge launch (``_decode_attention_merge_kernel``), scores included.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvpass.kernels._triton import (
    HAS_TRITON,
    check_device,
    fit_pipeline,
    next_pow2,
    require_triton,
    shared_memory_limit,
    tl,
    triton,
    whole_tile_splits,
)
from kvpass.kernels.decode_attention import (
    MANY_ROWS,
    SCORE_BLOCK,
    WIDE_TILE_ROWS,
    _decode_attention_merge_kernel,
    _dot,
    _logits2,
    check_decode_inputs,
    decode_attention_reference,
    decode_splits,
    dot_mode,
)
from kvpass.quantization.formats import dequantize_entries, format_of


def decode_attention_quantized_reference(q: Tensor, k: Tensor, v: Tensor, k_scale: Tensor, v_scale: Tensor,
                                         log_weight: Tensor, scale: float, softcap: float | None = None,
                                         want_scores: bool = False) -> tuple[Tensor, Tensor]:
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    kd, vd = dequantize_entries(k, k_scale, acc), dequantize_entries(v, v_scale, acc)
    o, scores = decode_attention_reference(q.to(acc), kd, vd, log_weight, scale, softcap, want_scores)
    return o.to(q.dtype), scores


def check_decode_quantized_inputs(q: Tensor, k: Tensor, v: Tensor, k_scale: Tensor, v_scale: Tensor,
                                  log_weight: Tensor, scale: float, softcap: float | None) -> None:
    """ValueError naming the tensor, the expected and the actual shape or dtype: ``decode_attention``'s checks with K, V
    one 8-bit format and the scales [B, Hkv, C] floats."""
    format_of(k)
    if v.dtype != k.dtype:
        raise ValueError(f"k and v must hold one format, got {k.dtype}, {v.dtype}")
    stand_in = q.new_empty(1).expand(k.shape)                   # codes checked above: the shapes here
    check_decode_inputs(q, stand_in, stand_in,
                        log_weight, scale, softcap)
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if tuple(t.shape) != tuple(log_weight.shape) or not t.is_floating_point():
            raise ValueError(f"{name} must be a float [B, Hkv, C] = {tuple(log_weight.shape)}, got "
                             f"{tuple(t.shape)} {t.dtype}")
        check_device(name, t, q.device)
    check_device("k", k, q.device)
    check_device("v", v, q.device)


# Math of one program (b, g, split s) as ``_decode_attention_split_kernel``'s (kvpass/kernels/decode_attention.py),
# with raw_mj = (q_m . kq_j) ks_j and acc_m += sum_j (p_mj vs_j) vq_j.
@triton.jit
def _decode_attention_quantized_split_kernel(
    Q, K, V, KS, VS, LW, OUT, OPART, LSE, LOGITS,
    sqb, sqh, sqt, sqd, skb, skh, skc, skd, svb, svh, svc, svd, sksb, sksh, sksc, svsb, svsh, svsc,
    slb, slh, slc, sob, soh, sot, sod,
    HKV, C, T, G, SPLIT_LEN, NUM_SPLITS, scale, softcap,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, DOT: tl.constexpr, DIRECT: tl.constexpr, WANT_SCORES: tl.constexpr,
    CODE_TY: tl.constexpr,
):
    pid_bg = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = (pid_bg // HKV).to(tl.int64)                  # 64-bit offsets: B*Hkv*C*D may pass 2^31
    g = pid_bg % HKV
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < G * T
    d_mask = offs_d < HEAD_DIM
    head = g * G + offs_m // T
    tok = offs_m % T
    q_ptrs = Q + b * sqb + head[:, None] * sqh + tok[:, None] * sqt + offs_d[None, :] * sqd
    q = tl.load(q_ptrs, mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    k_base = K + b * skb + g * skh
    v_base = V + b * svb + g * svh
    ks_base = KS + b * sksb + g * sksh
    vs_base = VS + b * svsb + g * svsh
    lw_base = LW + b * slb + g * slh

    start = pid_s * SPLIT_LEN
    end = tl.minimum(start + SPLIT_LEN, C)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        kv_mask = n_mask[:, None] & d_mask[None, :]
        kq = tl.load(k_base + offs_n[:, None] * skc + offs_d[None, :] * skd, mask=kv_mask, other=0.0)
        ks = tl.load(ks_base + offs_n * sksc, mask=n_mask, other=0.0).to(tl.float32)
        lw = tl.load(lw_base + offs_n * slc, mask=n_mask, other=float("-inf"))
        raw = _dot(q, tl.trans(kq.to(CODE_TY)), DOT) * ks[None, :]
        s = _logits2(raw, lw, scale, softcap, HAS_SOFTCAP)
        if WANT_SCORES:
            l_ptrs = LOGITS + (pid_bg.to(tl.int64) * G * T + offs_m[:, None]) * C + offs_n[None, :]
            tl.store(l_ptrs, s, mask=m_mask[:, None] & n_mask[None, :])
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        vq = tl.load(v_base + offs_n[:, None] * svc + offs_d[None, :] * svd, mask=kv_mask, other=0.0)
        vs = tl.load(vs_base + offs_n * svsc, mask=n_mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + _dot((p * vs[None, :]).to(q.dtype), vq.to(CODE_TY), DOT)
        m_i = m_new

    lse = tl.where(l_i > 0.0, m_i + tl.log2(l_i), float("-inf"))
    tl.store(LSE + (pid_bg * NUM_SPLITS + pid_s) * BLOCK_M + offs_m, lse, mask=m_mask)
    if DIRECT:
        o = acc / l_i[:, None]
        o_ptrs = OUT + b * sob + head[:, None] * soh + tok[:, None] * sot + offs_d[None, :] * sod
        tl.store(o_ptrs, o.to(OUT.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])
    else:
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        part = OPART + ((pid_bg * NUM_SPLITS + pid_s) * BLOCK_M + offs_m[:, None]) * BLOCK_D + offs_d[None, :]
        tl.store(part, o, mask=m_mask[:, None])


def decode_attention_quantized_triton(q: Tensor, k: Tensor, v: Tensor, k_scale: Tensor, v_scale: Tensor,
                                      log_weight: Tensor, scale: float, softcap: float | None = None,
                                      want_scores: bool = False, *, num_splits: int | None = None,
                                      block_n: int | None = None, num_warps: int | None = None,
                                      num_stages: int | None = None) -> tuple[Tensor, Tensor]:
    """The Triton decode attention over codes (same contract as the reference); the keyword arguments override the
    launch heuristics, which are ``decode_attention_triton``'s with 1-byte K, V tiles."""
    require_triton()
    check_decode_quantized_inputs(q, k, v, k_scale, v_scale, log_weight, scale, softcap)
    b, hq, t, d = q.shape
    hkv, c = k.shape[1], k.shape[2]
    group = hq // hkv
    rows = group * t
    block_m = max(16, next_pow2(rows))
    block_d = max(16, next_pow2(d))
    wide = block_m <= WIDE_TILE_ROWS and block_d <= 128
    if block_n is None:
        block_n = 128 if wide else (64 if block_d <= 128 else 32)
    on_gpu = q.device.type == "cuda"
    if num_warps is None:
        num_warps = 4
    if num_stages is None:
        num_stages = (2 if b * hkv >= MANY_ROWS and not wide else 3) if on_gpu else 1
    if on_gpu:
        block_n, num_stages = fit_pipeline(block_n, num_stages, 2 * block_d * k.element_size(),
                                           block_m * block_d * q.element_size(), shared_memory_limit(q.device))
    splits = num_splits if num_splits is not None else decode_splits(b, hkv, c, block_n, q.device)
    split_len, splits = whole_tile_splits(c, splits, block_n)
    direct = splits == 1
    o = torch.empty_like(q)
    lse = torch.empty(b * hkv * splits * block_m, device=q.device, dtype=torch.float32)
    part = o if direct else torch.empty(b * hkv * splits * block_m * block_d, device=q.device, dtype=torch.float32)
    logits = torch.empty(b * hkv * rows * c if want_scores else 1, device=q.device, dtype=torch.float32)
    dot = dot_mode(q)
    # the codes as tensor-core operands in q's dtype (exact), or fp32 where the dot is fp32 (fp32 q, the interpreter)
    code_ty = tl.float32 if dot else {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[q.dtype]
    _decode_attention_quantized_split_kernel[(b * hkv, splits)](
        q, k, v, k_scale, v_scale, log_weight, o, part, lse, logits,
        *q.stride(), *k.stride(), *v.stride(), *k_scale.stride(), *v_scale.stride(), *log_weight.stride(),
        *o.stride(), hkv, c, t, group, split_len, splits, float(scale),
        float(softcap) if softcap is not None else 1.0,
        HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, HAS_SOFTCAP=softcap is not None,
        DOT=dot, DIRECT=direct, WANT_SCORES=want_scores, CODE_TY=code_ty, num_warps=num_warps, num_stages=num_stages)
    scores = torch.empty((b, hkv, c) if want_scores else (0,), device=q.device, dtype=torch.float32)
    combine_rows = 0 if direct else rows
    score_blocks = triton.cdiv(c, SCORE_BLOCK) if want_scores else 0
    if combine_rows + score_blocks:
        unread = lse                                   # the nearest-key search's tensors: NCAND = 0
        _decode_attention_merge_kernel[(b * hkv, combine_rows + score_blocks)](
            o, part, lse, logits, scores, unread, unread, unread, unread, unread, unread,
            *o.stride(), hkv, c, t, group, splits, combine_rows,
            HEAD_DIM=d, BLOCK_M=block_m, BLOCK_D=block_d, BLOCK_S=min(32, next_pow2(splits)), BLOCK_N=SCORE_BLOCK,
            NCAND=0, BLOCK_SC=next_pow2(splits), num_warps=4)
    return o, scores


@torch.library.custom_op("kvpass::decode_attention_quantized", mutates_args=())
def decode_attention_quantized(q: Tensor, k: Tensor, v: Tensor, k_scale: Tensor, v_scale: Tensor, log_weight: Tensor,
                               scale: float, softcap: float | None = None,
                               want_scores: bool = False) -> tuple[Tensor, Tensor]:
    return decode_attention_quantized_reference(q, k, v, k_scale, v_scale, log_weight, scale, softcap, want_scores)


@decode_attention_quantized.register_fake
def _(q, k, v, k_scale, v_scale, log_weight, scale, softcap=None, want_scores=False):
    scores = log_weight.new_empty(log_weight.shape if want_scores else (0,), dtype=torch.float32)
    return torch.empty_like(q), scores


if HAS_TRITON:
    @decode_attention_quantized.register_kernel("cuda")
    def _(q, k, v, k_scale, v_scale, log_weight, scale, softcap=None, want_scores=False):
        return decode_attention_quantized_triton(q, k, v, k_scale, v_scale, log_weight, scale, softcap, want_scores)
