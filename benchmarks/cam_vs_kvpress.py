"""Why kvpress's CAMPress answers cases kvpass's cam does not (issue 26; docs/quality.md, "kvpass against
kvpress on the very same cases").

The leaderboard (budget 0.2, query-aware, SmolLM2) pairs kvpass ``cam`` with kvpress
``CAMPress(StreamingLLMPress)`` (``benchmarks/suite_paired.py``): 13.5% against 20.8% on 96 common cases,
8 answered only by kvpress. This script rebuilds cases from their keys with the suite's generators
(``kvpass.eval.tasks.generate``): every common case where the two disagree, plus the first ``--extra``
common cases (key order) of lengths <= ``--max-length`` where they agree, and scores one variant per
difference between the two implementations (``VARIANTS``) with ``kvpass.eval.suite.run`` (query-aware,
greedy, the suite's answer length), so each record is a leaderboard record.

``cam_nomerge`` (registered by this script only) is CaM with its merge switched off: StreamingLLM's
eviction under CaM's options, so ``cam_nomerge[first_compression=decode]`` is StreamingLLM with kvpress
CAMPress's timing (the prompt compressed after the first decode step, which attends the whole prompt).

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/cam_vs_kvpress.py --store /tmp/cam-vs-kvpress-cases.json \\
        --json benchmarks/results/cam-vs-kvpress-cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.suite_readme_table import calibrated_cases
from kvpass.cache import LayerCache, keep_slots
from kvpass.eval import suite
from kvpass.eval.common import load, set_threads
from kvpass.eval.store import Store
from kvpass.eval.tasks import generate
from kvpass.policies import POLICIES
from kvpass.policies.cam import CaM

PEER = "kvpress:CAMPress(StreamingLLMPress)"
VARIANTS = {
    "cam (kvpass default)": "cam",
    "cam, kvpress timing": "cam[first_compression=decode]",
    "cam, kvpress merge window 32": "cam[merge_window=32]",
    "cam, timing + window 32": "cam[first_compression=decode,merge_window=32]",
    "no merge (= streamingllm)": "cam_nomerge",
    "no merge, kvpress timing": "cam_nomerge[first_compression=decode]",
    "streamingllm": "streamingllm",
}


@dataclass(frozen=True)
class CaMNoMerge(CaM):
    """CaM without its merge (this script only): the sinks + newest entries, values unchanged."""

    name: ClassVar[str] = "cam_nomerge"

    def compress(self, cache: LayerCache, keep: int) -> LayerCache:
        sinks = min(self.sinks, keep - 1)
        length = cache.length
        j = torch.arange(min(keep, cache.capacity), device=length.device)
        idx = torch.where((j < sinks) | (length[..., None] <= keep), j, length[..., None] - keep + j)
        return keep_slots(cache, idx)


POLICIES.setdefault(CaMNoMerge.name, CaMNoMerge)


def chosen_keys(cases: list[dict], budget: float, extra: int, max_length: int) -> tuple[list, list]:
    """(cases where kvpass cam and kvpress CAMPress disagree, ``extra`` agreeing ones) as (family, length, seed);
    ``cases``: the stored ones (``calibrated_cases``)."""
    got: dict[str, dict] = {"cam": {}, PEER: {}}
    for c in cases:
        if c["budget"] == budget and c["mode"] == "query_aware" and c["policy"] in got:
            got[c["policy"]][(c["family"], c["length"], c["seed"])] = bool(c["correct"])
    common = sorted(set(got["cam"]) & set(got[PEER]))
    differ = [k for k in common if got["cam"][k] != got[PEER][k]]
    agree = [k for k in common if got["cam"][k] == got[PEER][k] and k[1] <= max_length][:extra]
    return differ, agree


def stored_outputs(cases: list[dict], budget: float, policy: str) -> dict:
    return {(c["family"], c["length"], c["seed"]): c for c in cases
            if c["policy"] == policy and c["budget"] == budget and c["mode"] == "query_aware"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--budget", type=float, default=0.2)
    p.add_argument("--extra", type=int, default=20, help="agreeing common cases added to the disagreeing ones")
    p.add_argument("--max-length", type=int, default=2048, help="longest context of the agreeing cases added")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS))
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--store", required=True)
    p.add_argument("--json")
    p.add_argument("--report-only", action="store_true")
    args = p.parse_args()
    set_threads(1)
    stored = calibrated_cases(args.model)                 # both stores, read once
    differ, agree = chosen_keys(stored, args.budget, args.extra, args.max_length)
    loaded = load(args.model, args.device)
    items = [generate(loaded.tokenizer, f, n, s) for f, n, s in differ + agree]
    specs = [VARIANTS[v] for v in args.variants]
    store = Store(args.store)
    t0 = time.monotonic()
    if not args.report_only:
        suite.run(loaded, items, suite.cells(specs, [args.budget], ["query_aware"], reference=False), store,
                  batch=args.batch, desc="cam-vs-kvpress")
    seconds = time.monotonic() - t0
    mine = {}
    for r in store.cases.values():
        if r.get("kind") == suite.KIND and r["mode"] == "query_aware" and r["budget"] == args.budget:
            mine.setdefault(r["policy"], {})[(r["family"], r["length"], r["seed"])] = r
    leaderboard = {name: stored_outputs(stored, args.budget, name)
                   for name in ("cam", PEER, "streamingllm", "kvpress:StreamingLLMPress")}
    rows = []
    for label, name, got in ([(v, VARIANTS[v], mine.get(VARIANTS[v], {})) for v in args.variants] +
                             [(f"leaderboard {n}", n, leaderboard[n]) for n in leaderboard]):
        d = [got[k] for k in differ if k in got]
        a = [got[k] for k in agree if k in got]
        peer = leaderboard[PEER]
        same = sum(got[k]["output"] == peer[k]["output"] for k in differ + agree if k in got and k in peer)
        rows.append({"variant": label, "spec": name, "disagreeing": [sum(r["correct"] for r in d), len(d)],
                     "agreeing": [sum(r["correct"] for r in a), len(a)],
                     "same_output_as_kvpress_campress": [same, len(d) + len(a)],
                     "outputs_on_disagreeing": {f"{k[1]}/{k[2]}": got[k]["output"][:60] for k in differ if k in got}})
        print(f"{label:34s} disagreeing {rows[-1]['disagreeing']}  agreeing {rows[-1]['agreeing']}  "
              f"same output as CAMPress {same}/{len(d) + len(a)}")
    if args.json:
        out = {"command": "python benchmarks/cam_vs_kvpress.py " + " ".join(sys.argv[1:]), "model": args.model,
               "device": args.device, "host": platform.machine(), "torch": torch.__version__,
               "date": time.strftime("%Y-%m-%d"), "budget": args.budget, "mode": "query_aware",
               "disagreeing_cases": [list(k) for k in differ], "agreeing_cases": [list(k) for k in agree],
               "run_seconds": round(seconds, 1), "results": rows,
               "note": "leaderboard rows: the stored H200 records (kvpass) and kvpress 0.5.5 peers on the same cases; "
                       "the variant rows ran on this device"}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
