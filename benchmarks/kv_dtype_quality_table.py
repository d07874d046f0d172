"""The suite's records of one store side by side per cache entry format: accuracy, answers that differ from the
model-dtype cache's (case for case), and the cache held, per (policy, budget, mode).

    python benchmarks/kv_dtype_quality_table.py benchmarks/results/quality-kv-dtype-smollm2-cpu-cases.json

Only the cases every format has (paired) are counted. Markdown on stdout.
"""

from __future__ import annotations

import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path

FORMATS = (None, "int8", "fp8_e4m3")


def load(path: str) -> list[dict]:
    raw = Path(path).read_bytes()
    data = json.loads(gzip.decompress(raw) if path.endswith(".gz") else raw)
    cases = data.get("cases", data)
    return list(cases.values()) if isinstance(cases, dict) else list(cases)


def table(records: list[dict]) -> str:
    by_cell: dict[tuple, dict] = defaultdict(dict)
    for r in records:
        if r.get("kind") != "suite" or r["mode"] == "reference":
            continue
        case = (r["family"], r["length"], r["seed"])
        by_cell[(r["policy"], r["budget"], r["mode"])].setdefault(case, {})[r.get("kv_dtype")] = r
    lines = ["| policy | budget | mode | cases | " + " | ".join(f"{f or 'model dtype'} correct" for f in FORMATS)
             + " | int8 / fp8 answers changed | int8 / fp8 output tokens changed | cache (of full) model / int8 / fp8 |",
             "|---|---|---|---|" + "---|" * (len(FORMATS) + 3)]
    for (policy, budget, mode), cases in sorted(by_cell.items(), key=lambda kv: (kv[0][0], str(kv[0][1]), kv[0][2])):
        paired = [c for c in cases.values() if all(f in c for f in FORMATS)]
        if not paired:
            continue
        correct = [sum(c[f]["correct"] for c in paired) for f in FORMATS]
        flips = [sum(c[f]["correct"] != c[None]["correct"] for c in paired) for f in FORMATS[1:]]
        tokens = [sum(c[f]["output_ids"] != c[None]["output_ids"] for c in paired) for f in FORMATS[1:]]
        held = [sum(c[f]["cache_bytes"] for c in paired) / sum(c[f]["full_cache_bytes"] for c in paired)
                for f in FORMATS]
        lines.append(f"| {policy} | {budget if budget is not None else '-'} | {mode} | {len(paired)} | "
                     + " | ".join(f"{n}/{len(paired)}" for n in correct)
                     + f" | {flips[0]} / {flips[1]} | {tokens[0]} / {tokens[1]} | "
                     + " / ".join(f"{h:.1%}" for h in held) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(load(sys.argv[1])))
