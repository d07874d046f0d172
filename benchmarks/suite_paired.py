"""kvpass against kvpress on the very same cases (paired): for each method both implement, the accuracy of
each on the cases both ran, and how many cases only one of them answers.

    python3 benchmarks/suite_paired.py [MODEL] [BUDGET | all]

Reads benchmarks/results/quality-suite-MODEL-cases.json.gz and -peers.json.gz (calibrated cells only). The
kvpress rows cover a subset of the 300 cases (the first shards in run order), so their unpaired rates are
over other cases than kvpass's; this table compares like with like.
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.suite_readme_table import calibrated_cases  # noqa: E402

PAIRS = (("snapkv[kernel=31]", "KVzipPress"), ("snapkv[kernel=31]", "SnapKVPress"), ("snapkv", "SnapKVPress"),
         ("pyramidkv", "PyramidKVPress"), ("adakv", "AdaKVPress(SnapKVPress)"), ("tova", "TOVAPress"),
         ("streamingllm", "StreamingLLMPress"), ("cam", "CAMPress(StreamingLLMPress)"), ("knorm", "KnormPress"),
         ("knorm[recent=0]", "KnormPress"),
         ("h2o", "ObservedAttentionPress"), ("d2o[scores=window,window_kernel=31]", "MergingPress(SnapKVPress)"))


def paired(got: dict[tuple, dict], ours: str, theirs: str, budget: float, mode: str) -> dict | None:
    """kvpass's ``ours`` against kvpress's ``theirs`` on the cases both ran at (budget, mode): the count,
    each one's accuracy (%) and the cases only one of them answers; None where they share no case."""
    a, b = got.get((ours, budget, mode), {}), got.get((f"kvpress:{theirs}", budget, mode), {})
    common = sorted(set(a) & set(b))
    if not common:
        return None
    n = len(common)
    return {"cases": n, "ours": 100 * sum(a[c] for c in common) / n, "theirs": 100 * sum(b[c] for c in common) / n,
            "only_ours": sum(a[c] and not b[c] for c in common), "only_theirs": sum(b[c] and not a[c] for c in common)}


def main(model: str = "smollm2", budget: str = "0.2") -> None:
    got: dict[tuple, dict] = collections.defaultdict(dict)
    for c in calibrated_cases(model):
        got[(c["policy"], c["budget"], c["mode"])][(c["family"], c["length"], c["seed"])] = bool(c["correct"])
    if budget == "all":                           # one row per pair, one column per budget
        budgets = (0.1, 0.2, 0.5)
        print("| mode | kvpass | kvpress | " + " | ".join(f"{b}: kvpass / kvpress (only each)" for b in budgets) + " |")
        print("|---|---|---|" + "---|" * len(budgets))
        for mode in ("query_aware", "query_agnostic"):
            for ours, theirs in PAIRS:
                cells = [paired(got, ours, theirs, b, mode) for b in budgets]
                if not any(cells):
                    continue
                text = ["-" if p is None else f"{p['ours']:.1f} / {p['theirs']:.1f} ({p['only_ours']} / {p['only_theirs']})"
                        + ("" if p["cases"] >= 300 else f" [{p['cases']}]") for p in cells]
                print(f"| {mode.replace('_', '-')} | {ours} | {theirs} | " + " | ".join(text) + " |")
        return
    print("| mode | kvpass | kvpress | cases | kvpass | kvpress | only kvpass | only kvpress |")
    print("|---|---|---|---|---|---|---|---|")
    for mode in ("query_aware", "query_agnostic"):
        for ours, theirs in PAIRS:
            p = paired(got, ours, theirs, float(budget), mode)
            if p is not None:
                print(f"| {mode.replace('_', '-')} | {ours} | {theirs} | {p['cases']} | {p['ours']:.1f}% | "
                      f"{p['theirs']:.1f}% | {p['only_ours']} | {p['only_theirs']} |")


if __name__ == "__main__":
    main(*sys.argv[1:3])
