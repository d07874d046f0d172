"""Chelsea's decode-time compression of one layer on a GPU, at Llama-3.1-8B's shapes (Hkv 8, D 128, bf16):
a full buffer of keep + interval entries brought back to keep by one CSM step (``Chelsea.compress_into``),
keep = a 0.2 budget of a 32k and of a 64k prompt.

    PYTHONUNBUFFERED=1 python3 benchmarks/probes/chelsea_step_profile.py --out $OUT

Each timed call first restores the full buffer from a saved copy (the restore alone is timed and
subtracted), so every call does the same step. Timed from a CUDA graph by triton's do_bench (median);
then one eager call under torch.profiler gives the kernels' times. Writes chelsea-step-profile.json.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.bench.timing import gpu_name, time_fn
from kvpass.cache import LayerCache
from kvpass.policies.chelsea import STEP, Chelsea


def full_layer(capacity: int, seed: int) -> LayerCache:
    """A full buffer: keys a slow random walk along the sequence (neighbours alike, as real keys are), so
    the matching finds edges of varying quality; degrees 1; the schedule past its warm-up (step 4)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    walk = torch.randn(1, 8, capacity, 128, device="cuda", generator=g).mul(0.3).cumsum(2)
    k = (walk + torch.randn(1, 8, capacity, 128, device="cuda", generator=g)).to(torch.bfloat16)
    v = torch.randn(1, 8, capacity, 128, device="cuda", generator=g).to(torch.bfloat16)
    cache = LayerCache(k=k, v=v, log_weight=torch.zeros(1, 8, capacity, device="cuda"),
                       length=torch.full((1, 8), capacity, device="cuda"),
                       position=torch.arange(capacity, device="cuda").expand(1, 8, capacity).contiguous())
    cache.state[STEP] = torch.full((1, 8), 4, device="cuda")
    return cache


def kernel_times(fn, reps: int = 5) -> list[dict]:
    """Per kernel name: CUDA microseconds per call of ``fn`` (torch.profiler, ``reps`` eager calls)."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type.name == "CUDA":
            by_name[e.name][0] += e.device_time / reps
            by_name[e.name][1] += 1 / reps
    rows = [{"kernel": n[:90], "us": round(t, 2), "calls": round(c, 2)} for n, (t, c) in by_name.items()]
    return sorted(rows, key=lambda r: -r["us"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prompts", default="32768,65536")
    a = ap.parse_args()
    dev = torch.device("cuda")
    pol = Chelsea()
    rows = []
    for prompt in (int(x) for x in a.prompts.split(",")):
        keep = int(0.2 * prompt)
        cache = full_layer(keep + pol.interval, prompt)
        saved = [t.clone() for t in cache.tensors()]

        def restore(cache=cache, saved=saved) -> None:
            for t, s in zip(cache.tensors(), saved, strict=True):
                t.copy_(s)

        def call(cache=cache, keep=keep, restore=restore) -> None:
            restore()
            pol.compress_into(cache, keep)

        call()
        assert int(cache.length.max()) <= keep, "one CSM step did not reach the budget"
        restore_us = time_fn(restore, dev) * 1e6
        us = time_fn(call, dev) * 1e6 - restore_us
        kernels = kernel_times(call)
        row = {"prompt": prompt, "keep": keep, "capacity": keep + pol.interval, "us_per_layer": us,
               "us_per_step_32_layers_amortised": 32 * us / pol.interval, "restore_us": restore_us,
               "kernels_eager_incl_restore": kernels}
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "kernels_eager_incl_restore"}), flush=True)
        for r in kernels[:12]:
            print("   ", r, flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    out = {"gpu": gpu_name(dev), "torch": torch.__version__, "rows": rows}
    (a.out / "chelsea-step-profile.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
