"""Deferred scores' cost on a GPU: ``recent_query_column_sums`` (m kept queries' attention rows over a layer's cache,
two Triton passes) at Llama-3.1-8B's shapes (Hq 32, Hkv 8, D 128, bf16), against what it replaces, m steps of the
decode attention's per-slot scores (with minus without ``want_scores``, the same shape); its launch grid
(the log-sum-exp pass's tiles, warps and stages; then the column pass's), and its values against the reference.

    PYTHONUNBUFFERED=1 python3 benchmarks/probes/recent_query_column_sums_sweep.py --out $OUT

Writes recent-query-column-sums-sweep.json: per (B, C, m) the default's microseconds, each launch's, the per-step
scores' microseconds per step (decode attention with minus without), and the largest difference from the
float32 reference.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import itertools
import json
from pathlib import Path

import torch

from benchmarks.bench.kernels import decode_case
from benchmarks.bench.timing import time_fn
from kvpass.kernels.decode_attention import decode_attention_triton

# the modules (kvpass.kernels re-exports each op under its module's name): their launch constants are swept
column_pass = importlib.import_module("kvpass.kernels.chunk_column_sums")
recent = importlib.import_module("kvpass.kernels.recent_query_column_sums")


def _case(b: int, c: int, m: int, dev: torch.device):
    q1, k, v, lw = decode_case(b, 32, 8, c, 128, torch.bfloat16, dev, seed=c + b + m)
    lw.clamp_(min=0.0)
    position = torch.arange(c, device=dev).expand(b, 8, c).contiguous()
    ring = torch.randn(b, 32, m, 128, device=dev, dtype=torch.bfloat16)
    ring_pos = (c - 1 - torch.arange(m, device=dev)).expand(b, m).contiguous()     # the last m slots' steps
    return q1, k, v, lw, position, ring, ring_pos


def _timed(fn, dev) -> float:
    return time_fn(fn, dev) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shapes", default="32:6555,1:26215,8:6555", help="B:C pairs")
    ap.add_argument("--m", type=int, nargs="+", default=[16, 64])
    a = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")      # cpu: TRITON_INTERPRET=1, a smoke run
    out: dict = {"gpu": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "rows": []}
    lse_default, col_default = recent._LSE_CONFIG, column_pass._CACHE_COLUMN_SUM_CONFIG
    for shape, m in itertools.product(a.shapes.split(","), a.m):
        b, c = (int(x) for x in shape.split(":"))
        q1, k, v, lw, position, ring, ring_pos = _case(b, c, m, dev)
        run = functools.partial(recent.recent_query_column_sums_triton, ring, ring_pos, k, lw, position, 128 ** -0.5)
        want = recent.recent_query_column_sums_reference(ring, ring_pos, k, lw, position, 128 ** -0.5)
        got = run()
        attend = functools.partial(decode_attention_triton, q1, k, v, lw, 128 ** -0.5)
        row = {"b": b, "c": c, "m": m, "max_abs_err": float((got - want).abs().max()),
               "max_rel_err": float(((got - want).abs() / want.abs().clamp(min=1e-3)).max()),
               "default_us": _timed(run, dev),
               "decode_attention_us": _timed(functools.partial(attend, want_scores=False), dev),
               "decode_attention_scores_us": _timed(functools.partial(attend, want_scores=True), dev),
               "lse_configs": [], "column_configs": []}
        row["per_step_scores_us"] = row["decode_attention_scores_us"] - row["decode_attention_us"]
        row["deferred_us_per_step"] = row["default_us"] / m
        for bm, bn, nw, ns in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3)):
            recent._LSE_CONFIG = (bm, bn, nw, ns)
            try:
                row["lse_configs"].append({"cfg": [bm, bn, nw, ns], "us": _timed(run, dev)})
            except Exception as exc:  # noqa: BLE001  (a launch may not fit shared memory)
                row["lse_configs"].append({"cfg": [bm, bn, nw, ns], "error": repr(exc)[:120]})
        recent._LSE_CONFIG = lse_default
        block_m_default = recent._COLUMN_BLOCK_M       # the op's own query tile for the column pass
        for bm, bn, nw in itertools.product((32, 64, 128), (64, 128), (4, 8)):
            column_pass._CACHE_COLUMN_SUM_CONFIG = (bm, bn, nw, 2)
            recent._COLUMN_BLOCK_M = bm
            try:
                row["column_configs"].append({"cfg": [bm, bn, nw, 2], "us": _timed(run, dev)})
            except Exception as exc:  # noqa: BLE001
                row["column_configs"].append({"cfg": [bm, bn, nw, 2], "error": repr(exc)[:120]})
        column_pass._CACHE_COLUMN_SUM_CONFIG = col_default
        recent._COLUMN_BLOCK_M = block_m_default
        best = {key: min((r for r in row[key] if "us" in r), key=lambda r: r["us"]) for key in ("lse_configs",
                                                                                                 "column_configs")}
        print(f"b={b} c={c} m={m}: deferred {row['default_us']:.0f} us ({row['deferred_us_per_step']:.1f} a step) vs "
              f"per-step scores {row['per_step_scores_us']:.1f} us a step; err {row['max_abs_err']:.2e}; best {best}",
              flush=True)
        out["rows"].append(row)
        del q1, k, v, lw, position, ring, ring_pos, want, got
        torch.cuda.empty_cache()
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "recent-query-column-sums-sweep.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
