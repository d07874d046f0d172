"""Where a quality-suite cell spends its time, per policy (host profile of one process, alone on the GPU).

The board's stores record seconds per case: on the H200 snapkv takes ~0.13 s a case and d2o ~3.8 s,
clusterkv ~3.0 s, ems ~1.4 s (batch 8, 14 processes sharing the GPU). This runs one small cell per
policy (single needle, one length, one budget, query-aware, ``--batches`` batches, one ``suite.run`` as
the board's processes do) under cProfile and writes, per policy: the total and each case's recorded
seconds, and the functions with the most cumulative and own time.

    python benchmarks/probes/suite_cell_profile.py --out OUT [--policies P ...] [--length 2048]
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

from kvpass.eval import suite
from kvpass.eval.common import load
from kvpass.eval.store import Store

DEFAULT = ["snapkv[kernel=31]", "d2o", "clusterkv", "ems", "h2o", "kvmerger"]


def top(profile: cProfile.Profile, key: str, n: int) -> str:
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats(key).print_stats(n)
    return text.getvalue()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--policies", nargs="+", default=DEFAULT)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--budget", type=float, default=0.2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--batches", type=int, default=2)
    p.add_argument("--top", type=int, default=35)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    loaded = load(args.model, device=device)
    items = suite.cases(loaded.tokenizer, ["single_needle"], [args.length], args.batch * args.batches)
    report = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "length": args.length,
              "budget": args.budget, "batch": args.batch, "policies": {}}
    for policy in args.policies:
        store = Store(str(out / f"store-{len(report['policies'])}.json"))
        cells = suite.cells([policy], [args.budget], ["query_aware"], reference=False)
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        suite.run(loaded, items, cells, store, batch=args.batch)     # one capture of the model, as the board
        prof.disable()
        total = time.perf_counter() - t0
        records = list(store.cases.values())
        per_case = sorted(r["seconds"] for r in records)
        correct = sum(bool(r["correct"]) for r in records)
        entry = {"total_seconds": total, "cases": len(records), "correct": correct,
                 "case_seconds_median": per_case[len(per_case) // 2] if per_case else None,
                 "case_seconds": [round(r["seconds"], 4) for r in records]}
        report["policies"][policy] = entry
        (out / f"profile-{len(report['policies']):02d}.txt").write_text(
            f"{policy}: {json.dumps(entry)}\n\n" + top(prof, "cumulative", args.top)
            + "\n\n" + top(prof, "tottime", args.top))
        print(policy, round(total, 1), "s,", entry["case_seconds_median"], "s a case (median)", flush=True)
        (out / "suite-cell-profile.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
