"""Decode attention over the compressed cache, with the per-entry additive log-weight.

For batch b, query head h (KV head g = h // G), new query token t and cache slot j < C:

    s_j = scale * q_{b,h,t} . k_{b,g,j}           (softcap c: s_j = c * tanh(s_j / c))
    p_j = softmax_j(s_j + log_weight_{b,g,j})      (log_weight: 0 for a plain entry, log N for a
                                                    merged one of N tokens, -inf for an empty slot)
    o_{b,h,t} = sum_j p_j v_{b,g,j}

Every live slot is in the past of the new tokens, so there is no causal mask. With
``want_scores`` the op also returns the step's attention row per KV head, averaged over the G
query heads of the group and summed over the T new tokens (docs/policies.md §0.5): [B, Hkv, C] fp32,
which eviction policies accumulate. Otherwise ``scores`` is an empty tensor.

Shapes: q: [B, Hq, T, D]; k, v: [B, Hkv, C, D]; log_weight: [B, Hkv, C] fp32. o: [B, Hq, T, D].
Traffic: reads 2*B*Hkv*C*D cache elements once per step; this is what bounds decode speed.

On CUDA the op runs ``decode_attention_triton``: split-K flash decoding. Each program owns one
(batch row b, KV head g, split of the cache) and all G*T query rows of that KV head, so each K/V
tile is read from memory once for the whole group. One more launch finishes the step: programs that
merge the splits by their log-sum-exp (one per query row) and, with ``want_scores``, programs that turn
the logits the split kernel stored (G*T fp32 per slot, a few % of the K/V bytes) into probabilities, a
block of slots each, with the final log-sum-exp they rebuild from the splits' (a few floats), so the
cache is still read once and the scores do not wait for the merge.
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
from kvpass.kernels.nearest_in_tile import _candidate_rows, _combine_nearest, _nearest_in_tile, _store_nearest


def decode_attention_reference(q: Tensor, k: Tensor, v: Tensor, log_weight: Tensor, scale: float,
                               softcap: float | None = None, want_scores: bool = False) -> tuple[Tensor, Tensor]:
    b, hq, t, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32   # float64 inputs: a float64 reference
    qg = q.reshape(b, hkv, group * t, d).to(acc)                     # heads g*G..g*G+G-1 share KV head g
    s = torch.matmul(qg, k.to(acc).transpose(-1, -2)) * scale         # [B, Hkv, G*T, C]
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    p = torch.softmax(s + log_weight[:, :, None, :].to(acc), dim=-1)
    o = torch.matmul(p, v.to(acc)).reshape(b, hq, t, d).to(q.dtype)
    if want_scores:
        scores = p.reshape(b, hkv, group, t, -1).sum(dim=3).mean(dim=2)
        scores = scores if acc == torch.float64 else scores.float()
    else:
        scores = q.new_empty(0, dtype=torch.float32)
    return o, scores


# --------------------------------------------------------------------------------------- Triton
# Math of one program (b, g, split s), rows m = gi*T + t (query head g*G + gi, token t), slots
# j in [s*L, min((s+1)*L, C)), all in base 2 (x2 = x * log2 e):
#     s2_mj = scale2 * q_m . k_j  (softcap c: log2e * c * tanh(scale * q_m . k_j / c))  + log2e * lw_j
#     online softmax: m_m = max_j s2_mj, l_m = sum_j 2^(s2_mj - m_m), acc_m = sum_j 2^(s2_mj - m_m) v_j
#     split output o_m = acc_m / l_m, split log-sum-exp lse_m = m_m + log2 l_m  (-inf: no live slot)
# Combine: lse = log2 sum_s 2^lse_s; o = sum_s 2^(lse_s - lse) o_s.  Scores: the split kernel stores
# s2_mj; p_mj = 2^(s2_mj - lse_m), score_j = (1/G) sum_m p_mj. Empty slots (lw = -inf) get p = 0.

LOG2E = 1.4426950408889634


@triton.jit
def _tanh(x):
    # tanh through the sigmoid (tl has no tanh on every backend): tanh x = 2 sigmoid(2x) - 1
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


def dot_mode(x: Tensor) -> int:
    """The ``DOT`` of ``_dot`` for operands like ``x``: 1 for fp32, else 0 on CUDA (tensor cores) and 2
    elsewhere (the interpreter)."""
    return 1 if x.dtype == torch.float32 else (2 if x.device.type != "cuda" else 0)


@triton.jit
def _dot(a, b, DOT: tl.constexpr):
    """a @ b with fp32 accumulation. DOT 0: native (tensor cores for 16-bit inputs); 1: exact fp32
    (fp32 inputs; no tf32); 2: operands upcast to fp32 first (the CPU interpreter, whose bf16 dot is
    wrong in triton 3.9; the operands are already rounded to their dtype, so the math is the same)."""
    if DOT == 1:
        return tl.dot(a, b, input_precision="ieee")
    elif DOT == 2:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _logits2(raw, lw, scale, softcap, HAS_SOFTCAP: tl.constexpr):
    """raw = q . k [BM, BN] fp32, lw [BN] fp32 -> base-2 logits [BM, BN] fp32 (with the bias)."""
    s = raw * scale
    if HAS_SOFTCAP:
        s = softcap * _tanh(s / softcap)
    return (s + lw[None, :]) * 1.4426950408889634


@triton.jit
def _decode_attention_split_kernel(
    Q, K, V, LW, OUT, OPART, LSE, LOGITS, CAND, FROM, PBEST, PARG, NEAR_CAND, NEAR_BEST, NEAR_SLOT, INV_NORM,
    sqb, sqh, sqt, sqd, skb, skh, skc, skd, svb, svh, svc, svd, slb, slh, slc, sob, soh, sot, sod,
    HKV, C, T, G, SPLIT_LEN, NUM_SPLITS, scale, softcap,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, DOT: tl.constexpr, DIRECT: tl.constexpr, WANT_SCORES: tl.constexpr,
    NCAND: tl.constexpr,
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
    if NCAND > 0:             # the candidates' keys ride in the query tile's spare rows (decode_attention_nearest)
        cand, kc, c_norm, c_from = _candidate_rows(CAND, FROM, k_base, pid_bg, offs_m, offs_d, d_mask, skc, skd,
                                                   G * T, NCAND)
        q = tl.where((cand >= 0)[:, None], kc.to(q.dtype), q)
        lane_best = tl.full([BLOCK_M, BLOCK_N], float("-inf"), tl.float32)
        lane_slot = tl.zeros([BLOCK_M, BLOCK_N], tl.int32)
        inv_base = INV_NORM + pid_bg.to(tl.int64) * C

    start = pid_s * SPLIT_LEN
    end = tl.minimum(start + SPLIT_LEN, C)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    v_base = V + b * svb + g * svh
    lw_base = LW + b * slb + g * slh
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_base + offs_n[:, None] * skc + offs_d[None, :] * skd, mask=kv_mask, other=0.0)
        lw = tl.load(lw_base + offs_n * slc, mask=n_mask, other=float("-inf"))
        raw = _dot(q, tl.trans(k), DOT)
        s = _logits2(raw, lw, scale, softcap, HAS_SOFTCAP)
        if NCAND > 0:
            inv_k = tl.load(inv_base + offs_n, mask=n_mask, other=0.0)
            lane_best, lane_slot = _nearest_in_tile(raw, inv_k, lw, offs_n, cand, c_from, lane_best, lane_slot)
        if WANT_SCORES:       # keep the logits (G*T x 4 bytes a slot, vs 4*D bytes of K and V) for the scores pass
            l_ptrs = LOGITS + (pid_bg.to(tl.int64) * G * T + offs_m[:, None]) * C + offs_n[None, :]
            tl.store(l_ptrs, s, mask=m_mask[:, None] & n_mask[None, :])
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + offs_n[:, None] * svc + offs_d[None, :] * svd, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT)
        m_i = m_new

    lse = tl.where(l_i > 0.0, m_i + tl.log2(l_i), float("-inf"))
    lse_ptrs = LSE + (pid_bg * NUM_SPLITS + pid_s) * BLOCK_M + offs_m
    tl.store(lse_ptrs, lse, mask=m_mask)
    if DIRECT:
        o = acc / l_i[:, None]
        o_ptrs = OUT + b * sob + head[:, None] * soh + tok[:, None] * sot + offs_d[None, :] * sod
        tl.store(o_ptrs, o.to(OUT.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])
    else:
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        part = OPART + ((pid_bg * NUM_SPLITS + pid_s) * BLOCK_M + offs_m[:, None]) * BLOCK_D + offs_d[None, :]
        tl.store(part, o, mask=m_mask[:, None])
    if NCAND > 0:
        _store_nearest(PBEST, PARG, NEAR_CAND, NEAR_BEST, NEAR_SLOT, lane_best, lane_slot, cand, c_norm, offs_m,
                       pid_bg, pid_s, NUM_SPLITS, G * T, NCAND, DIRECT)


@triton.jit
def _combine_row(OUT, OPART, LSE, pid_bg, m, b, g, sob, soh, sot, sod, T, G, NUM_SPLITS,
                 HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    """Row m of (b, g): o = sum_s 2^(lse_s - lse) o_s, the splits read BLOCK_S at a time (independent loads,
    not a chain of NUM_SPLITS dependent steps), first for their max, then summed."""
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mx = tl.max(tl.full([BLOCK_S], float("-inf"), tl.float32), 0)
    for s0 in range(0, NUM_SPLITS, BLOCK_S):
        s = s0 + offs_s
        lse_s = tl.load(LSE + (pid_bg * NUM_SPLITS + s) * BLOCK_M + m, mask=s < NUM_SPLITS, other=float("-inf"))
        mx = tl.maximum(mx, tl.max(lse_s, 0))
    mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
    l_i = tl.sum(tl.zeros([BLOCK_S], tl.float32), 0)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, NUM_SPLITS, BLOCK_S):
        s = s0 + offs_s
        row = (pid_bg * NUM_SPLITS + s) * BLOCK_M + m
        lse_s = tl.load(LSE + row, mask=s < NUM_SPLITS, other=float("-inf"))
        w = tl.exp2(lse_s - mx_safe)                                     # 0 for missing / empty splits
        o_s = tl.load(OPART + row[:, None] * BLOCK_D + offs_d[None, :], mask=(s < NUM_SPLITS)[:, None], other=0.0)
        l_i += tl.sum(w, 0)
        acc += tl.sum(w[:, None] * o_s, 0)
    o = acc / l_i
    tl.store(OUT + b * sob + (g * G + m // T) * soh + (m % T) * sot + offs_d * sod, o.to(OUT.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


@triton.jit
def _scores_block(LOGITS, LSE, S, pid_bg, n0, C, T, G, NUM_SPLITS,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr):
    """score_j = (1/G) sum_m 2^(s2_mj - lse_m) for slots [n0, n0 + BLOCK_N), from the stored logits; the
    rows' final lse_m from the splits' (G*T x splits floats: cheaper than waiting for the combine)."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_s = tl.arange(0, BLOCK_S)
    m_mask = offs_m < G * T
    mx = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for s0 in range(0, NUM_SPLITS, BLOCK_S):
        s = s0 + offs_s
        lse_s = tl.load(LSE + (pid_bg * NUM_SPLITS + s)[:, None] * BLOCK_M + offs_m[None, :],
                        mask=(s < NUM_SPLITS)[:, None] & m_mask[None, :], other=float("-inf"))
        mx = tl.maximum(mx, tl.max(lse_s, 0))
    mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    for s0 in range(0, NUM_SPLITS, BLOCK_S):
        s = s0 + offs_s
        lse_s = tl.load(LSE + (pid_bg * NUM_SPLITS + s)[:, None] * BLOCK_M + offs_m[None, :],
                        mask=(s < NUM_SPLITS)[:, None] & m_mask[None, :], other=float("-inf"))
        l_i += tl.sum(tl.exp2(lse_s - mx_safe[None, :]), 0)
    lse = mx + tl.log2(l_i)                                              # as the combine's (-inf: no live slot)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < C
    s2 = tl.load(LOGITS + (pid_bg.to(tl.int64) * G * T + offs_m[:, None]) * C + offs_n[None, :],
                 mask=m_mask[:, None] & n_mask[None, :], other=float("-inf"))
    p = tl.where(m_mask[:, None], tl.exp2(s2 - lse[:, None]), 0.0)
    tl.store(S + pid_bg.to(tl.int64) * C + offs_n, tl.sum(p, 0) / G, mask=n_mask)


@triton.jit
def _decode_attention_merge_kernel(
    OUT, OPART, LSE, LOGITS, S, CAND, PBEST, PARG, NEAR_CAND, NEAR_BEST, NEAR_SLOT,
    sob, soh, sot, sod, HKV, C, T, G, NUM_SPLITS, COMBINE_ROWS,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr, NCAND: tl.constexpr, BLOCK_SC: tl.constexpr,
):
    # Program (b, g, i): i < COMBINE_ROWS merges the splits of row m = i (COMBINE_ROWS = G*T, 0 when the split
    # kernel wrote o itself); a later i computes the scores of slot block i - COMBINE_ROWS. One launch for both:
    # at batch 1 the step is launch-bound, and the scores need only the splits' lse's, not the combine.
    pid_bg = tl.program_id(0)
    i = tl.program_id(1)
    b = (pid_bg // HKV).to(tl.int64)                  # 64-bit offsets: B*Hkv*C*D may pass 2^31
    g = pid_bg % HKV
    if i < COMBINE_ROWS:
        _combine_row(OUT, OPART, LSE, pid_bg, i, b, g, sob, soh, sot, sod, T, G, NUM_SPLITS, HEAD_DIM, BLOCK_M,
                     BLOCK_D, BLOCK_S)
        if NCAND > 0:
            if i == 0:
                _combine_nearest(CAND, PBEST, PARG, NEAR_CAND, NEAR_BEST, NEAR_SLOT, pid_bg, NUM_SPLITS, NCAND,
                                 BLOCK_SC)
    else:
        _scores_block(LOGITS, LSE, S, pid_bg, (i - COMBINE_ROWS) * BLOCK_N, C, T, G, NUM_SPLITS, BLOCK_M, BLOCK_N,
                      BLOCK_S)


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


# The launch for one 16-row query tile (G*T <= 16) and D <= 128: 128-slot tiles, 4 warps, 3 stages. An H200
# sweep with and without the scores (benchmarks/probes/decode_scores_sweep.py, B 1-64, C 6.5k and 26k, Hq 32,
# Hkv 8, bf16: decode-scores-sweep-nvidia-h200.json) put it within 1.7% of the best of 18 launches at every
# point; the launch before it (64-slot tiles, 2 stages from 128 rows b * Hkv) was up to 14% slower without the
# scores (B 16) and 27% slower with them (B 32: 315 against 259 us at C 6.5k). Wider query tiles and D > 128 keep
# that launch (not swept).
WIDE_TILE_ROWS = 16
MANY_ROWS = 128
# Fewest slots per split (rounded to BLOCK_N); 128-slot splits were 8-10% slower on an H100 at B = 1 (C = 6.5k,
# 13k) and at 1k x 8 (decode-attention-batch-sweep-nvidia-h100-80gb-hbm3.json).
MIN_SPLIT = 256
# Slots per scores program of the merge launch. 512 against 128 (H200, C 6555, the 8B shape:
# benchmarks/probes/decode_scores_cost.py, decode-scores-cost-nvidia-h200.json): the merge launch with the
# scores 26.8 -> 16.3 us at batch 32 (the whole op 258.4 -> 248.1), 14.8 -> 9.2 at batch 16, 3.7 -> 2.6 at batch 1;
# a quarter of the programs, each rebuilding its rows' log-sum-exp once for 4x the slots. 1024 was slower at
# every batch (19.8 us at batch 32).
SCORE_BLOCK = 512


def decode_splits(b: int, hkv: int, c: int, block_n: int, device: torch.device, min_split: int = MIN_SPLIT) -> int:
    """How many splits of the cache: about one program per multiprocessor (at least 2 splits), each of at
    least ``min_split`` slots. From an H100 sweep of the split count alone
    (decode-attention-split-sweep-nvidia-h100-80gb-hbm3.json, C 1k-64k, B 1-16, old launch = 8 programs an SM):
    this choice was the fastest measured, or between two measured counts, at every point but 1k x 1 (where
    128-slot splits, ruled out by ``min_split``, were 7% faster); the old launch was 8-11% slower at B = 1
    from 16k slots and 5-7% slower at B = 8 (0.90x of SDPA at 1k x 8 and 2k x 8; 0.94x and 0.96x now).
    The combine step reads splits x G x D fp32 per (b, g), small next to the C x D cache. The benchmark
    sweeps 0.5x and 2x of this choice."""
    want = max(2, _sm_count(device) // (b * hkv))
    return max(1, min(want, -(-c // max(min_split, block_n))))


def check_decode_inputs(q: Tensor, k: Tensor, v: Tensor, log_weight: Tensor, scale: float,
                        softcap: float | None) -> None:
    """ValueError naming the tensor, the expected and the actual shape/dtype."""
    if q.dim() != 4:
        raise ValueError(f"q must be [B, Hq, T, D], got shape {tuple(q.shape)}")
    b, hq, t, d = q.shape
    if k.dim() != 4 or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k must be [B={b}, Hkv, C, D={d}], got shape {tuple(k.shape)}")
    hkv, c = k.shape[1], k.shape[2]
    if v.shape != k.shape:
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"Hq={hq} must be a multiple of Hkv={hkv}")
    if tuple(log_weight.shape) != (b, hkv, c):
        raise ValueError(f"log_weight must be [B, Hkv, C] = {(b, hkv, c)}, got {tuple(log_weight.shape)}")
    if log_weight.dtype != torch.float32:
        raise ValueError(f"log_weight must be float32, got {log_weight.dtype}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q must be float16, bfloat16 or float32, got {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if t < 1 or c < 1 or d < 1:
        raise ValueError(f"T, C and D must be >= 1, got T={t}, C={c}, D={d}")
    if not (scale > 0 and scale < float("inf")):
        raise ValueError(f"scale must be a positive finite float, got {scale}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0 or None, got {softcap}")
    for name, x in (("q", q), ("k", k), ("v", v), ("log_weight", log_weight)):
        check_device(name, x, q.device)


def decode_attention_triton(q: Tensor, k: Tensor, v: Tensor, log_weight: Tensor, scale: float,
                            softcap: float | None = None, want_scores: bool = False, *,
                            nearest: tuple[Tensor, ...] | None = None,
                            num_splits: int | None = None, block_n: int | None = None,
                            num_warps: int | None = None, num_stages: int | None = None) -> tuple[Tensor, Tensor]:
    """The Triton decode attention (same contract as ``decode_attention_reference``). ``nearest``: (candidates
    [B, Hkv, M] int64, target_from [B, Hkv] int64, inv_norm [B, Hkv, C] fp32, near_cand, near_best, near_slot
    [B, Hkv, M]), the inputs and outputs of ``decode_attention_nearest`` (checked there). The keyword arguments
    override the launch heuristics (tests and the benchmark sweep use them); on CUDA, a tile and stage count that
    would not fit the device's shared memory (fp32, a small GPU) is narrowed (``fit_pipeline``)."""
    require_triton()
    check_decode_inputs(q, k, v, log_weight, scale, softcap)
    b, hq, t, d = q.shape
    hkv, c = k.shape[1], k.shape[2]
    group = hq // hkv
    rows = group * t
    n_cand = 0 if nearest is None else nearest[0].shape[-1]
    block_m = max(16, next_pow2(rows + n_cand))
    block_d = max(16, next_pow2(d))
    wide = block_m <= WIDE_TILE_ROWS and block_d <= 128
    if block_n is None:
        block_n = 128 if wide else (64 if block_d <= 128 else 32)
    on_gpu = q.device.type == "cuda"
    if num_warps is None:
        num_warps = 4
    if num_stages is None:
        # with the candidates' running maxima in registers, 2 stages beat 3 from 128 rows (H200)
        many = b * hkv >= MANY_ROWS
        num_stages = (2 if many and (n_cand or not wide) else 3) if on_gpu else 1
    if on_gpu:        # fp32 (or a small GPU): fewer stages or narrower tiles where the tiles would not fit
        size = q.element_size()
        block_n, num_stages = fit_pipeline(block_n, num_stages, 2 * block_d * size, block_m * block_d * size,
                                           shared_memory_limit(q.device))
    splits = num_splits if num_splits is not None else decode_splits(b, hkv, c, block_n, q.device)
    split_len, splits = whole_tile_splits(c, splits, block_n)
    direct = splits == 1
    o = torch.empty_like(q)
    lse = torch.empty(b * hkv * splits * block_m, device=q.device, dtype=torch.float32)
    part = o if direct else torch.empty(b * hkv * splits * block_m * block_d, device=q.device, dtype=torch.float32)
    dot = dot_mode(q)
    cap = float(softcap) if softcap is not None else 1.0
    logits = torch.empty(b * hkv * rows * c if want_scores else 1, device=q.device, dtype=torch.float32)
    cand, c_from, inv_norm, near_cand, near_best, near_slot = nearest if nearest is not None else (lse,) * 6  # unread
    p_best = torch.empty(b * hkv * splits * n_cand if n_cand and not direct else 1, device=q.device,
                         dtype=torch.float32)
    p_arg = torch.empty(p_best.numel(), device=q.device, dtype=torch.int64)
    _decode_attention_split_kernel[(b * hkv, splits)](
        q, k, v, log_weight, o, part, lse, logits, cand, c_from, p_best, p_arg, near_cand, near_best, near_slot,
        inv_norm,
        *q.stride(), *k.stride(), *v.stride(), *log_weight.stride(), *o.stride(),
        hkv, c, t, group, split_len, splits, float(scale), cap,
        HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        HAS_SOFTCAP=softcap is not None, DOT=dot, DIRECT=direct, WANT_SCORES=want_scores, NCAND=n_cand,
        num_warps=num_warps, num_stages=num_stages)
    scores = torch.empty((b, hkv, c) if want_scores else (0,), device=q.device, dtype=torch.float32)
    combine_rows = 0 if direct else rows
    score_blocks = triton.cdiv(c, SCORE_BLOCK) if want_scores else 0
    if combine_rows + score_blocks:
        _decode_attention_merge_kernel[(b * hkv, combine_rows + score_blocks)](
            o, part, lse, logits, scores, cand, p_best, p_arg, near_cand, near_best, near_slot,
            *o.stride(), hkv, c, t, group, splits, combine_rows,
            HEAD_DIM=d, BLOCK_M=block_m, BLOCK_D=block_d, BLOCK_S=min(32, next_pow2(splits)), BLOCK_N=SCORE_BLOCK,
            NCAND=0 if direct else n_cand, BLOCK_SC=next_pow2(splits), num_warps=4)
    return o, scores


@torch.library.custom_op("kvpass::decode_attention", mutates_args=())
def decode_attention(q: Tensor, k: Tensor, v: Tensor, log_weight: Tensor, scale: float,
                     softcap: float | None = None, want_scores: bool = False) -> tuple[Tensor, Tensor]:
    return decode_attention_reference(q, k, v, log_weight, scale, softcap, want_scores)


@decode_attention.register_fake
def _(q, k, v, log_weight, scale, softcap=None, want_scores=False):
    scores = log_weight.new_empty(log_weight.shape if want_scores else (0,), dtype=torch.float32)
    return torch.empty_like(q), scores


if HAS_TRITON:
    @decode_attention.register_kernel("cuda")
    def _(q, k, v, log_weight, scale, softcap=None, want_scores=False):
        return decode_attention_triton(q, k, v, log_weight, scale, softcap, want_scores)
