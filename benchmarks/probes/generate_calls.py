"""Why a ``generate`` call costs more than its TTFT plus its tokens: each call of ``kv.generate`` timed
(synchronised) at one prompt, for a few ``max_new_tokens`` in turn (a length seen before and one not),
with the Triton kernels each call compiled (new entries in Triton's disk cache), and a call at a new
length profiled by cProfile (top functions by cumulative time).

    PYTHONUNBUFFERED=1 python3 benchmarks/probes/generate_calls.py --out $OUT --policies full,d2o

Llama-3.1-8B-shaped random bf16 model, batch 1. Writes generate-calls.json under --out.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import time
from pathlib import Path

import torch

import kvpass
from benchmarks.bench.models import llama_8b_with_prompt
from benchmarks.bench.timing import sync


def triton_cache_entries() -> int:
    """Kernels in Triton's on-disk cache (one directory each): new ones between two calls were compiled."""
    root = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))
    return sum(1 for _ in root.iterdir()) if root.is_dir() else 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prompt", type=int, default=32768)
    ap.add_argument("--policies", default="full,d2o")
    ap.add_argument("--news", default="1,4,4,52,52,5")
    a = ap.parse_args()
    dev = torch.device("cuda")
    model, ids = llama_8b_with_prompt(a.prompt, dev)
    out = {"gpu": torch.cuda.get_device_name(), "prompt": a.prompt, "policies": {}}
    for name in a.policies.split(","):
        kv = kvpass.apply(model, name, 0.2)
        kv.generate(ids[:, :2048], max_new_tokens=4)                       # Triton compiles, cuBLAS handles
        calls = []
        for n in (int(x) for x in a.news.split(",")):
            sync(dev)
            cached = triton_cache_entries()
            t0 = time.perf_counter()
            kv.generate(ids, max_new_tokens=n, do_sample=False)
            sync(dev)
            calls.append({"max_new_tokens": n, "s": time.perf_counter() - t0,
                          "captures": kv.decode_step.captures, "triton_compiled": triton_cache_entries() - cached})
            print(name, calls[-1], flush=True)
        prof = cProfile.Profile()
        n = 7                                                             # a length not seen yet
        sync(dev)
        t0 = time.perf_counter()
        prof.enable()
        kv.generate(ids, max_new_tokens=n, do_sample=False)
        sync(dev)
        prof.disable()
        profiled = time.perf_counter() - t0
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(45)
        out["policies"][name] = {"calls": calls, "profiled_new_length_s": profiled, "cprofile": text.getvalue()[-12000:]}
        print(text.getvalue()[-6000:], flush=True)
        del kv
        torch.cuda.empty_cache()
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "generate-calls.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
