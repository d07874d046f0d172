"""Where the time of D2O's in-place evict-many step goes (one layer, Llama-3.1-8B's shapes, bf16): the call
replayed from a CUDA graph (refill + compress, minus refill alone: what the compiled decode step pays), and a
torch.profiler table of its kernels (eager calls), with the nearest-key search (cosine_match) timed alone.

    PYTHONUNBUFFERED=1 python3 benchmarks/probes/d2o_evict_many_profile.py --out $OUT [--b 32 --keep 6554 --m 16]

benchmarks/d2o_evict_many_gpu.py times the same call eagerly (H200: 3.47 ms a call at B 32, m 16), which
includes every launch's host cost. Writes d2o-evict-many-profile.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.bench.timing import time_fn
from benchmarks.d2o_evict_many_gpu import full_layer, refill
from kvpass.policies.d2o import D2O


def profile_one(b: int, keep: int, m: int, dev: torch.device) -> dict:
    """One layer of capacity keep + m: the graphed call's time, cosine_match's alone, and the kernel table."""
    policy = D2O(interval=m)
    cache = full_layer(b, 8, keep + m, 128, torch.bfloat16, "cuda")
    both = time_fn(lambda: (refill(cache, keep, 1), policy.compress_into(cache, keep)), dev)
    fill = time_fn(lambda: refill(cache, keep, 1), dev)
    e_idx = torch.randint(0, keep, (b, 8, m), device=dev)
    k_e = torch.gather(cache.k, 2, e_idx[..., None].expand(-1, -1, -1, 128))
    targets = torch.ones(b, 8, keep + m, dtype=torch.bool, device=dev)
    match = time_fn(lambda: torch.ops.kvpass.cosine_match(k_e, cache.k, targets), dev)
    row = {"m": m, "graphed_ms_per_call": (both - fill) * 1e3, "graphed_ms_per_token": (both - fill) * 1e3 / m,
           "cosine_match_ms": match * 1e3, "refill_ms": fill * 1e3}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            refill(cache, keep, 1)
            policy.compress_into(cache, keep)
        torch.cuda.synchronize()
    row["profile"] = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--b", type=int, default=32)
    ap.add_argument("--keep", type=int, default=6554)
    ap.add_argument("--m", type=int, nargs="+", default=[4, 16, 64])
    ap.add_argument("--plain-torch", action="store_true",
                    help="the plain-torch step (evict_many_in_place) instead of the Triton op kvpass::d2o_evict_many")
    a = ap.parse_args()
    if a.plain_torch:
        D2O._triton_step = lambda self, cache: False
    dev = torch.device("cuda")
    out: dict = {"gpu": torch.cuda.get_device_name(), "b": a.b, "keep": a.keep,
                 "step": "plain torch" if a.plain_torch else "triton", "rows": []}
    for m in a.m:
        row = profile_one(a.b, a.keep, m, dev)
        print(json.dumps({k: v for k, v in row.items() if k != "profile"}), flush=True)
        print(row["profile"], flush=True)
        out["rows"].append(row)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "d2o-evict-many-profile.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
