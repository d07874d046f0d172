"""The prefill column pass (``head_column_sums_triton`` given the rows' lse) at Llama-3.1-8B heads, one GPU:
launch configs, and a software-pipelined loop (the next tile's q . k^T issued before this tile's
exponentials) with three exp forms, against the float64 reference for accuracy. (The sweep in
benchmarks/results/column-pass-sweep-*.json was made when the kernel itself also took the exp forms.)

    PYTHONUNBUFFERED=1 python3 benchmarks/probes/column_pass_sweep.py --out $OUT [--prompt 32768]

Timing: B 1, Hq 32, Hkv 8, D 128, bf16, q in the model's [B, T, H, D] layout, T = --prompt, lse from the
prefill op (cuDNN); each variant captured in a CUDA graph, do_bench median. Accuracy at T = 2048 against
``head_column_sums_rows`` in float64: max |err| / max col, median relative error over columns with
col > 1e-3, and the overlap of the top 20% keys (mean over the group, D2O's ranking) with the reference's.
Writes column-pass-sweep.json under --out.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import torch

from benchmarks.bench.timing import time_fn
from kvpass.kernels._triton import tl, triton
from kvpass.kernels.attention_column_sums import (
    _column_tile,
    head_column_sums_rows,
    head_column_sums_triton,
)
from kvpass.kernels.decode_attention import _dot


@triton.jit
def exp2_fast(x, EXP: tl.constexpr):
    """2^x, fp32 in and out. EXP 0: tl.exp2; 1: one ex2.approx.ftz.f32 (no subnormal fix-up around it);
    2: ex2.approx.f16x2 on pairs, each x rounded to fp16 first (~1e-3 relative)."""
    if EXP == 1:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    elif EXP == 2:
        return tl.inline_asm_elementwise(
            """{
            .reg .b32 t;
            .reg .b16 lo, hi;
            cvt.rn.f16x2.f32 t, $3, $2;
            ex2.approx.f16x2 t, t;
            mov.b32 {lo, hi}, t;
            cvt.f32.f16 $0, lo;
            cvt.f32.f16 $1, hi;
            }""", "=r,=r,r,r", [x], dtype=tl.float32, is_pure=True, pack=2)
    else:
        return tl.exp2(x)


@triton.jit
def _pipelined_column_kernel(Q, K, LSE, COL, sqb, sqh, sqt, sqd, skb, skh, skt, skd, HQ, G, T, scale,
                             HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_D: tl.constexpr, EXP: tl.constexpr, DOT: tl.constexpr = 0):
    """Causal, no pads/window/softcap (the benchmark's case): the band tiles with the next tile's dot issued
    before this tile's exponentials; the diagonal tiles masked as in the kernel."""
    bh = tl.program_id(1)
    b, h = bh // HQ, bh % HQ
    g = h // G
    j0 = tl.program_id(0) * BLOCK_N
    lo = (j0 // BLOCK_M) * BLOCK_M
    a = tl.minimum(tl.cdiv(j0 + BLOCK_N - 1, BLOCK_M) * BLOCK_M, T)
    c2 = scale * 1.4426950408889634
    dd = tl.arange(0, BLOCK_D)
    k = tl.load(K + b * skb + g * skh + (j0 + tl.arange(0, BLOCK_N))[:, None] * skt + dd[None, :] * skd,
                mask=((j0 + tl.arange(0, BLOCK_N))[:, None] < T) & (dd[None, :] < HEAD_DIM), other=0.0)
    q_base = Q + b * sqb + h * sqh
    lse_base = LSE + bh * T
    col = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for i0 in range(lo, a, BLOCK_M):
        col += _column_tile(q_base, lse_base, k, i0, j0, 0, T, sqt, sqd, scale, 1.0, HEAD_DIM, 0,   # the diagonal
                            BLOCK_M, BLOCK_N, BLOCK_D, False, DOT, True)
    if a < T:
        r = a + tl.arange(0, BLOCK_M)
        q = tl.load(q_base + r[:, None] * sqt + dd[None, :] * sqd, mask=r[:, None] < T, other=0.0)
        s = _dot(q, tl.trans(k), DOT)
        lse = tl.load(lse_base + r, mask=r < T, other=float("inf"))
        for i0 in range(a + BLOCK_M, T, BLOCK_M):
            r = i0 + tl.arange(0, BLOCK_M)
            q = tl.load(q_base + r[:, None] * sqt + dd[None, :] * sqd, mask=r[:, None] < T, other=0.0)
            s_next = _dot(q, tl.trans(k), DOT)
            lse_next = tl.load(lse_base + r, mask=r < T, other=float("inf"))
            col += exp2_fast(s * c2 - lse[:, None], EXP)
            s = s_next
            lse = lse_next
        col += exp2_fast(s * c2 - lse[:, None], EXP)
    j = j0 + tl.arange(0, BLOCK_N)
    tl.store(COL + bh * T + j, tl.sum(col, axis=0), mask=j < T)


def pipelined(q, k, lse, scale, bm, bn, warps, stages, exp):
    b, hq, t, d = q.shape
    col = torch.empty(b, hq, t, device=q.device, dtype=torch.float32)
    _pipelined_column_kernel[(triton.cdiv(t, bn), b * hq)](
        q, k, lse, col, *q.stride(), *k.stride(), hq, hq // k.shape[1], t, scale, HEAD_DIM=d, BLOCK_M=bm,
        BLOCK_N=bn, BLOCK_D=d, EXP=exp, num_warps=warps, num_stages=stages)
    return col


def inputs(t: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, t, 32, 128, device="cuda", generator=g).to(torch.bfloat16).transpose(1, 2)
    k = torch.randn(1, 8, t, 128, device="cuda", generator=g).to(torch.bfloat16)
    v = torch.randn(1, 8, t, 128, device="cuda", generator=g).to(torch.bfloat16)
    k = k * 2.0                                             # peakier rows than unit logits
    pad = torch.zeros(1, dtype=torch.int64, device="cuda")
    _, lse = torch.ops.kvpass.prefill_attention_lse(q, k, v, pad, 128 ** -0.5)
    return q, k, pad, lse


def accuracy(col: torch.Tensor, want: torch.Tensor) -> dict:
    col, want = col.double().cpu(), want.double().cpu()
    big = want > 1e-3
    rel = ((col - want).abs() / want.clamp_min(1e-30))[big]
    n = want.shape[-1]
    top = max(1, n // 5)
    wk, gk = (x.reshape(1, 8, 4, n).mean(2).topk(top, dim=-1).indices for x in (want, col))
    overlap = sum(len(set(a.tolist()) & set(c.tolist())) for a, c in zip(wk.reshape(8, top), gk.reshape(8, top),
                                                                            strict=True)) / (8 * top)
    return {"max_abs_over_max": float((col - want).abs().max() / want.max()), "median_rel": float(rel.median()),
            "max_rel": float(rel.max()), "top20_overlap": overlap}


def measure(name: str, small, full, want: torch.Tensor, dev: torch.device, flops: float) -> dict:
    """One variant's row: ``small()`` (T = 2048) against ``want`` (``accuracy``) and the median time of
    ``full()``; the error instead where the variant does not fit or compile."""
    row = {"variant": name}
    try:
        row.update(accuracy(small(), want))
        ms = time_fn(full, dev) * 1e3
        row.update(ms=ms, tflops=flops / ms / 1e9)
    except Exception as exc:  # noqa: BLE001  (a config may not fit, an asm form may not assemble)
        row["error"] = repr(exc)[:400]
    print(row, flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prompt", type=int, default=32768)
    a = ap.parse_args()
    dev = torch.device("cuda")
    scale = 128 ** -0.5
    qs, ks, pads, lses = inputs(2048, 1)
    want = head_column_sums_rows(qs.double(), ks.double(), pads, scale)
    q, k, pad, lse = inputs(a.prompt, 0)
    flops = 2 * 128 * 32 * a.prompt * (a.prompt + 1) / 2
    variants = {}
    for bm, bn, w, st in ((64, 128, 4, 3), (64, 128, 4, 2), (128, 128, 8, 2), (128, 128, 8, 3), (64, 64, 4, 3),
                          (128, 64, 8, 3), (64, 256, 8, 2), (128, 128, 4, 2)):
        variants[f"kernel_exp0_bm{bm}_bn{bn}_w{w}_s{st}"] = functools.partial(
            head_column_sums_triton, block_m=bm, block_n=bn, num_warps=w, num_stages=st)
    for exp in (0, 1, 2):
        for bm, bn, w, st in ((64, 128, 4, 2), (64, 128, 4, 1), (128, 128, 8, 2), (64, 64, 4, 2), (128, 64, 8, 2)):
            variants[f"pipelined_exp{exp}_bm{bm}_bn{bn}_w{w}_s{st}"] = (
                lambda q, k, pad, scale, lse, bm=bm, bn=bn, w=w, st=st, exp=exp:
                pipelined(q, k, lse, scale, bm, bn, w, st, exp))
    rows = []
    for name, fn in variants.items():
        rows.append(measure(name, functools.partial(fn, qs, ks, pads, scale, lse=lses),
                            functools.partial(fn, q, k, pad, scale, lse=lse), want, dev, flops))
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "column-pass-sweep.json").write_text(json.dumps(
        {"gpu": torch.cuda.get_device_name(), "prompt": a.prompt, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
