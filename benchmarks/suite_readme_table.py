"""Print docs/quality.md's leaderboard table from the stored cases (no number typed by hand):

    python3 benchmarks/suite_readme_table.py [MODEL]

Reads benchmarks/results/quality-suite-MODEL-cases.json.gz (kvpass) and -peers.json.gz (kvpress), keeps the
calibrated cells (kvpass/eval/tasks/calibration.json), and prints one row per policy: accuracy at budgets
0.1 / 0.2 / 0.5 query-aware (0.2 with its Wilson 95% interval), 0.2 query-agnostic, and cache bytes /
full cache at 0.2. A row's case count is shown where it is under 300; rows with fewer than MIN_CASES
cases at 0.2 query-aware are left out (a first batch of a few cases is one answer format only). Sorted
by 0.2 query-aware.
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from kvpass.eval.report import wilson  # noqa: E402
from kvpass.eval.store import read_json  # noqa: E402
from kvpass.eval.suite import calibrated_grid  # noqa: E402

FULL_ROW = 300
MIN_CASES = 50


def calibrated_cases(model: str) -> list[dict]:
    """Every stored case (kvpass's and kvpass's peers') of ``model``'s calibrated (family, length) cells."""
    cells = set(calibrated_grid(model) or [])
    results = ROOT / "benchmarks" / "results"
    cases = []
    for name in (f"quality-suite-{model}-cases.json.gz", f"quality-suite-{model}-peers.json.gz"):
        if (results / name).exists():
            cases += read_json(results / name)["cases"]
    return [c for c in cases if (c.get("family"), c.get("length")) in cells]


def main(model: str = "smollm2") -> None:
    acc, ratio = collections.defaultdict(list), collections.defaultdict(list)
    for c in calibrated_cases(model):
        if c.get("mode") == "reference":
            continue
        key = (c["policy"], c["budget"], c["mode"])
        acc[key].append(bool(c["correct"]))
        if c.get("cache_bytes") and c.get("full_cache_bytes"):
            ratio[key].append(c["cache_bytes"] / c["full_cache_bytes"])

    def cell(policy: str, budget: float | None, mode: str, ci: bool = False) -> str:
        got = acc.get((policy, budget, mode))
        if not got:
            return ""
        k, n = sum(got), len(got)
        text = f"{100 * k / n:.1f}%"
        if ci:
            lo, hi = wilson(k, n)
            text += f" [{100 * lo:.1f}, {100 * hi:.1f}]"
        return text + (f" ({n})" if n < FULL_ROW else "")

    policies = sorted({p for p, _, _ in acc if p not in ("full", "transformers", "kvpress:none")
                       and len(acc.get((p, 0.2, "query_aware"), [])) >= MIN_CASES},
                      key=lambda p: (-(sum(acc.get((p, 0.2, "query_aware"), [0])) /
                                       max(len(acc.get((p, 0.2, "query_aware"), [])), 1)), p))   # ties: by name
    print("| policy | 0.1 query-aware | 0.2 query-aware [95% CI] | 0.5 query-aware | 0.2 query-agnostic "
          "| cache / full at 0.2 |")
    print("|---|---|---|---|---|---|")
    full_ratio = ratio.get(("full", None, "query_aware"))
    print(f"| full | | {cell('full', None, 'query_aware', True)} | | {cell('full', None, 'query_agnostic')} | "
          f"{100 * sum(full_ratio) / len(full_ratio):.0f}% |" if full_ratio else "| full | | | | | |")
    for p in policies:
        r = ratio.get((p, 0.2, "query_aware"))
        name = p.replace("kvpress:", "kvpress ")
        print(f"| {name} | {cell(p, 0.1, 'query_aware')} | {cell(p, 0.2, 'query_aware', True)} | "
              f"{cell(p, 0.5, 'query_aware')} | {cell(p, 0.2, 'query_agnostic')} | "
              f"{f'{100 * sum(r) / len(r):.0f}%' if r else ''} |")


if __name__ == "__main__":
    main(*sys.argv[1:2])
