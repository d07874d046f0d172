"""Whether a one-launch Triton GEMV (kvpass/kernels/gemv.py) beats cuBLAS at batch 1 for the decode step's
linears of a Llama-3.1-8B-shaped model (fused q/k/v 4096 -> 6144, o 4096 -> 4096, fused gate/up
4096 -> 28672, down 14336 -> 4096, lm_head 4096 -> 128256; bf16, random).

    PYTHONUNBUFFERED=1 python3 benchmarks/probes/gemv_sweep.py --out $OUT [--layers 32]

Per shape: --reps calls back to back over rotating weight copies (more bytes than L2) from one CUDA
graph, so launch gaps count as in the replayed decode step; ``time_fn`` (do_bench median, L2 flushed)
over reps gives the time per call. F.linear (cuBLAS) and every Triton config of the grid; the copy
bandwidth of the same run gives each call's floor. Then --layers blocks chained (qkv, o, gate/up,
silu * up, down), cuBLAS against the GEMV with each shape's fastest config and with its default; one
block's error against float64 for each. Writes gemv-sweep-<gpu>.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.bench.timing import copy_bandwidth, time_fn
from kvpass.kernels.gemv import gemv_triton

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--reps", type=int, default=16)
    ap.add_argument("--block-n", default="4,8,16,32")
    ap.add_argument("--block-k", default="512,1024,2048")
    ap.add_argument("--warps", default="4,8")
    a = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    copy_bw = copy_bandwidth(dev, 1 << 30)
    grid = list(itertools.product(*[[int(v) for v in s.split(",")] for s in (a.block_n, a.block_k, a.warps)]))
    result: dict = {"gpu": torch.cuda.get_device_name(), "copy_GBps": copy_bw / 1e9, "shapes": {}}
    best: dict[str, dict] = {}
    for name, (n, k) in SHAPES.items():
        copies = max(2, -(-(256 << 20) // (n * k * 2)))
        ws = [torch.randn(n, k, device=dev, dtype=dt) * k ** -0.5 for _ in range(copies)]
        x = torch.randn(1, k, device=dev, dtype=dt)
        want = F.linear(x.double(), ws[0].double())
        reps = a.reps if name != "lm_head" else 4
        floor_us = n * k * 2 / copy_bw * 1e6

        def per_call(fn, ws=ws, copies=copies, reps=reps) -> float:
            return time_fn(lambda: [fn(ws[i % copies]) for i in range(reps)], dev) / reps * 1e6

        row = {"n": n, "k": k, "floor_us": floor_us, "cublas_us": per_call(lambda w, x=x: F.linear(x, w)), "configs": []}
        row["cublas_err"] = float((F.linear(x, ws[0]).double() - want).abs().max())
        for bn, bk, warps in grid:
            kw = dict(block_n=bn, block_k=bk, num_warps=warps)
            try:
                err = float((gemv_triton(x, ws[0], **kw).double() - want).abs().max())
                us = per_call(lambda w, kw=kw, x=x: gemv_triton(x, w, **kw))
            except Exception as e:                    # a config that does not compile (registers, shared memory)
                row["configs"].append({**kw, "error": repr(e)[:200]})
                continue
            row["configs"].append({**kw, "us": us, "x_floor": us / floor_us, "vs_cublas": row["cublas_us"] / us,
                                   "max_abs_err": err})
        ok = [c for c in row["configs"] if "us" in c]
        row["best"] = min(ok, key=lambda c: c["us"])
        best[name] = {key: row["best"][key] for key in ("block_n", "block_k", "num_warps")}
        print(name, f"cublas {row['cublas_us']:.1f} us, floor {floor_us:.1f}, best", row["best"], flush=True)
        result["shapes"][name] = row
        del ws

    inter, h = 14336, 4096
    layers = [{name: torch.randn(*SHAPES[name], device=dev, dtype=dt) * SHAPES[name][1] ** -0.5
               for name in ("qkv", "o", "gate_up", "down")} for _ in range(a.layers)]

    def block(x, lin, blocks):
        for lay in blocks:
            q = lin(x, lay["qkv"], "qkv")[..., :h]
            y = lin(q, lay["o"], "o")
            g, u = lin(y, lay["gate_up"], "gate_up").split(inter, dim=-1)
            x = lin(F.silu(g) * u, lay["down"], "down")
            x = x * torch.rsqrt(x.float().pow(2).mean() + 1e-6).to(x.dtype)    # keep the chain's values bounded
        return x

    paths = {"cublas": lambda x, w, name: F.linear(x, w),
             "gemv_best": lambda x, w, name: gemv_triton(x, w, **best[name]),
             "gemv_default": lambda x, w, name: gemv_triton(x, w)}
    x = torch.randn(1, h, device=dev, dtype=dt)
    chain = {f"{label}_ms": time_fn(lambda lin=lin: block(x, lin, layers), dev) * 1e3 for label, lin in paths.items()}
    weight_bytes = sum(w.numel() * 2 for lay in layers for w in lay.values())
    chain["floor_ms"] = weight_bytes / copy_bw * 1e3
    # one block against float64 (a chain of random blocks amplifies rounding differences, so only one is compared)
    want = block(x.double(), lambda x, w, name: F.linear(x, w.double()), layers[:1])
    for label, lin in paths.items():
        got = block(x, lin, layers[:1]).double()
        chain[f"{label}_one_block_rel_err"] = float((got - want).norm() / want.norm())
    result["chain"] = {"layers": a.layers, "best_configs": best, **chain}
    print("chain", result["chain"], flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / f"gemv-sweep-{torch.cuda.get_device_name().lower().replace(' ', '-')}.json").write_text(
        json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
