"""Launch parameters of the decode-attention kernel where it trails SDPA (batches 16-32), on one GPU.

    PYTHONUNBUFFERED=1 python3 benchmarks/probes/decode_attention_batch_sweep.py --out $OUT

At each (C, B) of --points: SDPA over the dense cache (as ``kvpass bench``'s kernel rows time it) and the
Triton kernel at the default launch and at every (block_n, warps, stages, 0.5x/1x/2x splits), each timed
from a CUDA graph (do_bench median, L2 flushed). Writes decode-attention-batch-sweep.json under --out.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.bench.kernels import decode_case
from benchmarks.bench.timing import time_fn
from kvpass.kernels.decode_attention import decode_attention_triton, decode_splits


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--points", default="1024x16,1024x32,4096x32,32768x32,65536x16")
    ap.add_argument("--splits-only", action="store_true",
                    help="only the split count (0.125x-2x) at the default block, warps and stages")
    a = ap.parse_args()
    dev, hq, hkv, d = torch.device("cuda"), 32, 8, 128
    out = {"gpu": torch.cuda.get_device_name(), "points": []}
    for point in a.points.split(","):
        c, b = (int(x) for x in point.split("x"))
        q, k, v, lw = decode_case(b, hq, hkv, c, d, torch.bfloat16, dev, seed=c + b)
        qg = q.reshape(b, hkv, hq // hkv, d)
        sdpa = time_fn(functools.partial(F.scaled_dot_product_attention, qg, k, v, scale=d ** -0.5), dev) * 1e6
        default = time_fn(functools.partial(decode_attention_triton, q, k, v, lw, d ** -0.5), dev) * 1e6
        rows = []
        grid = (itertools.product((64,), (4,), (2 if b * hkv >= 128 else 3,), (0.125, 0.25, 0.5, 1, 2)) if a.splits_only
                else itertools.product((32, 64, 128), (4, 8), (2, 3, 4), (0.5, 1, 2)))
        for bn, nw, ns, mult in grid:
            splits = max(1, int(decode_splits(b, hkv, c, bn, dev) * mult))
            cfg = dict(block_n=bn, num_warps=nw, num_stages=ns, num_splits=splits)
            try:
                us = time_fn(functools.partial(decode_attention_triton, q, k, v, lw, d ** -0.5, **cfg), dev) * 1e6
                rows.append({**cfg, "split_mult": mult, "us": us, "sdpa_over_triton": sdpa / us})
            except Exception as exc:  # noqa: BLE001  (a config may not fit shared memory)
                rows.append({**cfg, "split_mult": mult, "error": repr(exc)[:200]})
        best = min((r for r in rows if "us" in r), key=lambda r: r["us"])
        out["points"].append({"C": c, "B": b, "sdpa_us": sdpa, "default_us": default,
                              "default_sdpa_over_triton": sdpa / default, "best": best, "rows": rows})
        print(f"C={c} B={b}: sdpa {sdpa:.1f} us, default {default:.1f} us ({sdpa / default:.2f}), best {best}",
              flush=True)
        del q, k, v, lw, qg
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "decode-attention-batch-sweep.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
