"""What one CUDA-graph capture of the decode step costs, by part: the warm-up run (the step itself, eager) and the
recording, each synchronised, at calls of new prompt lengths (new buffers and budgets) and a repeated one, and
where the host's time goes in one capture at a new length (cProfile, top functions by cumulative time).

    PYTHONPATH=$PWD PYTHONUNBUFFERED=1 python3 benchmarks/probes/capture_cost.py --out $OUT/capture-cost.json

Llama-3.1-8B-shaped random bf16 model, batch 1, plain ``kvpass.apply`` (compiled decode on CUDA).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
from pathlib import Path

import torch

import kvpass
import kvpass.decode_step as ds
from benchmarks.bench.models import LLAMA_8B
from benchmarks.bench.timing import gpu_name
from benchmarks.chunked_prefill_gpu import build_model
from benchmarks.compiled_default_gpu import random_ids


def timed_parts(parts: list) -> list:
    """Wrap StaticDecodeStep._warm_up and _record with synchronised timers appending (name, seconds)."""
    saved = []
    for name in ("_warm_up", "_record"):
        fn = getattr(ds.StaticDecodeStep, name)
        saved.append((name, fn))

        def wrapper(self, *a, _fn=fn, _name=name, **k):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = _fn(self, *a, **k)
            torch.cuda.synchronize()
            parts.append((_name, time.perf_counter() - t0))
            return out
        setattr(ds.StaticDecodeStep, name, wrapper)
    return saved


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--policy", default="snapkv[kernel=31]")
    ap.add_argument("--prompts", default="32768,32768,30000,28000,28000")
    ap.add_argument("--new", type=int, default=40)
    args = ap.parse_args()
    dev = torch.device("cuda")
    model = build_model({**LLAMA_8B, "num_hidden_layers": 32}, dev, torch.bfloat16, 33000)
    kv = kvpass.apply(model, args.policy, 0.2)
    ids = random_ids(model.config.vocab_size, 32768, 0, dev)
    kv.generate(ids, max_new_tokens=args.new, do_sample=False, eos_token_id=[])         # compile, Triton
    out = {"device": gpu_name(dev), "policy": args.policy, "calls": []}
    parts: list = []
    saved = timed_parts(parts)
    for i, n in enumerate(int(x) for x in args.prompts.split(",")):
        parts.clear()
        prof = cProfile.Profile() if i == 2 else None
        if prof:
            prof.enable()
        t0 = time.perf_counter()
        kv.generate(ids[:, :n], max_new_tokens=args.new, do_sample=False, eos_token_id=[])
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        if prof:
            prof.disable()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(45)
            out["profile_new_length"] = buf.getvalue()[-12000:]
        rep = kv.last_report
        row = {"prompt": n, "wall_s": wall, "prefill_s": rep.prefill_seconds, "captures": rep.graph_captures,
               "capture_s": rep.capture_seconds, "reused": rep.reused_buffers,
               "parts": [(name, round(s * 1e3, 2)) for name, s in parts]}
        out["calls"].append(row)
        print(f"[capture-cost] {row}", flush=True)
    for name, fn in saved:
        setattr(ds.StaticDecodeStep, name, fn)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(out.get("profile_new_length", "")[:6000], flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
