"""Print the README's quality table from benchmarks/results/quality-smollm2.json (no numbers typed by hand):
    python3 benchmarks/quality_readme_table.py
Policies without perplexity rows yet are left out."""
import json

d = json.load(open("benchmarks/results/quality-smollm2.json"))
rows = {(r["policy"], r["budget"]): r for r in d["rows"]}
pols = sorted({p for p, b in rows if b is not None and rows[(p, b)]["ppl_ratio"] is not None}, key=lambda p: rows[(p, 0.2)]["ppl_ratio"] or 9e9)
def pct(r, m):
    v, n = r[f"niah_{m}"], r[f"niah_{m}_cases"]
    return "-" if v is None else f"{v:.0%} ({n})"
print("| policy | ppl / full at 0.1 | at 0.2 | at 0.5 | attn. error at 0.2 | top-B recall at 0.2 | NIAH aware at 0.2 (cases) | NIAH agnostic at 0.2 (cases) |")
print("|---|---|---|---|---|---|---|---|")
f = rows[("full", None)]
print(f"| full | 1 | 1 | 1 | 0 | 1 | {pct(f, 'query_aware')} | {pct(f, 'query_agnostic')} |")
for p in pols:
    a, b, c = rows[(p, 0.1)], rows[(p, 0.2)], rows[(p, 0.5)]
    print(f"| {p} | {a['ppl_ratio']:.3g} | {b['ppl_ratio']:.3g} | {c['ppl_ratio']:.3g} | {b['attn_rel_err']:.3f} | "
          f"{b['recall']:.2f} | {pct(b, 'query_aware')} | {pct(b, 'query_agnostic')} |")
t = rows[("transformers", None)]
print(f"| transformers (reference) | | | | | | {pct(t, 'query_aware')} | |")
print()
print("ppl full:", f["ppl"], "meta:", d["meta"]["full_vs_transformers"], d["meta"]["complete"])
