"""The decode attention's launch with and without the per-slot scores (D2O, H2O, ... ask for them every step),
over batch and cache size at Llama-3.1-8B's shapes (Hq 32, Hkv 8, D 128, bf16): block_n x warps x stages, and
the default's time, so a heuristic for ``want_scores`` can be read off. Graph replays timed by do_bench.

    PYTHONUNBUFFERED=1 python3 benchmarks/probes/decode_scores_sweep.py --out $OUT

H200, B 32, C 6555 (d2o_batch_step_sweep.py): 213 us without scores, 315 with (default launch), 257 at the best
launch. Writes decode-scores-sweep.json.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
from pathlib import Path

import torch

from benchmarks.bench.kernels import decode_case
from benchmarks.bench.timing import time_fn
from kvpass.kernels.decode_attention import decode_attention_triton


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--b", type=int, nargs="+", default=[1, 4, 16, 32, 64])
    ap.add_argument("--c", type=int, nargs="+", default=[6555, 26215])
    a = ap.parse_args()
    dev = torch.device("cuda")
    out: dict = {"gpu": torch.cuda.get_device_name(), "rows": []}
    for b, c in itertools.product(a.b, a.c):
        if b * c > 64 * 6555 * 2:
            continue
        q, k, v, lw = decode_case(b, 32, 8, c, 128, torch.bfloat16, dev, seed=c + b)
        lw.clamp_(min=0.0)
        attend = functools.partial(decode_attention_triton, q, k, v, lw, 128 ** -0.5)
        for scores in (False, True):
            row = {"b": b, "c": c, "want_scores": scores,
                   "default_us": time_fn(functools.partial(attend, want_scores=scores), dev) * 1e6, "configs": []}
            for bn, nw, ns in itertools.product((32, 64, 128), (4, 8), (2, 3, 4)):
                cfg = dict(block_n=bn, num_warps=nw, num_stages=ns)
                try:
                    row["configs"].append({**cfg, "us": time_fn(functools.partial(attend, want_scores=scores, **cfg),
                                                                dev) * 1e6})
                except Exception as exc:  # noqa: BLE001  (a config may not fit shared memory)
                    row["configs"].append({**cfg, "error": repr(exc)[:120]})
            best = min((r for r in row["configs"] if "us" in r), key=lambda r: r["us"])
            print(f"b={b} c={c} scores={scores}: default {row['default_us']:.1f} us, best {best}", flush=True)
            out["rows"].append(row)
        del q, k, v, lw
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "decode-scores-sweep.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
