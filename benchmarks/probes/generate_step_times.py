"""Where a ``generate`` call's decode time goes: every decode step of a few ``kv.generate`` calls at one prompt
timed on its own (synchronised before and after), with the CUDA-graph captures and Inductor compilations each
step triggered, so the replayed steps, the steps that capture, and the first call's one-time costs read apart.

    PYTHONPATH=$PWD PYTHONUNBUFFERED=1 python3 benchmarks/probes/generate_step_times.py \\
        --out $OUT/generate-step-times.json --policies "snapkv[kernel=31],d2o"

Llama-3.1-8B-shaped random bf16 model (``benchmarks.chunked_prefill_gpu.build_model``), batch 1, greedy, plain
``kvpass.apply`` (compiled decode on CUDA). Per policy: ``--calls`` calls of ``--new`` tokens, then one of
``--new2`` (another budget: a new capacity). The synchronisation adds a few microseconds a step; compare steps
with each other, not with the event-timed ``compiled_default_gpu`` rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import kvpass
from benchmarks.bench.models import LLAMA_8B
from benchmarks.bench.timing import gpu_name
from benchmarks.chunked_prefill_gpu import build_model
from benchmarks.compiled_default_gpu import random_ids, split_specs
from kvpass.runtime.session import DecodeSession


class StepTimer:
    """Wraps ``DecodeSession.step``: wall seconds of each step (synchronised) and the captures it made."""

    def __init__(self, kv) -> None:
        self.kv, self.rows = kv, []
        self._step = DecodeSession.step

    def __enter__(self):
        timer = self

        def step(session, tokens):
            torch.cuda.synchronize()
            captures, t0 = timer.kv.decode_step.captures, time.perf_counter()
            out = timer._step(session, tokens)
            torch.cuda.synchronize()
            timer.rows.append((time.perf_counter() - t0, timer.kv.decode_step.captures - captures))
            return out

        DecodeSession.step = step
        return self

    def __exit__(self, *exc):
        DecodeSession.step = self._step
        return False


def one_call(kv, ids, new: int) -> dict:
    with StepTimer(kv) as timer:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        kv.generate(ids, max_new_tokens=new, do_sample=False, eos_token_id=[])
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    rep = kv.last_report
    ms = [s * 1e3 for s, _ in timer.rows]
    plain = [m for m, (_, c) in zip(ms, timer.rows, strict=True) if c == 0]
    return {"new": new, "wall_s": wall, "prefill_s": rep.prefill_seconds, "decode_s": rep.decode_seconds,
            "steps": len(ms), "captures": sum(c for _, c in timer.rows), "compilations": rep.compilations,
            "step_median_ms": statistics.median(plain) if plain else None,
            "step_ms_sum": sum(ms), "capture_steps_ms": [round(m, 2) for m, (_, c) in zip(ms, timer.rows, strict=True) if c],
            "slowest_plain_ms": sorted(round(m, 2) for m in plain)[-5:],
            "budget": rep.budget_tokens, "report_captures": rep.graph_captures,
            "report_capture_s": rep.capture_seconds, "reused_buffers": rep.reused_buffers}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--policies", default="snapkv[kernel=31],d2o")
    ap.add_argument("--prompt", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--new", type=int, default=130)
    ap.add_argument("--new2", type=int, default=66)
    args = ap.parse_args()
    dev = torch.device("cuda")
    model = build_model({**LLAMA_8B, "num_hidden_layers": args.layers}, dev, torch.bfloat16, args.prompt + 512)
    ids = random_ids(model.config.vocab_size, args.prompt, 0, dev)
    out = {"device": gpu_name(dev), "prompt": args.prompt, "layers": args.layers, "torch": torch.__version__,
           "policies": {}}
    for spec in split_specs(args.policies):
        kv = kvpass.apply(model, spec, 0.2)
        calls = [one_call(kv, ids, args.new) for _ in range(args.calls)] + [one_call(kv, ids, args.new2)]
        out["policies"][spec] = calls
        print(f"[generate-step-times] {spec}: {json.dumps(calls)}", flush=True)
        kv = None
        torch.cuda.empty_cache()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
