"""One layer's D2O decode-time compression with ``interval`` m > 1: the in-place evict-many step against the
reference and a copy back (sort, copy, fp32 copies of K and V: what the runtime ran before the evict-many step),
and the one-in-one-out step for scale.

    python benchmarks/d2o_evict_many_gpu.py --b 32 --hkv 8 --keep 6554 --interval 16 --out OUT.json
    python benchmarks/d2o_evict_many_gpu.py --smoke          # CPU, small shapes: that it runs

Per path: a layer of capacity keep + m (keep + 1 for the one-in-one-out row) holding keep + m entries in every
row (random bf16 K, V, random scores, positions in a random slot order), compressed ``--reps`` times; before
each rep (untimed) the freed slots are refilled with new entries (positions above the newest, length = C), as
m decode steps would. Times with CUDA events (wall clock on CPU), median per call and per token (call / m).
The "general" row is the slow path of any policy without the in-place capability (``InPlace.compress_into``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvpass.cache import LayerCache
from kvpass.policies.capabilities import InPlace
from kvpass.policies.d2o import D2O, TAU, TAU_SET


class _Reference(D2O):
    """D2O whose decode-time compression is the slow path: the reference and a copy back."""

    compress_into = InPlace.compress_into


def full_layer(b: int, hkv: int, c: int, d: int, dtype: torch.dtype, device: str, seed: int = 0) -> LayerCache:
    g = torch.Generator().manual_seed(seed)
    cache = LayerCache.empty(b, hkv, c, d, dtype, device)
    cache.k.copy_(torch.randn(b, hkv, c, d, generator=g))
    cache.v.copy_(torch.randn(b, hkv, c, d, generator=g))
    cache.log_weight.zero_()
    cache.length.fill_(c)
    cache.position.copy_(torch.argsort(torch.rand(b, hkv, c, generator=g), -1))
    cache.slot_meta["col_sum"] = torch.rand(b, hkv, c, generator=g).to(device)
    cache.state[TAU] = torch.full((b,), 0.5, device=device)
    cache.state[TAU_SET] = torch.ones(b, dtype=torch.bool, device=device)
    return cache


def refill(cache: LayerCache, keep: int, step: int) -> None:
    """The slots [keep, C) as m new entries (what the decode steps between two compressions write)."""
    c = cache.capacity
    newest = cache.position.amax(-1, keepdim=True)
    cache.position[..., keep:] = newest + 1 + torch.arange(c - keep, device=cache.k.device)
    cache.log_weight[..., keep:] = 0.0
    cache.slot_meta["col_sum"][..., keep:] = 0.01 * step
    cache.length.fill_(c)


def time_path(policy: D2O, cache: LayerCache, keep: int, reps: int, warmup: int) -> list[float]:
    cuda = cache.k.is_cuda
    out = []
    for rep in range(warmup + reps):
        refill(cache, keep, rep)
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            policy.compress_into(cache, keep)
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            policy.compress_into(cache, keep)
            ms = 1e3 * (time.perf_counter() - t0)
        if rep >= warmup:
            out.append(ms)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--b", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--keep", type=int, default=6554, help="the layer's budget (0.2 of a 32k prompt)")
    ap.add_argument("--interval", type=int, default=16)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="CPU, b 2, keep 200")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    if args.smoke:
        args.b, args.keep, args.reps, args.warmup = 2, 200, 3, 1
    dtype = getattr(torch, args.dtype)
    m = args.interval
    rows = {}
    for name, capacity, interval, in_place in (("evict_many", args.keep + m, m, True),
                                              ("general", args.keep + m, m, False),
                                              ("one_in_one_out", args.keep + 1, 1, True)):
        policy = D2O(interval=interval) if in_place else _Reference(interval=interval)
        cache = full_layer(args.b, args.hkv, capacity, args.d, dtype, device)
        ms = time_path(policy, cache, args.keep, args.reps, args.warmup)
        per_call = statistics.median(ms)
        rows[name] = {"capacity": capacity, "evicted_per_call": capacity - args.keep, "ms_per_call": per_call,
                      "ms_per_token": per_call / (capacity - args.keep), "ms_all": ms}
        print(f"[d2o-evict-many] {name}: {per_call:.3f} ms/call, {per_call / (capacity - args.keep):.4f} ms/token "
              f"(one layer)", flush=True)
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "config": vars(args),
              "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"[d2o-evict-many] wrote {args.out}")


if __name__ == "__main__":
    main()
