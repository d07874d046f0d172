"""Where chunked prefill's TTFT goes at one prompt length: ``KVPassModel.start`` with ``prefill_chunk`` timed
--repeats times in a row at the same prompt (so a one-time cost of a new shape shows as a slow first run), per
policy, the host's profile of one more run (cProfile, top functions by cumulative time) and, with
``--kernels``, the GPU's: torch.profiler's CUDA time per kernel name over one more run (top 30). ``--pad-reads``:
the same starts (chunked and whole, interleaved, after one of each) with the prefill attention reading its pad
tensor once per forward (``has_pads``, the default) and once per layer (the code before it), in one process.

    PYTHONUNBUFFERED=1 python benchmarks/probes/chunked_ttft.py --out $OUT/chunked-ttft-<gpu>.json [--prompt 32768]

Llama-3.1-8B-shaped model with random bf16 weights (benchmarks/chunked_prefill_gpu.py's builder), budget 0.2.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import kvpass  # noqa: E402
from benchmarks.bench.models import LLAMA_8B  # noqa: E402
from benchmarks.chunked_prefill_gpu import build_model  # noqa: E402


def timed_start(kv, ids, chunk):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    session = kv.start(ids, max_new_tokens=2, prefill_chunk=chunk)
    session.logits.argmax(-1).cpu()
    return time.perf_counter() - t0


def pad_reads_ab(kv, ids, chunk: int, repeats: int) -> dict:
    """Starts (chunked, whole) with the pad read once per forward and once a layer, interleaved, medians."""
    import statistics

    pa = sys.modules["kvpass.kernels.prefill_attention"]
    once = pa.has_pads
    every_layer = lambda pad: bool(pad.any())            # noqa: E731  (the code before has_pads)
    timed_start(kv, ids, chunk), timed_start(kv, ids, None)             # one-time costs of these shapes
    got: dict = {f"{how}_{mode}_s": [] for how in ("once", "every_layer") for mode in ("chunked", "whole")}
    try:
        for _ in range(repeats):
            for how, fn in (("once", once), ("every_layer", every_layer)):
                pa.has_pads = fn
                got[f"{how}_chunked_s"].append(timed_start(kv, ids, chunk))
                got[f"{how}_whole_s"].append(timed_start(kv, ids, None))
    finally:
        pa.has_pads = once
    got.update({k.replace("_s", "_median_s"): statistics.median(v) for k, v in list(got.items())})
    return got


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prompt", type=int, default=32768)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--policies", default="d2o,streamingllm")
    ap.add_argument("--kernels", action="store_true", help="also torch.profiler's CUDA time per kernel")
    ap.add_argument("--pad-reads", action="store_true", help="A/B: pad read once per forward against once a layer")
    a = ap.parse_args()
    dev = torch.device("cuda")
    model = build_model(dict(LLAMA_8B), dev, torch.bfloat16, a.prompt + 64)
    ids = torch.randint(1, model.config.vocab_size, (1, a.prompt), generator=torch.Generator().manual_seed(0)).to(dev)
    result: dict = {"gpu": torch.cuda.get_device_name(), "prompt": a.prompt, "chunk": a.chunk, "policies": {}}
    for name in a.policies.split(","):
        kv = kvpass.apply(model, name, 1.0 if name == "full" else 0.2)
        if a.pad_reads:
            result["policies"][name] = pad_reads_ab(kv, ids, a.chunk, a.repeats)
            print(name, result["policies"][name], flush=True)
            continue
        row: dict = {"chunked_s": [], "unchunked_s": []}
        for _ in range(a.repeats):
            row["chunked_s"].append(timed_start(kv, ids, a.chunk))
        for _ in range(2):
            row["unchunked_s"].append(timed_start(kv, ids, None))
        prof = cProfile.Profile()
        prof.enable()
        row["profiled_chunked_s"] = timed_start(kv, ids, a.chunk)
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(45)
        row["host_profile"] = text.getvalue().splitlines()[:80]
        if a.kernels:
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CUDA]) as gpu_prof:
                row["kernel_profiled_chunked_s"] = timed_start(kv, ids, a.chunk)
            events = sorted(gpu_prof.key_averages(), key=lambda e: -e.self_device_time_total)
            row["cuda_ms_total"] = sum(e.self_device_time_total for e in events) / 1e3
            row["kernels"] = [{"name": e.key[:120], "calls": e.count, "cuda_ms": e.self_device_time_total / 1e3}
                              for e in events[:30]]
            print(name, "CUDA ms", row["cuda_ms_total"], flush=True)
            for k in row["kernels"]:
                print(f"  {k['cuda_ms']:9.2f} ms {k['calls']:6d}  {k['name']}", flush=True)
        print(name, {k: v for k, v in row.items() if k not in ("host_profile", "kernels")}, flush=True)
        print("\n".join(row["host_profile"][:30]), flush=True)
        result["policies"][name] = row
        del kv
        torch.cuda.empty_cache()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
