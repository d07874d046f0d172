"""``quality-suite-<model>.md/.json/.png``: per (policy, budget, mode) the suite's accuracy with a
95% Wilson interval, per-length and per-family breakdowns, case counts, completeness, ``full``
against transformers case for case, and the accuracy-vs-budget plot. kvpass and kvpress peer
records (policy ``kvpress:<Press>``) from any number of stores share one table."""

from __future__ import annotations

import datetime
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvpass.eval.report import _plt, _save, budget_label, group, wilson

PEER = "kvpress:"


def _order(row: dict) -> tuple:
    p = row["policy"]
    return (p != "transformers", p != "full", p.startswith(PEER), p, row["budget"] or 0, row["mode"])


def rows(records: Sequence[dict], expected: int | None = None,
         wanted: Sequence[tuple[str, Any, str]] = ()) -> list[dict[str, Any]]:
    """One row per (policy, budget, mode): accuracy, its Wilson interval, cases (and whether
    ``expected`` are there), per-length and per-family accuracy, mean cache ratio and seconds;
    ``wanted`` rows without any record get a row with 0 cases (accuracy None)."""
    found = {(c["policy"], c["budget"], c["mode"]) for c in records}
    out = [{"policy": p, "budget": b, "mode": m, "cases": 0, "correct": 0, "accuracy": None, "wilson_low": None,
            "wilson_high": None, "complete": False, "by_length": {}, "by_family": {}, "cache_ratio": None,
            "seconds": None} for p, b, m in dict.fromkeys(wanted) if (p, b, m) not in found]
    for (policy, budget, mode), cs in group(records, "policy", "budget", "mode").items():
        k, n = sum(bool(c["correct"]) for c in cs), len(cs)
        low, high = wilson(k, n)
        ratio = [c["cache_bytes"] / c["full_cache_bytes"] for c in cs if c.get("cache_bytes") and c.get("full_cache_bytes")]
        out.append({"policy": policy, "budget": budget, "mode": mode, "cases": n, "correct": k, "accuracy": k / n,
                    "wilson_low": low, "wilson_high": high,
                    "complete": expected is None or n >= expected,
                    "by_length": {str(length): _acc(g) for (length,), g in sorted(group(cs, "length").items())},
                    "by_family": {f: _acc(g) for (f,), g in sorted(group(cs, "family").items())},
                    "cache_ratio": sum(ratio) / len(ratio) if ratio else None,
                    "seconds": sum(c.get("seconds") or 0 for c in cs) / n})
    return sorted(out, key=_order)


def _acc(cs: Sequence[dict]) -> dict[str, Any]:
    k = sum(bool(c["correct"]) for c in cs)
    return {"accuracy": k / len(cs), "cases": len(cs)}


def agreement(records: Sequence[dict]) -> dict[str, dict[str, int]]:
    """Per mode, ``full`` against transformers on the same (family, length, seed): cases compared,
    identical output tokens, identical score."""
    ref = {(c["family"], c["length"], c["seed"]): c for c in records if c["policy"] == "transformers"}
    out = {}
    for mode in sorted({c["mode"] for c in records if c["policy"] == "full"}):
        pairs = [(c, ref.get((c["family"], c["length"], c["seed"]))) for c in records
                 if c["policy"] == "full" and c["mode"] == mode]
        pairs = [(c, r) for c, r in pairs if r is not None]
        out[mode] = {"cases": len(pairs),
                     "same_tokens": sum(c.get("output_ids") == r.get("output_ids") for c, r in pairs),
                     "same_score": sum(c["correct"] == r["correct"] for c, r in pairs)}
    return out


def plot(table: Sequence[dict], path: str | Path, title: str) -> Path:
    """Accuracy vs budget, one panel per mode, one line per policy (peers dashed), ``full`` dotted."""
    plt = _plt()
    modes = [m for m in ("query_aware", "query_agnostic", "query_agnostic_bounded") if any(r["mode"] == m for r in table)] or ["query_aware"]
    fig, axes = plt.subplots(1, len(modes), figsize=(6.5 * len(modes), 4.4), squeeze=False)
    for ax, mode in zip(axes[0], modes, strict=True):
        here = [r for r in table if r["mode"] == mode]
        here = [r for r in here if r["accuracy"] is not None]
        for r in here:
            if r["policy"] == "full":
                ax.axhline(r["accuracy"], linestyle=":", color="black", label=f"full {r['accuracy']:.0%}")
        for (policy,), rs in sorted(group([r for r in here if r["budget"] is not None], "policy").items()):
            rs = sorted(rs, key=lambda r: r["budget"])
            x = [r["budget"] for r in rs]
            ax.errorbar(x, [r["accuracy"] for r in rs],
                        yerr=[[max(0.0, r["accuracy"] - r["wilson_low"]) for r in rs],
                              [max(0.0, r["wilson_high"] - r["accuracy"]) for r in rs]],
                        linestyle="--" if policy.startswith(PEER) else "-", marker="o", markersize=3, capsize=2,
                        linewidth=1.2, label=policy)
        ax.set_xscale("log")
        budgets = sorted({r["budget"] for r in here if r["budget"] is not None})
        if budgets:
            ax.set_xticks(budgets, [budget_label(b) for b in budgets])
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("budget (fraction of the prompt's KV kept)")
        ax.set_ylabel("accuracy (95% Wilson interval)")
        ax.set_title(mode, fontsize=9)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6, ncol=2)
    fig.suptitle(title, fontsize=10)
    return _save(plt, fig, path)


def failed(failures: Sequence[dict]) -> list[dict[str, Any]]:
    """Peer-error records (a press raised at a prompt length: ``benchmarks/peers/cases.error_record``)
    grouped per (policy, budget, mode): the prompt lengths it failed at, the cases left unscored there
    and the first error's text."""
    out = []
    for (policy, budget, mode), rs in group(failures, "policy", "budget", "mode").items():
        rs = sorted(rs, key=lambda r: r.get("tokens") or 0)
        out.append({"policy": policy, "budget": budget, "mode": mode,
                    "tokens": sorted({r.get("tokens") for r in rs if r.get("tokens") is not None}),
                    "cases": sum(r.get("cases") or 0 for r in rs), "error": str(rs[0].get("error", ""))})
    return sorted(out, key=_order)


def write(records: Sequence[dict], out_dir: str | Path, model: str, command: str, grid: dict[str, Any],
          expected: int, stores: Sequence[str], wanted: Sequence[tuple[str, Any, str]] = (),
          failures: Sequence[dict] = ()) -> Path:
    """Write ``quality-suite-<model>.json``, ``.md`` and ``.png`` -> the Markdown path. ``expected``:
    cases per (policy, budget, mode) row of a complete run; ``failures``: peer-error records, listed
    under the table (a press that raised is named, not silently missing)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    table = rows(records, expected, wanted)
    agree = agreement(records)
    complete = bool(table) and all(r["complete"] for r in table)
    devices: dict[str, int] = {}
    for c in records:
        devices[c.get("device", "cpu")] = devices.get(c.get("device", "cpu"), 0) + 1
    meta = {"command": command, "model": model, "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "grid": grid, "expected_cases_per_row": expected, "complete": complete, "devices": devices,
            "full_vs_transformers": agree, "stores": list(stores)}
    fails = failed(failures)
    (out_dir / f"quality-suite-{model}.json").write_text(json.dumps({"meta": meta, "rows": table,
                                                                     "peer_failures": fails}, indent=1),
                                                         encoding="utf-8")
    png = plot(table, out_dir / f"quality-suite-{model}.png", f"{model}: long-context suite accuracy")
    lengths = sorted({int(k) for r in table for k in r["by_length"]})
    families = sorted({f for r in table for f in r["by_family"]})
    partial = [r for r in table if not r["complete"]]
    status = "complete" if complete else (f"**PARTIAL**: {len(partial)} of {len(table)} rows lack cases "
                                          f"(expected {expected} per row)")
    lines = [f"# Long-context quality suite: {model}", "",
             f"Produced by: `{command}`  ", f"Date: {meta['date']}; stores: {', '.join(f'`{s}`' for s in stores)}.  ",
             f"Cases ran on: {', '.join(f'{n} on {d}' for d, n in sorted(devices.items(), key=lambda kv: -kv[1])) or 'none'}.  ",
             f"Status: {status}.", "",
             f"Grid: {grid.get('cells_text', '')}; {grid.get('cases')} seeds per (family, length)"
             f"{_seed_range(grid)} = {expected} cases per "
             "row. Accuracy with its 95% Wilson interval; per-length and per-family accuracy beside it. "
             "Query-aware: context + question compressed together; query-agnostic: the context compressed alone to a "
             "budget of its own tokens, the question then prefilled over it and never compressed (compress once, ask "
             "many); query-agnostic-bounded: the question fed through decode steps that keep compressing. "
             "`transformers`: plain `generate` on the same tokens. "
             "Peers (`kvpress:*`) ran in their own venv on the same exported cases.", "",
             "| " + " | ".join(["policy", "budget", "mode", "accuracy", "95% CI", "cases",
                                *(f"L={n}" for n in lengths), *families, "cache / full"]) + " |",
             "|" + "---|" * (7 + len(lengths) + len(families))]
    for r in table:
        per_len = [r["by_length"].get(str(n)) for n in lengths]
        per_fam = [r["by_family"].get(f) for f in families]
        cells = "".join(" | " + ("-" if a is None else f"{a['accuracy']:.0%}") for a in per_len + per_fam)
        count = f"{r['cases']}" + ("" if r["complete"] else f" of {expected}")
        ratio = "-" if r["cache_ratio"] is None else f"{r['cache_ratio']:.1%}"
        acc = "-" if r["accuracy"] is None else f"{r['accuracy']:.1%}"
        ci = "-" if r["accuracy"] is None else f"{r['wilson_low']:.1%}-{r['wilson_high']:.1%}"
        lines.append(f"| {r['policy']} | {budget_label(r['budget'])} | {r['mode']} | {acc} | {ci} | {count}"
                     f"{cells} | {ratio} |")
    if fails:
        scored = {(r["policy"], r["budget"], r["mode"]): r["cases"] for r in table}
        lines += ["", "Peers that raised (the press is skipped at those prompt lengths: its cases there are unscored, "
                  "not counted as wrong; `scored`: the row's cases in the table):", "",
                  "| policy | budget | mode | prompt tokens | scored | error |", "|---|---|---|---|---|---|"]
        for f in fails:
            text = " ".join(f["error"].split())[:160].replace("|", "/")
            lines.append(f"| {f['policy']} | {budget_label(f['budget'])} | {f['mode']} | "
                         f"{', '.join(map(str, f['tokens'])) or '-'} | "
                         f"{scored.get((f['policy'], f['budget'], f['mode']), 0)} of {expected} | {text} |")
    lines += ["", "`full` against plain transformers, case for case (same tokens, greedy):"]
    for mode, a in agree.items():
        lines.append(f"- {mode}: identical output tokens in {a['same_tokens']}/{a['cases']} cases, "
                     f"same score in {a['same_score']}/{a['cases']}.")
    if not agree:
        lines.append("- not run yet.")
    lines += ["", f"Plot: `{png.name}` (accuracy vs budget; peers dashed; `full` dotted)."]
    md = out_dir / f"quality-suite-{model}.md"
    md.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return md


def _seed_range(grid: dict) -> str:
    """' (seeds a-b)' where the run's seeds do not start at 0 (held-out cases), else ''."""
    first = int(grid.get("first_seed") or 0)
    return f" (seeds {first}-{first + int(grid.get('cases') or 0) - 1})" if first else ""

