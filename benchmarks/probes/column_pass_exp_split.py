"""Where the prefill column pass's time goes, and two ways to take exponentials off the MUFU units.

The column pass (``head_column_sums_triton`` given the rows' lse) does, per (row, key) pair of the
causal band, one bf16 q . k product on the tensor cores and one 2^x on the special-function units
(MUFU, 16 per clock per SM on Hopper: about 4.1 ms a layer at 32k for Llama-3.1-8B's 32 heads; the
products are about 4.4 ms at the dense bf16 peak). Variants, each a band-only kernel (causal, no
pads, window or softcap: the benchmark's case; the diagonal tiles masked):

- ``split_{A}_{P}_e{EA}{EP}``: each program owns A + P keys; the A keys' exponentials use EA and the
  P keys' EP, where 0 = MUFU (tl.exp2), 3 = none (the logit itself: the bound without exponentials),
  4 = 2^x by a degree-5 polynomial on the FMA units (rel. err 7.5e-8), 5 = degree 3 (7.5e-5).
  FlashAttention-4 splits its exponentials between the two units the same way.
- ``ws_bm{M}``: the plain loop with TMA loads of q and ``tl.range(warp_specialize=True)``, Triton's
  automatic warp specialisation (a producer warp for the loads, consumers for the math); experimental
  on Hopper, so it may not compile.

    PYTHONUNBUFFERED=1 python3 benchmarks/probes/column_pass_exp_split.py --out $OUT [--prompt 32768]

Timing and accuracy as in column_pass_sweep.py (its inputs, reference and accuracy). Writes
column-pass-exp-split.json under --out.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import torch
from column_pass_sweep import inputs, measure

from kvpass.kernels._triton import tl, triton
from kvpass.kernels.attention_column_sums import _column_tile, head_column_sums_rows, head_column_sums_triton
from kvpass.kernels.decode_attention import _dot, dot_mode


@triton.jit
def exp2_poly(x, DEG: tl.constexpr):
    """2^x on the FMA units: 2^n * 2^f with n = round(x) (the 1.5 * 2^23 trick puts n in the low bits of t),
    f = x - n in [-1/2, 1/2], 2^f by a near-minimax polynomial, n added to the exponent bits."""
    x = tl.maximum(x, -126.0)
    t = x + 12582912.0
    f = x - (t - 12582912.0)
    if DEG == 5:
        p = 0.00132764715 * f + 0.00967554133
        p = p * f + 0.0555071327
        p = p * f + 0.240221197
        p = p * f + 0.693146967
        p = p * f + 1.00000007
    else:
        p = 0.0551716649 * f + 0.242611122
        p = p * f + 0.693260986
        p = p * f + 0.999928074
    bits = p.to(tl.int32, bitcast=True) + (t.to(tl.int32, bitcast=True) << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def exp2_by(x, EXP: tl.constexpr):
    if EXP == 0:
        return tl.exp2(x)
    elif EXP == 3:
        return x
    elif EXP == 4:
        return exp2_poly(x, 5)
    else:
        return exp2_poly(x, 3)


@triton.jit
def _load(X, r0, T, st, N: tl.constexpr, D: tl.constexpr):
    r = r0 + tl.arange(0, N)
    return tl.load(X + r[:, None] * st + tl.arange(0, D)[None, :], mask=r[:, None] < T, other=0.0)


@triton.jit
def _key_program(Q, K, LSE, sqb, sqh, skb, skh, skt, HQ, G, T, D: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's query head bh = b * HQ + h and key block [j0, j0 + BLOCK_N): (bh, j0, the keys
    [BLOCK_N, D], the base of head h's q rows, the base of its lse)."""
    bh = tl.program_id(1)
    b, h = bh // HQ, bh % HQ
    j0 = tl.program_id(0) * BLOCK_N
    k = _load(K + b * skb + (h // G) * skh, j0, T, skt, BLOCK_N, D)
    return bh, j0, k, Q + b * sqb + h * sqh, LSE + bh * T


@triton.jit
def _split_kernel(Q, K, LSE, COL, sqb, sqh, sqt, skb, skh, skt, HQ, G, T, scale, D: tl.constexpr,
                  BLOCK_M: tl.constexpr, BN_A: tl.constexpr, BN_P: tl.constexpr, EA: tl.constexpr,
                  EP: tl.constexpr, DOT: tl.constexpr):
    bh = tl.program_id(1)
    b, h = bh // HQ, bh % HQ
    g = h // G
    ja = tl.program_id(0) * (BN_A + BN_P)
    jp = ja + BN_A
    k_base = K + b * skb + g * skh
    k_a = _load(k_base, ja, T, skt, BN_A, D)
    k_p = _load(k_base, jp, T, skt, BN_P, D)
    q_base = Q + b * sqb + h * sqh
    lse_base = LSE + bh * T
    lo = (ja // BLOCK_M) * BLOCK_M
    a = tl.minimum(tl.cdiv(jp + BN_P - 1, BLOCK_M) * BLOCK_M, T)
    col_a = tl.zeros([BLOCK_M, BN_A], tl.float32)
    col_p = tl.zeros([BLOCK_M, BN_P], tl.float32)
    for i0 in range(lo, a, BLOCK_M):                 # tiles on the diagonal: masked, MUFU
        col_a += _column_tile(q_base, lse_base, k_a, i0, ja, 0, T, sqt, 1, scale, 1.0, D, 0, BLOCK_M, BN_A, D,
                              False, DOT, True)
        col_p += _column_tile(q_base, lse_base, k_p, i0, jp, 0, T, sqt, 1, scale, 1.0, D, 0, BLOCK_M, BN_P, D,
                              False, DOT, True)
    c2 = scale * 1.4426950408889634
    for i0 in range(a, T, BLOCK_M):                  # the band: every pair allowed
        q = _load(q_base, i0, T, sqt, BLOCK_M, D)
        r = i0 + tl.arange(0, BLOCK_M)
        lse = tl.load(lse_base + r, mask=r < T, other=float("inf"))
        col_a += exp2_by(_dot(q, tl.trans(k_a), DOT) * c2 - lse[:, None], EA)
        col_p += exp2_by(_dot(q, tl.trans(k_p), DOT) * c2 - lse[:, None], EP)
    j = ja + tl.arange(0, BN_A)
    tl.store(COL + bh * T + j, tl.sum(col_a, axis=0), mask=j < T)
    j = jp + tl.arange(0, BN_P)
    tl.store(COL + bh * T + j, tl.sum(col_p, axis=0), mask=j < T)


@triton.jit
def _ws_kernel(Q, K, LSE, COL, sqb, sqh, sqt, skb, skh, skt, HQ, G, T, scale, D: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr, DOT: tl.constexpr):
    bh, j0, k, q_base, lse_base = _key_program(Q, K, LSE, sqb, sqh, skb, skh, skt, HQ, G, T, D, BLOCK_N)
    q_desc = tl.make_tensor_descriptor(q_base, shape=[T, D], strides=[sqt, 1], block_shape=[BLOCK_M, D])
    lo = (j0 // BLOCK_M) * BLOCK_M
    a = tl.minimum(tl.cdiv(j0 + BLOCK_N - 1, BLOCK_M) * BLOCK_M, T)
    col = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for i0 in range(lo, a, BLOCK_M):
        col += _column_tile(q_base, lse_base, k, i0, j0, 0, T, sqt, 1, scale, 1.0, D, 0, BLOCK_M, BLOCK_N, D,
                            False, DOT, True)
    c2 = scale * 1.4426950408889634
    for i0 in tl.range(a, T, BLOCK_M, num_stages=STAGES, warp_specialize=True):
        q = q_desc.load([i0, 0])
        r = i0 + tl.arange(0, BLOCK_M)
        lse = tl.load(lse_base + r, mask=r < T, other=float("inf"))
        col += tl.exp2(_dot(q, tl.trans(k), DOT) * c2 - lse[:, None])
    j = j0 + tl.arange(0, BLOCK_N)
    tl.store(COL + bh * T + j, tl.sum(col, axis=0), mask=j < T)


@triton.jit
def _transposed_kernel(Q, K, LSE, COL, sqb, sqh, sqt, skb, skh, skt, HQ, G, T, scale, D: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, DOT: tl.constexpr):
    """The key block as the MMA's M side: s^T = k . q^T [BLOCK_N keys, BLOCK_M rows]; each tile's rows
    (keys) are summed at once (within a thread and its quad), so no [BLOCK_M, BLOCK_N] accumulator:
    more keys fit per program, and every q tile streamed from L2 serves BLOCK_N keys."""
    bh, j0, k, q_base, lse_base = _key_program(Q, K, LSE, sqb, sqh, skb, skh, skt, HQ, G, T, D, BLOCK_N)
    lo = (j0 // BLOCK_M) * BLOCK_M
    a = tl.minimum(tl.cdiv(j0 + BLOCK_N - 1, BLOCK_M) * BLOCK_M, T)
    c2 = scale * 1.4426950408889634
    j = j0 + tl.arange(0, BLOCK_N)
    col = tl.zeros([BLOCK_N], tl.float32)
    for i0 in range(lo, a, BLOCK_M):                 # tiles on the diagonal: masked
        q = _load(q_base, i0, T, sqt, BLOCK_M, D)
        r = i0 + tl.arange(0, BLOCK_M)
        lse = tl.load(lse_base + r, mask=r < T, other=float("inf"))
        x = _dot(k, tl.trans(q), DOT) * c2 - lse[None, :]
        x = tl.where((j[:, None] <= r[None, :]) & (r[None, :] < T), x, float("-inf"))
        col += tl.sum(tl.exp2(x), axis=1)
    for i0 in range(a, T, BLOCK_M):                  # the band
        q = _load(q_base, i0, T, sqt, BLOCK_M, D)
        r = i0 + tl.arange(0, BLOCK_M)
        lse = tl.load(lse_base + r, mask=r < T, other=float("inf"))
        col += tl.sum(tl.exp2(_dot(k, tl.trans(q), DOT) * c2 - lse[None, :]), axis=1)
    tl.store(COL + bh * T + j, col, mask=j < T)


def _args(q, k, lse, scale):
    b, hq, t, d = q.shape
    col = torch.empty(b, hq, t, device=q.device, dtype=torch.float32)
    assert q.stride(3) == 1 and k.stride(3) == 1
    return col, (q, k, lse, col, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), hq,
                 hq // k.shape[1], t, scale)


def split(q, k, lse, scale, bm, bn_a, bn_p, ea, ep, warps=4, stages=2):
    col, args = _args(q, k, lse, scale)
    _split_kernel[(triton.cdiv(q.shape[2], bn_a + bn_p), q.shape[0] * q.shape[1])](
        *args, D=q.shape[3], BLOCK_M=bm, BN_A=bn_a, BN_P=bn_p, EA=ea, EP=ep, DOT=dot_mode(q), num_warps=warps, num_stages=stages)
    return col


def warp_specialized(q, k, lse, scale, bm, bn, warps, stages):
    col, args = _args(q, k, lse, scale)
    _ws_kernel[(triton.cdiv(q.shape[2], bn), q.shape[0] * q.shape[1])](
        *args, D=q.shape[3], BLOCK_M=bm, BLOCK_N=bn, STAGES=stages, DOT=dot_mode(q), num_warps=warps)
    return col


def transposed(q, k, lse, scale, bn, bm, warps, stages):
    col, args = _args(q, k, lse, scale)
    _transposed_kernel[(triton.cdiv(q.shape[2], bn), q.shape[0] * q.shape[1])](
        *args, D=q.shape[3], BLOCK_N=bn, BLOCK_M=bm, DOT=dot_mode(q), num_warps=warps, num_stages=stages)
    return col


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prompt", type=int, default=32768)
    a = ap.parse_args()
    dev = torch.device("cuda")
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    scale = 128 ** -0.5
    qs, ks, pads, lses = inputs(2048, 1)
    want = head_column_sums_rows(qs.double(), ks.double(), pads, scale)
    q, k, pad, lse = inputs(a.prompt, 0)
    flops = 2 * 128 * 32 * a.prompt * (a.prompt + 1) / 2
    variants = {"kernel": lambda q, k, lse: head_column_sums_triton(q, k, torch.zeros_like(pad), scale, lse=lse)}
    for bn_a, bn_p, ea, ep in ((64, 64, 0, 0), (64, 64, 3, 3), (64, 64, 4, 4), (128, 32, 0, 4)):
        variants[f"split_{bn_a}_{bn_p}_e{ea}{ep}"] = (
            lambda q, k, lse, bn_a=bn_a, bn_p=bn_p, ea=ea, ep=ep: split(q, k, lse, scale, 64, bn_a, bn_p, ea, ep))
    for bn, bm, w, st in ((128, 64, 4, 2), (128, 64, 4, 3), (256, 64, 8, 2), (256, 64, 8, 3), (256, 64, 4, 2),
                          (128, 128, 4, 2), (256, 128, 8, 2), (128, 128, 8, 2), (256, 32, 8, 3), (512, 64, 8, 2)):
        variants[f"transposed_bn{bn}_bm{bm}_w{w}_s{st}"] = (
            lambda q, k, lse, bn=bn, bm=bm, w=w, st=st: transposed(q, k, lse, scale, bn, bm, w, st))
    for bm, bn, w, st in ((128, 128, 8, 2),):
        variants[f"ws_bm{bm}_bn{bn}_w{w}_s{st}"] = (
            lambda q, k, lse, bm=bm, bn=bn, w=w, st=st: warp_specialized(q, k, lse, scale, bm, bn, w, st))
    rows = [measure(name, functools.partial(fn, qs, ks, lses), functools.partial(fn, q, k, lse), want, dev, flops)
            for name, fn in variants.items()]
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "column-pass-exp-split.json").write_text(json.dumps(
        {"gpu": torch.cuda.get_device_name(), "prompt": a.prompt, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
