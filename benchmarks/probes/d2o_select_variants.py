"""The Triton evict-many step (``evict_many_triton``, one layer, Llama-3.1-8B's KV shapes, bf16) under different
options of its select kernel: the call replayed from a CUDA graph (refill + compress, minus refill alone), per
(batch, m) and option set, so a choice of block sizes, search arity, whether the row is held in registers
(``resident_max``) and warps is made on measurements.

    PYTHONPATH=$PWD PYTHONUNBUFFERED=1 python3 benchmarks/probes/d2o_select_variants.py --out $OUT/select.json \\
        [--b 1 32 --keep 6554 --m 16 64]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from kvpass.kernels.d2o_evict_many import evict_many_triton, split_tensor

from benchmarks.bench.timing import gpu_name, time_fn
from benchmarks.d2o_evict_many_gpu import full_layer, refill
from kvpass.policies.d2o import D2O

VARIANTS = {
    "default": {},
    "blocks, 16-ary": dict(resident_max=1),
    "blocks, 4-ary": dict(resident_max=1, ways=4),
    "resident, 16 warps": dict(num_warps=16),
    "resident, block 8192": dict(block=8192),
}


def time_variant(b: int, keep: int, m: int, options: dict, dev: torch.device) -> float:
    """Milliseconds of one graphed call (refill + compress minus refill)."""
    policy = D2O(interval=m)
    cache = full_layer(b, 8, keep + m, 128, torch.bfloat16, "cuda")
    layer = policy._in_place_layer(cache)
    split = split_tensor(b, dev, keep, keep + 1, policy.sinks, keep // 4, 0)    # n_m_ratio 3:1: a quarter recent

    def call():
        refill(cache, keep, 1)
        evict_many_triton(*layer, split, m, policy.beta, policy.d2o_variant, -2.0, False, **options)

    both = time_fn(call, dev)
    fill = time_fn(lambda: refill(cache, keep, 1), dev)
    return (both - fill) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--b", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--keep", type=int, default=6554)
    ap.add_argument("--m", type=int, nargs="+", default=[16, 64])
    a = ap.parse_args()
    dev = torch.device("cuda")
    out: dict = {"gpu": gpu_name(dev), "torch": torch.__version__, "keep": a.keep, "rows": []}
    for b in a.b:
        for m in a.m:
            for name, options in VARIANTS.items():
                ms = time_variant(b, a.keep, m, options, dev)
                out["rows"].append({"b": b, "m": m, "variant": name, "options": options, "graphed_ms": ms})
                print(f"b {b} m {m} {name}: {ms:.4f} ms", flush=True)
                a.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
