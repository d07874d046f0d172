"""Launch parameters of D2O's one-in-one-out op on a GPU, one layer at Llama-3.1-8B's shapes (Hkv 8, D 128,
bf16, C = 6555 = a 0.2 budget of 32k + 1), every row evicting in every timed call.

    PYTHONUNBUFFERED=1 python3 benchmarks/probes/d2o_evict_one_sweep.py --out $OUT [--c 13108 --splits none,26,52]

Each call evicts: before it, the rows' lengths are set back to C (``fill_``), which re-arms the same work
(a scan of C scores and positions, a key scan, a merge, a move); the fill alone is timed and subtracted.
Timed from a CUDA graph by triton's do_bench (median). Writes d2o-evict-one-sweep.json under --out.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
from kvpass.kernels.d2o_evict_one import d2o_evict_one_triton

from benchmarks.bench.timing import time_fn


def layer(b: int, c: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return dict(
        k=torch.randn(b, 8, c, 128, device="cuda", generator=g).to(torch.bfloat16),
        v=torch.randn(b, 8, c, 128, device="cuda", generator=g).to(torch.bfloat16),
        col_sum=torch.rand(b, 8, c, device="cuda", generator=g),
        position=torch.arange(c, device="cuda").expand(b, 8, c).contiguous(),
        log_weight=torch.zeros(b, 8, c, device="cuda"),
        length=torch.full((b, 8), c, device="cuda"),
        tau=torch.zeros(b, device="cuda"), tau_set=torch.zeros(b, dtype=torch.bool, device="cuda"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--c", type=int, default=6555)
    ap.add_argument("--splits", default="none,13,52", help="split counts to try (none: the default heuristic)")
    a = ap.parse_args()
    rows = []
    for b in (1, 4):
        st = layer(b, a.c, b)
        keep = a.c - 1

        def call(st=st, keep=keep, **kw):
            st["length"].fill_(a.c)
            d2o_evict_one_triton(st["k"], st["v"], st["col_sum"], st["position"], st["log_weight"], st["length"],
                                 st["tau"], st["tau_set"], [], [], keep, 4, keep // 4, 0.7, "paper", **kw)

        arm = time_fn(lambda st=st: st["length"].fill_(a.c), torch.device("cuda")) * 1e6
        counts = [None if x == "none" else int(x) for x in a.splits.split(",")]
        grid = itertools.product(counts, (32, 64, 128), (256, 1024), (4, 8))
        for splits, block_c, block_scan, warps in grid:
            kw = dict(splits=splits, block_c=block_c, block_scan=block_scan, num_warps=warps)
            try:
                us = time_fn(lambda kw=kw: call(**kw), torch.device("cuda")) * 1e6 - arm
                rows.append({"b": b, **kw, "us_per_layer": us})
            except Exception as e:  # noqa: BLE001
                rows.append({"b": b, **kw, "error": repr(e)[:200]})
        best = min((r for r in rows if r["b"] == b and "us_per_layer" in r), key=lambda r: r["us_per_layer"])
        default = next(r for r in rows if r["b"] == b and r["splits"] is None and r["block_c"] == 32
                       and r["block_scan"] == 1024 and r["num_warps"] == 8)
        print(f"b={b}: fill {arm:.1f} us; default {default['us_per_layer']:.1f} us/layer; best {best}", flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "d2o-evict-one-sweep.json").write_text(json.dumps(
        {"gpu": torch.cuda.get_device_name(), "c": a.c, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
