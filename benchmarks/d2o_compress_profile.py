"""CPU cost of one D2O decode-time compression (one-in-one-out) at a realistic shape.

    .venv/bin/python benchmarks/d2o_compress_profile.py --b 1 --hkv 8 --c 3300 --d 128 --dtype bfloat16

Times ``D2O.compress(cache, C - 1)`` (median of --reps) and counts the aten ops it runs with
torch.profiler (each is one kernel launch on a GPU), plus the prefill-style call (C -> 0.2 C)."""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from kvpass.cache import LayerCache
from kvpass.policies.d2o import D2O


def make_cache(b: int, hkv: int, c: int, d: int, dtype: torch.dtype, seed: int = 0) -> LayerCache:
    g = torch.Generator().manual_seed(seed)
    cache = LayerCache.empty(b, hkv, c, d, dtype, "cpu")
    cache.k.copy_(torch.randn(b, hkv, c, d, generator=g))
    cache.v.copy_(torch.randn(b, hkv, c, d, generator=g))
    cache.log_weight.zero_()
    cache.length.fill_(c)
    cache.position.copy_(torch.arange(c).expand(b, hkv, c))
    cache.slot_meta["col_sum"] = torch.rand(b, hkv, c, generator=g)
    cache.state["d2o_tau"] = torch.full((b,), 0.1)
    cache.state["d2o_tau_set"] = torch.ones(b, dtype=torch.bool)
    return cache


def bench(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


_VIEWS = {f"aten::{n}" for n in ("unsqueeze", "expand", "reshape", "view", "select", "slice", "as_strided", "transpose",
                                  "t", "alias", "detach", "squeeze", "flatten", "unflatten", "permute", "expand_as",
                                  "lift_fresh", "item", "_local_scalar_dense", "result_type")}


def count_ops(fn) -> tuple[int, list[tuple[str, int]]]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    def top(e) -> bool:
        return e.name.startswith("aten::") and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))

    events = [e for e in prof.events() if top(e) and e.name not in _VIEWS]
    names: dict[str, int] = {}
    for e in events:
        names[e.name] = names.get(e.name, 0) + 1
    return len(events), sorted(names.items(), key=lambda x: -x[1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--b", type=int, default=1)
    p.add_argument("--hkv", type=int, default=8)
    p.add_argument("--c", type=int, default=3300)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    cache = make_cache(args.b, args.hkv, args.c, args.d, dtype)
    for variant in ("paper", "code"):
        pol = D2O(d2o_variant=variant)
        step = bench(lambda pol=pol: pol.compress(cache, args.c - 1), args.reps)
        n_ops, top = count_ops(lambda pol=pol: pol.compress(cache, args.c - 1))
        print(f"{variant}: one-in-one-out compress C={args.c}->{args.c - 1}: {step * 1e3:.2f} ms, "
              f"{n_ops} non-view aten ops (~kernel launches); top: {top[:8]}")
    pol = D2O()
    keep = args.c // 5
    pre = bench(lambda: pol.compress(cache, keep), max(3, args.reps // 5))
    n_ops, _ = count_ops(lambda: pol.compress(cache, keep))
    print(f"prefill-style compress C={args.c}->{keep}: {pre * 1e3:.2f} ms, {n_ops} non-view aten ops")


if __name__ == "__main__":
    main()
