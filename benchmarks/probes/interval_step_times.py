"""Every decode step of the compiled default path timed on its own with CUDA events (no synchronisation between
steps), so a policy with ``interval`` m > 1 reads as its plain steps and its compressing steps apart: what the
m - 1 plain steps cost against ``streamingllm``'s, and what one compressing step costs on top.

    PYTHONPATH=$PWD PYTHONUNBUFFERED=1 python3 benchmarks/probes/interval_step_times.py \\
        --out $OUT/interval-step-times.json --policies "streamingllm,d2o,d2o[interval=64]" [--profile]

Llama-3.1-8B-shaped random bf16 model, batch 1, 32k prompt, budget 0.2, plain ``kvpass.apply`` (compiled decode
on CUDA). A step is "compressing" where the decode session's compression count grew during it (read after the timed
steps from a per-step record of ``DecodeSession.report().compressions``, which synchronises: so the count is
taken in a second, untimed pass of the same length).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import kvpass
from benchmarks.bench.models import LLAMA_8B, weight_bytes_per_step
from benchmarks.bench.timing import copy_bandwidth, gpu_name
from benchmarks.chunked_prefill_gpu import build_model
from benchmarks.compiled_default_gpu import random_ids, split_specs
from kvpass.rewrites import capture_model


def step_times(kv, ids: torch.Tensor, warmup: int, steps: int) -> dict:
    """``steps`` event-timed decode steps after ``warmup``; then the same steps again untimed, reading the
    compression count after each (the steps where it grew are the compressing ones)."""
    def run(count_compressions: bool) -> tuple:
        session = kv.start(ids, max_new_tokens=warmup + steps + 1)
        tok = session.logits.argmax(-1)
        for _ in range(warmup):
            tok = session.step(tok).argmax(-1)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
        counts = [session.report().compressions] if count_compressions else []
        events[0].record()
        for i in range(steps):
            tok = session.step(tok).argmax(-1)
            events[i + 1].record()
            if count_compressions:
                counts.append(session.report().compressions)
        torch.cuda.synchronize()
        times = [events[i].elapsed_time(events[i + 1]) for i in range(steps)]
        return (times, counts, session.report().cache_bytes) if count_compressions else (times, counts)

    ms, _ = run(False)
    _, counts, cache_bytes = run(True)
    compressing = [i for i in range(steps) if counts[i + 1] > counts[i]]
    plain = [t for i, t in enumerate(ms) if i not in compressing]
    comp = [ms[i] for i in compressing]
    return {"ms": [round(t, 4) for t in ms], "compressing_steps": compressing, "cache_bytes": cache_bytes,
            "median_ms": statistics.median(ms), "mean_ms": statistics.fmean(ms),
            "plain_median_ms": statistics.median(plain) if plain else None,
            "plain_mean_ms": statistics.fmean(plain) if plain else None,
            "compressing_mean_ms": statistics.fmean(comp) if comp else None,
            "compressing_extra_ms": (statistics.fmean(comp) - statistics.median(plain)) if comp and plain else None}


def profile_steps(kv, ids: torch.Tensor, marks: dict[int, str]) -> dict[str, dict]:
    """The kernels of the steps at the indices in ``marks`` (counted from the first step after prefill), each
    replayed alone under torch.profiler (``profile_decode.kernel_table``: per-kernel time, launches, busy and
    idle time of the step), by the name ``marks`` gives it."""
    from benchmarks.profile_decode import kernel_table

    session = kv.start(ids, max_new_tokens=max(marks) + 2)
    tok = session.logits.argmax(-1)
    tables = {}
    for i in range(max(marks) + 1):
        if i not in marks:
            tok = session.step(tok).argmax(-1)
            continue
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            tok = session.step(tok).argmax(-1)
            torch.cuda.synchronize()
        tables[marks[i]] = kernel_table(prof, 1)
    return tables


def added_kernels(table: dict, base: dict, top: int = 40) -> list[dict]:
    """The kernels ``table``'s step runs beyond ``base``'s, by name: extra microseconds and launches."""
    before = {r["kernel"]: r for r in base["kernels"]}
    added = [{"kernel": r["kernel"], "us": r["us_per_step"] - before.get(r["kernel"], {}).get("us_per_step", 0.0),
              "launches": r["calls_per_step"] - before.get(r["kernel"], {}).get("calls_per_step", 0)}
             for r in table["kernels"]]
    added.sort(key=lambda r: -r["us"])
    return added[:top]


def summary(table: dict, top: int = 30) -> dict:
    """``kernel_table``'s totals and its ``top`` kernels by time."""
    return {**{k: v for k, v in table.items() if k != "kernels"}, "top_kernels": table["kernels"][:top]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--policies", default="streamingllm,d2o,d2o[interval=64]")
    ap.add_argument("--prompt", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--budget", type=float, default=0.2)
    ap.add_argument("--warmup", type=int, default=24)
    ap.add_argument("--steps", type=int, default=160)
    ap.add_argument("--profile", action="store_true",
                    help="also profile the first compressing step against the plain step before it (interval > 1), "
                         "or one step against the first policy's plain step (interval 1)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    t0 = time.monotonic()
    model = build_model({**LLAMA_8B, "num_hidden_layers": args.layers}, dev, torch.bfloat16,
                        args.prompt + 2 * (args.warmup + args.steps) + 256)
    weights = weight_bytes_per_step(model)
    bandwidth = copy_bandwidth(dev, 1 << 30)
    captured = capture_model(model)
    ids = random_ids(model.config.vocab_size, args.prompt, 0, dev)
    out: dict = {"gpu": gpu_name(dev), "torch": torch.__version__, "prompt": args.prompt, "layers": args.layers,
                 "budget": args.budget, "steps": args.steps, "weight_bytes": weights,
                 "copy_bandwidth_GBps": bandwidth / 1e9, "policies": {}}
    baseline: dict = {}                      # the first policy's profiled plain step, which interval-1 steps are set against
    for spec in split_specs(args.policies):
        kv = kvpass.apply(model, spec, args.budget, captured=captured)
        warmup = max(args.warmup, getattr(kv.policy, "interval", 1) + 4)
        row = step_times(kv, ids, warmup, args.steps)
        row["floor_ms"] = (weights + row["cache_bytes"]) / bandwidth * 1e3     # compiled_default_gpu's floor
        row["mean_over_floor"] = row["mean_ms"] / row["floor_ms"]
        if args.profile and getattr(kv.policy, "interval", 1) > 1 and row["compressing_steps"]:
            at = warmup + row["compressing_steps"][0]      # the first compressing step against the plain one before
            tables = profile_steps(kv, ids, {at - 1: "plain", at: "compressing"})
            row["profile"] = {"plain": summary(tables["plain"]), "compressing": summary(tables["compressing"]),
                              "added_kernels": added_kernels(tables["compressing"], tables["plain"])}
            baseline.setdefault("plain", tables["plain"])
        elif args.profile:                                 # every step alike: one step against the first policy's
            table = profile_steps(kv, ids, {warmup: "step"})["step"]
            first = baseline.setdefault("plain", table)
            row["profile"] = {"step": summary(table), "added_kernels": added_kernels(table, first)}
        out["policies"][spec] = row
        print(f"{spec}: {row['mean_over_floor']:.4f}x floor, median {row['median_ms']:.3f} mean {row['mean_ms']:.3f} plain median "
              f"{row['plain_median_ms']} compressing steps {len(row['compressing_steps'])} mean "
              f"{row['compressing_mean_ms']} ms", flush=True)
        kv = None
        torch.cuda.empty_cache()
        Path(args.out).write_text(json.dumps(out, indent=1))
    out["wall_s"] = time.monotonic() - t0
    Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
