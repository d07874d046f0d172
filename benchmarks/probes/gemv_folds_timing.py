"""The GEMV's folds one call at a time on a GPU: each Llama-3.1-8B decode linear plain and with what
``linears_to_gemv`` folds into it (RMSNorm into q/k/v and gate/up, the residual add into o and down; down also
SiLU-gated), --reps calls back to back over rotating weight copies in one CUDA graph (``time_fn``), per
launch config. The unfolded step pays the norm as a separate launch; this shows what the fold costs the GEMV.

    PYTHONPATH=$PWD python3 benchmarks/probes/gemv_folds_timing.py --out $OUT/gemv-folds-timing-<gpu>.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.bench.timing import time_fn
from kvpass.kernels.gemv import gemv_triton

# name: (N, K, folded kwargs builder)
SHAPES = {"qkv": (6144, 4096, "norm"), "gate_up": (28672, 4096, "norm"), "o": (4096, 4096, "residual"),
          "down": (4096, 14336, "residual")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--reps", type=int, default=16)
    ap.add_argument("--configs", default="4,2048,4;4,1024,4;4,1024,2;2,2048,4;2,1024,4;4,512,4;8,512,4;8,1024,4")
    a = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    configs = [tuple(int(v) for v in c.split(",")) for c in a.configs.split(";")]
    rows = {}
    for name, (n, k, fold) in SHAPES.items():
        ws = [torch.randn(n, k, device=dev, dtype=dt) * k ** -0.5 for _ in range(a.reps)]
        gate = name == "down"
        x = torch.randn(1, 1, 2 * k if gate else k, device=dev, dtype=dt)
        extra = ({"norm_weight": torch.rand(k, device=dev, dtype=dt) + 0.5, "norm_eps": 1e-5} if fold == "norm"
                 else {"residual": torch.randn(1, 1, n, device=dev, dtype=dt)})
        row = {}
        for bn, bk, warps in configs:
            cfg = dict(block_n=bn, block_k=bk, num_warps=warps)
            for label, kw in (("plain", {}), ("folded", extra)):
                def calls(kw=kw, cfg=cfg, ws=ws, x=x, gate=gate):
                    for w in ws:
                        gemv_triton(x, w, None, gate, **kw, **cfg)
                row[f"{label} {bn}x{bk}/{warps}"] = time_fn(calls, dev) / a.reps * 1e6
        rows[name] = row
        print(name, {key: round(v, 2) for key, v in row.items()}, flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "us_per_call": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
