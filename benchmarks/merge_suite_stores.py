"""Merge the suite stores written by benchmarks/suite_gpu.sh (one per policy / shard) into one.

    python3 benchmarks/merge_suite_stores.py OUT_DIR MERGED.json.gz MODEL

Reads ``OUT_DIR/*/quality-suite-MODEL-cases.json`` (or ``.json.gz``) of every folder (with its shards),
keeps the suite cases, adds them to MERGED (the committed store, e.g.
benchmarks/results/quality-suite-smollm2-cases.json.gz; gzipped when its name ends in .json.gz) in the
store format (``kvpass.eval.store``) and prints the number of cases per (policy, budget, mode).
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))          # the repository root, run as a script
from kvpass.eval.store import Store  # noqa: E402


def main(out_dir: str, merged: str, model: str) -> None:
    target = Store(merged, write_path=merged)
    found = []
    for folder in sorted(p for p in Path(out_dir).iterdir() if p.is_dir()):
        for name in (f"quality-suite-{model}-cases.json", f"quality-suite-{model}-cases.json.gz"):
            store = Store(folder / name)                                # the store and its shards
            found.extend(c for c in store.cases.values() if c.get("kind") == "suite")
    target.add_many(found)
    counts = collections.Counter((c["policy"], c["budget"], c["mode"]) for c in target.cases.values())
    for key in sorted(counts, key=str):
        print(*key, counts[key])
    print(f"{len(target)} suite cases in {merged}")


if __name__ == "__main__":
    main(*sys.argv[1:4])
