"""Print the README's quality table from benchmarks/results/quality-smollm2.json (no numbers typed by hand):

    python3 benchmarks/quality_readme_table.py

One row per policy: needle accuracy in both modes and perplexity / full at budgets 0.1 / 0.2 / 0.5,
attention error and cache bytes at 0.2; policies sorted by query-aware needle accuracy at 0.2.
"""

import json

d = json.load(open("benchmarks/results/quality-smollm2.json"))
rows = {(r["policy"], r["budget"]): r for r in d["rows"]}
BUDGETS = (0.1, 0.2, 0.5)
pols = sorted({p for p, b in rows if b is not None},
              key=lambda p: (-(rows[(p, 0.2)]["niah_query_aware"] or 0), rows[(p, 0.2)]["ppl_ratio"] or 9e9))


def pct(v):
    return "-" if v is None else f"{v:.0%}"


def num(v, spec):
    return "-" if v is None else format(v, spec)


def three(p, field, fmt):
    return " / ".join(fmt(rows[(p, b)][field]) for b in BUDGETS)


cases = sorted({r[f"niah_{m}_cases"] for r in d["rows"] for m in ("query_aware", "query_agnostic")
                if r["policy"] != "transformers" and r[f"niah_{m}_cases"]})
print(f"Needle cases per cell: {cases[0]}" + (f" to {cases[-1]}" if len(cases) > 1 else ""))
print()
print("| policy | NIAH query-aware, budget 0.1 / 0.2 / 0.5 | NIAH query-agnostic | ppl / full | "
      "attn. error at 0.2 | cache / full at 0.2 |")
print("|---|---|---|---|---|---|")
f, t = rows[("full", None)], rows[("transformers", None)]
print(f"| transformers (reference) | {pct(t['niah_query_aware'])} | | 1 | | |")
print(f"| full | {pct(f['niah_query_aware'])} | {pct(f['niah_query_agnostic'])} | 1 | 0 | "
      f"{num(f['niah_cache_ratio'], '.0%')} |")
for p in pols:
    b = rows[(p, 0.2)]
    print(f"| {p} | {three(p, 'niah_query_aware', pct)} | {three(p, 'niah_query_agnostic', pct)} | "
          f"{three(p, 'ppl_ratio', lambda v: num(v, '.3g'))} | {num(b['attn_rel_err'], '.3f')} | "
          f"{num(b['niah_cache_ratio'], '.0%')} |")
print()
print("ppl full:", f["ppl"], "meta:", d["meta"]["full_vs_transformers"], "complete:", d["meta"]["complete"],
      "devices:", d["meta"].get("devices"))
