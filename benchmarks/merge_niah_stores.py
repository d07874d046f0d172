"""Merge the needle stores written by benchmarks/niah_gpu.sh (one per policy / shard) into one.

    python3 benchmarks/merge_niah_stores.py OUT_DIR MERGED.json.gz

Reads the store ``OUT_DIR/*/quality-smollm2-cases.json`` (or ``.json.gz``) of every folder (with its
shards), keeps the needle cases, adds them to MERGED (e.g. benchmarks/results/quality-smollm2-cases.json.gz;
gzipped when its name ends in .json.gz) in the store format (``kvpass.eval.store``) and prints the
number of cases per (policy, budget, mode).
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

from kvpass.eval.store import Store


def main(out_dir: str, merged: str) -> None:
    target = Store(merged, write_path=merged)
    found = []
    for folder in sorted(p for p in Path(out_dir).iterdir() if p.is_dir()):
        for name in ("quality-smollm2-cases.json", "quality-smollm2-cases.json.gz"):
            store = Store(folder / name)                            # the store and its shards
            found.extend(c for c in store.cases.values() if c["kind"] == "niah")
    target.add_many(found)
    counts = collections.Counter((c["policy"], c["budget"], c["mode"]) for c in target.cases.values())
    for key in sorted(counts, key=str):
        print(*key, counts[key])
    print(f"{len(target)} needle cases in {merged}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
