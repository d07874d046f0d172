"""Where a policy's prefill compression (building the compressed caches from the prefill's K, V and
statistics) spends its GPU time: Llama-3.1-8B-shaped random bf16 model, one prompt.

    PYTHONUNBUFFERED=1 python3 benchmarks/probes/prefill_compress_profile.py --out $OUT --policies d2o

Per policy: ``kv.prefill`` and ``kv.start_from`` (the compression) timed (synchronised, after a warm-up
run), then ``start_from`` again profiled with torch.profiler (CUDA kernels, summed per kernel name).
With ``--cpu`` the profile also records the host's ops (a table of self CPU time per op, written
beside the JSON). Then ``start_from``'s phases (each call synchronised before and after, so the sum exceeds the whole).
(prefill-compress-profile-*-phases.json also has the prefill, median of 3, with the statistics ops on
a side stream that the current stream joined after the graph, which is gone: 1.714 s, against 1.711 s
without.) Writes prefill-compress-profile.json under --out.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

import torch

import kvpass
import kvpass.runtime.layers as layers
from benchmarks.bench.models import llama_8b_with_prompt
from benchmarks.bench.timing import sync


def phase_seconds(kv, pre, dev) -> dict[str, float]:
    """start_from with its phases wrapped in synchronised timers: {phase: seconds} (and 'whole')."""
    spent: dict[str, float] = {}

    def timed(name, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            sync(dev)
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            sync(dev)
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
            return out
        return wrapper

    patches = [(layers, "prompt_cache"), (layers, "with_capacity"), (layers, "compress_prompt"),
               (type(kv.policy), "layer_budgets"), (type(kv.policy), "prepare")]
    saved = [(obj, name, getattr(obj, name)) for obj, name in patches]
    for obj, name, fn in saved:
        setattr(obj, name, timed(name, fn))
    try:
        sync(dev)
        t0 = time.perf_counter()
        kv.start_from(pre)
        sync(dev)
        spent["whole"] = time.perf_counter() - t0
    finally:
        for obj, name, fn in saved:
            setattr(obj, name, fn)
    return spent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prompt", type=int, default=32768)
    ap.add_argument("--policies", default="d2o")
    ap.add_argument("--cpu", action="store_true", help="also profile the host (self CPU time per op)")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    model, ids = llama_8b_with_prompt(a.prompt, dev)
    out = {"gpu": torch.cuda.get_device_name(), "prompt": a.prompt, "policies": {}}
    for name in a.policies.split(","):
        kv = kvpass.apply(model, name, 0.2)
        kv.generate(ids[:, :2048], max_new_tokens=2)                       # warm: Triton compiles, cuBLAS
        pre = kv.prefill(ids, max_new_tokens=8)
        kv.start_from(pre)                                                 # warm the compression at this size
        del pre
        sync(dev)
        t0 = time.perf_counter()
        pre = kv.prefill(ids, max_new_tokens=8)
        sync(dev)
        prefill_s = time.perf_counter() - t0
        kv.start_from(pre)
        sync(dev)
        start_s = time.perf_counter() - t0 - prefill_s                    # unprofiled
        del pre
        pre = kv.prefill(ids, max_new_tokens=8)
        sync(dev)
        t0 = time.perf_counter()
        acts = [torch.profiler.ProfilerActivity.CUDA] + ([torch.profiler.ProfilerActivity.CPU] if a.cpu else [])
        with torch.profiler.profile(activities=acts) as prof:
            kv.start_from(pre)
            sync(dev)
        wall = time.perf_counter() - t0
        if a.cpu:                                                          # where the host's time goes
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
            (a.out / f"prefill-compress-profile-{name}-cpu.txt").write_text(table)
            print(table, flush=True)
        kernels: dict[str, list[float]] = {}
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                kernels.setdefault(ev.name[:140], []).append(ev.device_time)
        rows = sorted(({"kernel": k, "ms": sum(v) / 1e3, "calls": len(v)} for k, v in kernels.items()),
                      key=lambda r: -r["ms"])
        pre = kv.prefill(ids, max_new_tokens=8)
        phases = phase_seconds(kv, pre, dev)
        del pre
        print(f"{name}: start_from phases {phases}", flush=True)
        out["policies"][name] = {"prefill_s": prefill_s, "start_from_s": start_s, "wall_s_profiled": wall,
                                 "kernel_ms": sum(r["ms"] for r in rows), "start_from_phases_s": phases,
                                 "top": rows[:25]}
        print(f"{name}: prefill {prefill_s:.3f} s, start_from {start_s:.3f} s, {wall:.3f} s profiled, kernels {sum(r['ms'] for r in rows):.1f} ms", flush=True)
        for r in rows[:15]:
            print(f"  {r['ms']:8.2f} ms {r['calls']:5d}  {r['kernel']}", flush=True)
        del kv
        torch.cuda.empty_cache()
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "prefill-compress-profile.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
