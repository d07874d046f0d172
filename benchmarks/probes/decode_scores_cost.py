"""Where the decode attention's per-slot scores cost their time, one layer, on a GPU.

    PYTHONUNBUFFERED=1 python3 benchmarks/probes/decode_scores_cost.py --out $OUT [--batches 1,4,16,32]

Llama-3.1-8B's attention shape (Hq 32, Hkv 8, D 128, bf16), C = 6555 slots (a 0.2 budget of 32k). With the scores
(D2O, H2O, ... every step) the split kernel also stores each row's logits ([B*Hq, C] fp32) and the merge launch
gains one program per (b, g, block of ``SCORE_BLOCK`` slots) turning them into probabilities. For each batch:

* ``op_us``: the whole op from a CUDA graph (``time_fn``: do_bench median), without and with the scores, and with
  the scores under other ``SCORE_BLOCK`` values (patched on the module for the call);
* ``kernels_us``: each kernel's mean duration from the profiler over 20 graph-free calls, so the split kernel's
  store and the merge's scores programs are seen apart;
* ``bytes_floor_us``: K and V read once plus, with the scores, the logits written and read and the scores
  written, at the measured copy bandwidth.

Writes decode-scores-cost.json under --out.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
from pathlib import Path

import torch

from benchmarks.bench.kernels import decode_case
from benchmarks.bench.timing import copy_bandwidth, time_fn
from benchmarks.profile_decode import kernel_table


def kernel_times(fn, calls: int = 20) -> dict[str, float]:
    """Mean microseconds per call of each CUDA kernel ``fn`` launches (profiler, after a warm-up call; the table of
    benchmarks/profile_decode.py, slowest first)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return {row["kernel"]: row["us_per_step"] for row in kernel_table(prof, calls)["kernels"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batches", default="1,4,16,32")
    ap.add_argument("--c", type=int, default=6555)
    ap.add_argument("--score-blocks", default="128,256,512")
    a = ap.parse_args()
    da = importlib.import_module("kvpass.kernels.decode_attention")   # the package exports the op under this name
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev, 1 << 30)
    out: dict = {"gpu": torch.cuda.get_device_name(), "c": a.c, "copy_bandwidth_gbs": bw / 1e9, "rows": []}
    default_block = da.SCORE_BLOCK
    for b in (int(x) for x in a.batches.split(",")):
        q, k, v, lw = decode_case(b, 32, 8, a.c, 128, torch.bfloat16, dev, seed=b)
        lw.clamp_(min=0.0)
        attend = functools.partial(da.decode_attention_triton, q, k, v, lw, 128 ** -0.5)
        kv_bytes = 2 * k.numel() * k.element_size()
        score_bytes = 2 * q.shape[1] * b * a.c * 4 + b * 8 * a.c * 4
        row = {"b": b, "bytes_floor_us": {"plain": kv_bytes / bw * 1e6, "scores": (kv_bytes + score_bytes) / bw * 1e6},
               "op_us": {}, "kernels_us": {}}
        row["op_us"]["plain"] = time_fn(functools.partial(attend, want_scores=False), dev) * 1e6
        row["kernels_us"]["plain"] = kernel_times(functools.partial(attend, want_scores=False))
        for block in (int(x) for x in a.score_blocks.split(",")):
            da.SCORE_BLOCK = block
            try:
                row["op_us"][f"scores[block={block}]"] = time_fn(functools.partial(attend, want_scores=True), dev) * 1e6
                row["kernels_us"][f"scores[block={block}]"] = kernel_times(functools.partial(attend, want_scores=True))
            finally:
                da.SCORE_BLOCK = default_block
        print(json.dumps({"b": b, "op_us": {n: round(t, 1) for n, t in row["op_us"].items()},
                          "floor": {n: round(t, 1) for n, t in row["bytes_floor_us"].items()}}), flush=True)
        for name, ks in row["kernels_us"].items():
            print("  ", name, {kn: round(t, 1) for kn, t in ks.items()}, flush=True)
        out["rows"].append(row)
        del q, k, v, lw
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "decode-scores-cost.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
