"""kvpass against kvpress on the very same cases (paired): for each method both implement, the accuracy of
each on the cases both ran, and how many cases only one of them answers.

    python3 benchmarks/suite_paired.py [MODEL] [BUDGET]

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
         ("h2o", "ObservedAttentionPress"), ("d2o[scores=window,window_kernel=31]", "MergingPress(SnapKVPress)"))


def main(model: str = "smollm2", budget: float = 0.2) -> None:
    got: dict[tuple, dict] = collections.defaultdict(dict)
    for c in calibrated_cases(model):
        got[(c["policy"], c["budget"], c["mode"])][(c["family"], c["length"], c["seed"])] = bool(c["correct"])
    print("| mode | kvpass | kvpress | cases | kvpass | kvpress | only kvpass | only kvpress |")
    print("|---|---|---|---|---|---|---|---|")
    for mode in ("query_aware", "query_agnostic"):
        for ours, theirs in PAIRS:
            a, b = got.get((ours, budget, mode), {}), got.get((f"kvpress:{theirs}", budget, mode), {})
            common = sorted(set(a) & set(b))
            if not common:
                continue
            n = len(common)
            print(f"| {mode.replace('_', '-')} | {ours} | {theirs} | {n} | {100 * sum(a[c] for c in common) / n:.1f}% | "
                  f"{100 * sum(b[c] for c in common) / n:.1f}% | {sum(a[c] and not b[c] for c in common)} | "
                  f"{sum(b[c] and not a[c] for c in common)} |")


if __name__ == "__main__":
    main(*(sys.argv[1:2] or ["smollm2"]), *(float(x) for x in sys.argv[2:3]))
