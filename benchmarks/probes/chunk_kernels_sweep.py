"""Launch grids of chunked prefill's two Triton passes over the cache (kvpass/kernels/chunk_attention.py's
``cache_attention_triton`` and kvpass/kernels/chunk_column_sums.py's ``cache_column_sums_triton``) at the shape of a
Llama-3.1-8B chunk (32 query / 8 KV heads of 128, chunk 4096, ~8.7k cached entries at 32k and budget 0.2; bf16),
each config timed by ``time_fn`` (CUDA graph, do_bench median) and checked against the default launch.

    PYTHONUNBUFFERED=1 python3 benchmarks/probes/chunk_kernels_sweep.py --out $OUT/chunk-kernels-sweep-<gpu>.json

Writes each config's microseconds, TFLOP/s (4 T G C D per KV head for attention, 2 T G C D for the column sums'
q . k), and the largest difference from the default's output.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.bench.timing import time_fn  # noqa: E402
from kvpass.kernels.chunk_attention import cache_attention_triton  # noqa: E402
from kvpass.kernels.chunk_column_sums import cache_column_sums_triton  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--cache", type=int, default=8700)
    a = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    b, hq, hkv, d, t, c = 1, 32, 8, 128, a.chunk, a.cache
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(b, hq, t, d, device=dev, dtype=dt, generator=gen)
    kc, vc = (torch.randn(b, hkv, c, d, device=dev, dtype=dt, generator=gen) for _ in range(2))
    lw = torch.zeros(b, hkv, c, device=dev)
    lw[..., ::7] = math.log(3.0)                                     # some merged entries
    scale = d ** -0.5
    o0, lse0 = cache_attention_triton(q, kc, vc, lw, scale)
    col0 = cache_column_sums_triton(q, kc, lw, lse0 + 1.0, scale)    # any finite normaliser: timing and agreement
    flops = {"attention": 4 * t * hq * c * d, "column_sums": 2 * t * hq * c * d}
    result: dict = {"gpu": torch.cuda.get_device_name(), "shape": dict(b=b, hq=hq, hkv=hkv, d=d, t=t, c=c),
                    "attention": [], "column_sums": []}
    result["attention_default_us"] = time_fn(lambda: cache_attention_triton(q, kc, vc, lw, scale), dev) * 1e6
    result["column_sums_default_us"] = time_fn(lambda: cache_column_sums_triton(q, kc, lw, lse0 + 1.0, scale), dev) * 1e6
    print("defaults", result["attention_default_us"], result["column_sums_default_us"], flush=True)
    grid = list(itertools.product((64, 128), (64, 128), (4, 8), (2, 3)))
    for bm, bn, warps, stages in grid:
        kw = dict(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)
        for name, fn, check in (
                ("attention", lambda kw=kw: cache_attention_triton(q, kc, vc, lw, scale, **kw),
                 lambda got: max(float((got[0].float() - o0.float()).abs().max()), float((got[1] - lse0).abs().max()))),
                ("column_sums", lambda kw=kw: cache_column_sums_triton(q, kc, lw, lse0 + 1.0, scale, **kw),
                 lambda got: float(((got - col0).abs() / col0.abs().clamp(min=1e-6)).max()))):
            try:
                err = check(fn())
                us = time_fn(fn, dev) * 1e6
            except Exception as e:                        # noqa: BLE001  (registers, shared memory)
                result[name].append({**kw, "error": repr(e)[:160]})
                continue
            result[name].append({**kw, "us": us, "tflops": flops[name] / us / 1e6, "diff_vs_default": err})
    for name in ("attention", "column_sums"):
        ok = sorted((r for r in result[name] if "us" in r), key=lambda r: r["us"])
        result[f"{name}_best"] = ok[:5]
        print(name, "best", ok[:3], flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
