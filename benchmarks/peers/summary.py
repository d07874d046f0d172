"""Accuracy of a peers Store per (model, policy, budget, mode), its error records, and the agreement
checks: ``kvpress:none`` (both modes) against plain generate in the peers venv and, with
``--reference``, against another Store's plain-transformers answers (kvpass's venv).

    python benchmarks/peers/summary.py out/peers/kvpress.json [--merge] [--reference STORE]

Pure Python (any venv). ``--merge`` first folds the store's ``.shard<i>`` files into it.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cases as C  # noqa: E402


def accuracy_rows(records: list[dict]) -> list[tuple]:
    """(model, policy, budget, mode, correct, n, mean seconds) per cell, sorted."""
    cells: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        if r.get("kind") == "peer":
            cells[(r["model"], r["policy"], r["budget"], r["mode"])].append(r)
    rows = []
    for (model, policy, budget, mode), rs in cells.items():
        rows.append((model, policy, budget, mode, sum(bool(r["correct"]) for r in rs), len(rs),
                     sum(r["seconds"] for r in rs) / len(rs)))
    return sorted(rows, key=lambda r: (r[0], r[2] is not None, -(r[2] or 0), r[1], r[3]))


def agreement(records: list[dict], policy: str, mode: str, against: list[dict], against_policy: str) -> tuple[int, int]:
    """(cases whose answer tokens equal, cases compared) between two policies on the same cases."""
    mine = {r["case"]: r for r in records if r.get("policy") == policy and r.get("mode") == mode and "case" in r}
    theirs = {r["case"]: r for r in against if r.get("policy") == against_policy and "case" in r}   # not errors
    common = sorted(set(mine) & set(theirs))
    return sum(mine[c]["output_ids"] == theirs[c]["output_ids"] for c in common), len(common)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("store")
    p.add_argument("--merge", action="store_true", help="fold the shards into the store first")
    p.add_argument("--reference", help="a Store with policy 'transformers' answers (kvpass's venv)")
    args = p.parse_args(argv)
    store_mod = C.store_module()
    store = store_mod.merge_shards(args.store) if args.merge else store_mod.Store(args.store)
    records = list(store.cases.values())
    print(f"{args.store}: {sum(r.get('kind') == 'peer' for r in records)} scored cases, meta {store.meta}")
    print(f"{'model':<12} {'policy':<36} {'budget':>6} {'mode':<15} {'correct':>9} {'s/case':>8}")
    for model, policy, budget, mode, ok, n, sec in accuracy_rows(records):
        print(f"{model:<12} {policy:<36} {str(budget):>6} {mode:<15} {ok:>4}/{n:<4} {sec:>8.2f}")
    errors = [r for r in records if r.get("kind") == "peer-error"]
    for r in sorted(errors, key=lambda r: r["key"]):
        print(f"ERROR {r['model']} {r['policy']} budget={r['budget']} {r['mode']}: {r['error'][:200]}")
    for mode in C.MODES:
        same, n = agreement(records, "kvpress:none", mode, records, "transformers-peer-env")
        if n:
            print(f"kvpress:none {mode} == transformers-peer-env: {same}/{n} cases")
    if args.reference:
        ref = list(store_mod.Store(args.reference).cases.values())
        for policy, mode in [("transformers-peer-env", C.REFERENCE), ("kvpress:none", C.QUERY_AWARE),
                             ("kvpress:none", C.QUERY_AGNOSTIC)]:
            same, n = agreement(records, policy, mode, ref, "transformers")
            if n:
                print(f"{policy} {mode} == transformers ({args.reference}): {same}/{n} cases")
    return 0


if __name__ == "__main__":
    sys.exit(main())
