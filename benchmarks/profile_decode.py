"""Where a kvpass decode step's time goes: per-kernel CUDA time of decode steps of the
Llama-3.1-8B-shaped random-weight model at a long prompt, per policy (torch.profiler, eager steps
so every kernel is attributed, and replayed from the CUDA graph: the kernels a replay launches and the GPU's
idle time between them).

    PYTHONUNBUFFERED=1 python3 benchmarks/profile_decode.py --out $OUT [--prompt 32768 --policies streamingllm,d2o]
                                                            [--compiled: the kvpass backend's Inductor graphs]
                                                            [--batch 32: rows prefilled one at a time]

Writes ``profile-decode.json`` and ``profile-decode.md`` (top kernels per policy) under --out.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import kvpass
from benchmarks.bench.models import LLAMA_8B, build_model
from benchmarks.bench.timing import sync
from kvpass.compile_backend import compile_graphs
from kvpass.rewrites import capture_model


def _bucket(name: str) -> str:
    """A coarse family for a kernel name (what a reader wants to sum)."""
    n = name.lower()
    for key, label in (("decode_attention", "decode attention (Triton)"), ("triton_", "Inductor-fused (Triton)"),
                       ("_candidate_kernel", "d2o eviction (Triton)"), ("_nearest_key_kernel", "d2o eviction (Triton)"),
                       ("_merge_move_kernel", "d2o eviction (Triton)"),
                       ("gemv", "matmul (GEMV/GEMM)"),
                       ("gemm", "matmul (GEMV/GEMM)"), ("cublas", "matmul (GEMV/GEMM)"), ("nvjet", "matmul (GEMV/GEMM)"),
                       ("cutlass", "matmul (GEMV/GEMM)"), ("reduce", "reductions"), ("scatter", "scatter/gather/index"),
                       ("gather", "scatter/gather/index"), ("index", "scatter/gather/index"), ("copy", "copies"),
                       ("cat", "copies"), ("elementwise", "elementwise"), ("vectorized", "elementwise")):
        if key in n:
            return label
    return "other"


def kernel_table(prof, steps: int) -> dict:
    """Per-kernel CUDA time of ``steps`` profiled steps, by family, and the GPU's idle time between kernels:
    ``busy_us_per_step`` (the union of the kernels' intervals) against ``span_us_per_step`` (first start to
    last end), and ``gap_after_us_per_step``: the idle time that follows each kernel, summed by its name
    (where a replayed graph waits between launches)."""
    events = sorted((ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda ev: ev.time_range.start)
    kernels: dict[str, list[float]] = {}
    for ev in events:
        kernels.setdefault(ev.name, []).append(ev.time_range.end - ev.time_range.start)
    rows = [{"kernel": k[:140], "us_per_step": sum(v) / steps, "calls_per_step": len(v) / steps, "family": _bucket(k)}
            for k, v in kernels.items()]
    rows.sort(key=lambda r: -r["us_per_step"])
    fam: dict[str, float] = {}
    for r in rows:
        fam[r["family"]] = fam.get(r["family"], 0.0) + r["us_per_step"]
    busy, gaps, end, last = 0.0, {}, None, None
    for ev in events:
        start, stop = ev.time_range.start, ev.time_range.end
        if end is not None and start > end and start - end < 1000:     # idle inside a step (not between steps)
            gaps[last] = gaps.get(last, 0.0) + (start - end)
        if end is None or start >= end:
            busy += stop - start
        elif stop > end:
            busy += stop - end
        if end is None or stop >= end:
            end, last = stop, ev.name[:140]
    top_gaps = sorted(gaps.items(), key=lambda kv_: -kv_[1])[:25]
    return {"kernels": rows, "kernel_us_per_step": sum(r["us_per_step"] for r in rows),
            "kernel_launches_per_step": sum(r["calls_per_step"] for r in rows),
            "families_us_per_step": dict(sorted(fam.items(), key=lambda kv_: -kv_[1])),
            "busy_us_per_step": busy / steps, "gap_us_per_step": sum(gaps.values()) / steps,
            "gap_after_us_per_step": {k: v / steps for k, v in top_gaps}}


def profile_policy(model, captured, name: str, budget: float, prompt: int, steps: int,
                   compiled: bool = False, batch: int = 1) -> dict:
    policy = kvpass.get_policy(name)
    kv = kvpass.apply(model, policy, budget if policy.compresses else 1.0, captured=captured, compile=False)
    if compiled:                                  # the "kvpass" torch.compile backend's graphs (Inductor)
        compile_graphs(kv)
    kv.prefill_rows = 1 if batch > 1 else None    # one row's full K, V at a time: the batch is bounded by the caches
    ids = torch.randint(1, model.config.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(0)).cuda()
    out: dict = {"policy": name + ("-compiled" if compiled else "")}
    for graphed in (True, False):
        kv.decode_step.enabled = graphed
        kv.decode_step.reset()
        session = kv.start(ids, max_new_tokens=8 + 2 * steps)
        tok = session.logits.argmax(-1)
        for _ in range(8):
            tok = session.step(tok).argmax(-1)
        sync(ids.device)
        t0 = time.perf_counter()
        for _ in range(steps):
            tok = session.step(tok).argmax(-1)
        sync(ids.device)
        out["graphed_ms" if graphed else "eager_ms"] = (time.perf_counter() - t0) / steps * 1e3
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                tok = session.step(tok).argmax(-1)
            sync(ids.device)
        out["graphed" if graphed else "eager"] = kernel_table(prof, steps)
        del session
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--prompt", type=int, default=32768)
    ap.add_argument("--policies", default="streamingllm,d2o")
    ap.add_argument("--budget", type=float, default=0.2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--compiled", action="store_true", help="compile the graphs with the kvpass backend first")
    ap.add_argument("--batch", type=int, default=1, help="rows (prefilled one at a time)")
    args = ap.parse_args()
    device = torch.device("cuda")
    model = build_model(LLAMA_8B, device, torch.bfloat16)
    captured = capture_model(model)
    results = {"device": torch.cuda.get_device_name(), "prompt": args.prompt, "budget": args.budget, "batch": args.batch,
               "policies": []}
    for name in args.policies.split(","):
        res = profile_policy(model, captured, name, args.budget, args.prompt, args.steps, args.compiled, args.batch)
        results["policies"].append(res)
        print(json.dumps({k: v for k, v in res.items() if k.endswith("_ms")}), flush=True)
        torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile-decode.json").write_text(json.dumps(results, indent=1))
    lines = [f"# Decode-step profile: {results['device']}, Llama-3.1-8B-shaped, prompt {args.prompt}, batch {args.batch}, "
             f"budget {args.budget}", ""]
    for res in results["policies"]:
        lines += [f"## {res['policy']}: {res['graphed_ms']:.2f} ms/step replayed, {res['eager_ms']:.2f} ms eager", ""]
        for mode in ("graphed", "eager"):
            t = res[mode]
            lines += [f"### {mode}: kernels {t['kernel_us_per_step'] / 1e3:.3f} ms in {t['kernel_launches_per_step']:.0f} "
                      f"launches; GPU busy {t['busy_us_per_step'] / 1e3:.3f} ms, idle between kernels "
                      f"{t['gap_us_per_step'] / 1e3:.3f} ms a step", "", "| family | ms/step |", "|---|---|"]
            lines += [f"| {k} | {v / 1e3:.3f} |" for k, v in t["families_us_per_step"].items()]
            lines += ["", "| kernel | us/step | calls/step |", "|---|---|---|"]
            lines += [f"| `{r['kernel'][:90]}` | {r['us_per_step']:.1f} | {r['calls_per_step']:.0f} |" for r in t["kernels"][:25]]
            lines += ["", "| idle after | us/step |", "|---|---|"]
            lines += [f"| `{k[:90]}` | {v:.1f} |" for k, v in list(t["gap_after_us_per_step"].items())[:12]]
            lines.append("")
    (out / "profile-decode.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
