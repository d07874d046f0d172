"""``quality-<model>.md`` and ``.json``: one row per policy x budget with needle accuracy in both
modes, perplexity ratio to ``full``, mean attention error, top-B recall and cache bytes; the
command that produced them, the grid, and whether every cell is complete."""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shlex
from pathlib import Path
from typing import Any

import torch

from kvpass.eval import report


def recorded_argv(argv: list[str]) -> list[str]:
    """The command line that reproduces the whole table: without ``--part X`` and ``--report-only``."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--part":
            skip = True
        elif not a.startswith("--part=") and a != "--report-only":
            out.append(a)
    return out


def _expected(args: argparse.Namespace) -> dict[str, int]:
    lengths = len(set(args.lengths))
    return {"niah_per_mode": lengths * len(args.depths) * len(args.seeds), "lm_segments": args.segments}


def rows(args: argparse.Namespace, niah_cases: list[dict], lm_cases: list[dict]) -> list[dict[str, Any]]:
    """Leaderboard rows: transformers reference first, then each (policy, budget)."""
    niah = {(r["policy"], r["budget"], r["mode"]): r for r in report.niah_rows(niah_cases)}
    lm = {(r["policy"], r["budget"]): r for r in report.lm_rows(lm_cases)}
    wanted = _configs(args) | {("transformers", None)}
    keys = sorted({(p, b) for p, b, _ in niah} | set(lm) | wanted, key=lambda k: (k[0] != "transformers", k[0] != "full",
                                                                           k[0], k[1] or 0))
    out = []
    for policy, budget in keys:
        aware = niah.get((policy, budget, "query_aware")) or niah.get((policy, budget, "reference"))
        agn = niah.get((policy, budget, "query_agnostic"))
        lmr = lm.get((policy, budget), {})
        out.append({
            "policy": policy, "budget": budget,
            "niah_query_aware": aware["accuracy"] if aware else None,
            "niah_query_aware_cases": aware["cases"] if aware else 0,
            "niah_query_agnostic": agn["accuracy"] if agn else None,
            "niah_query_agnostic_cases": agn["cases"] if agn else 0,
            "ppl": lmr.get("ppl"), "ppl_ratio": lmr.get("ppl_ratio"), "lm_tokens": lmr.get("tokens", 0),
            "attn_rel_err": lmr.get("attn_rel_err"), "recall": lmr.get("recall"), "mass": lmr.get("mass"),
            "niah_cache_bytes": aware["cache_bytes"] if aware else None,
            "niah_cache_ratio": aware["cache_ratio"] if aware else None,
            "lm_cache_bytes": lmr.get("cache_bytes"), "lm_cache_ratio": lmr.get("cache_ratio"),
            "seconds_per_niah_case": aware["seconds"] if aware else None,
        })
    return out


def _pct(v, cases: int = 0) -> str:
    if v is None:
        return "-"
    return f"{v:.0%}" + (f" ({cases})" if cases else "")


def _f(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _plots(niah_cases: list[dict], lm_cases: list[dict], out_dir: Path, model: str) -> dict:
    """The needle heatmaps (per policy, budget, mode and needle count: {key: path}) and the NLL and fidelity plots."""
    heat = {}
    for key, cs in report.group(niah_cases, "policy", "budget", "mode", "needles").items():
        title = f"{model} {key[0]} budget {report.budget_label(key[1])} {key[2]}"
        heat[key] = report.niah_heatmap(cs, out_dir / f"niah-{report.slug(model, *key[:3])}.png", title)
    if lm_cases:
        report.nll_plot(lm_cases, out_dir / f"ppl-{model}.png", f"{model}: cumulative NLL by position")
        report.fidelity_plot(lm_cases, out_dir / f"fidelity-{model}.png", f"{model}: attention fidelity per layer")
    return heat


def _status(table: list[dict], niah_cases: list[dict], expected: dict, complete: bool) -> str:
    """"complete", or what of the needle grid is stored."""
    full_cells = sum(r["niah_query_aware_cases"] >= expected["niah_per_mode"] and (
        r["policy"] == "transformers" or r["niah_query_agnostic_cases"] >= expected["niah_per_mode"]) for r in table)
    stored = {mode: sum(c["mode"] == mode for c in niah_cases) for mode in ("query_aware", "query_agnostic")}
    want = {mode: sum(r["policy"] != "transformers" for r in table) * expected["niah_per_mode"] for mode in stored}
    return "complete" if complete else (
        f"**PARTIAL**: {full_cells} of {len(table)} rows have every needle case; needle cases stored: "
        + ", ".join(f"{stored[m]} of {want[m]} {m}" for m in stored) + " (per-row counts in brackets)")


def write_leaderboard(args: argparse.Namespace, store, out_dir: Path, model: str) -> Path:
    from kvpass.eval.common import selected_cases

    niah_cases, lm_cases = selected_cases(store, args, "niah"), selected_cases(store, args, "lm")
    table = rows(args, niah_cases, lm_cases)
    expected = _expected(args)
    complete = all(r["niah_query_aware_cases"] >= expected["niah_per_mode"] for r in table) and all(
        r["policy"] == "transformers" or r["niah_query_agnostic_cases"] >= expected["niah_per_mode"] for r in table) \
        and {(r["policy"], r["budget"]) for r in table} >= _configs(args) and all(
        r["lm_tokens"] >= expected["lm_segments"] * args.steps for r in table)
    agreement = report.full_agreement(niah_cases)
    command = "kvpass " + shlex.join(recorded_argv(args.argv))
    meta = {"command": command, "model": args.model, "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "machine": f"{platform.machine()} CPU, torch {torch.__version__}, {torch.get_num_threads()} threads",
            "devices": {"niah": _device_counts(niah_cases), "lm": _device_counts(lm_cases)},
            "complete": complete, "expected": expected,
            "niah_grid": {"lengths": sorted(set(args.lengths)), "depths": args.depths, "seeds": args.seeds,
                          "needles": args.needles, "max_new_tokens": args.max_new_tokens},
            "lm": {"prefix": args.prefix, "steps": args.steps, "segments": args.segments, "probes": args.probes},
            "full_vs_transformers": agreement, "cases_file": str(store.path)}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"quality-{model}.json").write_text(json.dumps({"meta": meta, "rows": table}, indent=1), encoding="utf-8")

    heat = _plots(niah_cases, lm_cases, out_dir, model)
    status = _status(table, niah_cases, expected, complete)
    lines = [
        f"# Quality leaderboard: {model}",
        "",
        f"Produced by: `{command}`  ",
        f"Date: {meta['date']}; report written on {meta['machine']}.  ",
        f"Where the cases ran: needle cases {_devices_text(meta['devices']['niah'])}; perplexity and fidelity "
        f"{_devices_text(meta['devices']['lm'])} (float32 everywhere; each case records its device).  ",
        f"Status: {status}. Re-running the same command resumes (cases already in `{store.path}` are skipped).",
        "",
        f"- Needle in a haystack: context lengths {meta['niah_grid']['lengths']} tokens x depths "
        f"{[round(d, 3) for d in args.depths]} x seeds {args.seeds} = {expected['niah_per_mode']} cases per mode, "
        f"{args.needles} needle(s), greedy, up to {args.max_new_tokens} new tokens, exact match (passphrase in the output). "
        "Query-aware: context + question compressed together; query-agnostic: context compressed first, question fed "
        "through decode steps.",
        f"- Perplexity: {args.segments} segment(s) of essay text, {args.prefix} prefilled tokens then {args.steps} "
        "tokens teacher-forced through decode steps; ppl / full is the ratio to the `full` policy.",
        f"- Attention fidelity: at {args.probes} probe positions per segment, per non-sliding layer, the relative "
        "error of the attention output over the compressed cache vs over every token, for the same (reference) "
        "query; recall = fraction of the true top-B attended tokens kept (B = entries kept); mean over layers. "
        "The compressed side is plain softmax(q K^T + log-weight) V over the stored entries: `ems` attends through "
        "its slot table instead (per-token key norms, §4.7), so its column is not its own attention's error.",
        "- `full` ignores the budget (one row). `transformers` is plain `model.generate` on the same tokens.",
        "- cache / full: bytes kvpass holds at the end of a case (K, V and metadata: log-weights, positions, "
        "scores) over the K, V bytes of a full cache of the same tokens, so `full` shows slightly over 100%.",
        f"- Time per needle case, mean: {_mean_seconds(niah_cases)} (model load and tracing excluded; "
        "a case's share of the prefill shared by every policy x budget and of its batch's decode session).",
        "",
        "| policy | budget | NIAH query-aware (cases) | NIAH query-agnostic (cases) | ppl | ppl / full | "
        "attn rel. err | top-B recall | cache / full (NIAH) | cache MiB (NIAH) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table:
        mib = None if r["niah_cache_bytes"] is None else r["niah_cache_bytes"] / 2**20
        lines.append(
            f"| {r['policy']} | {report.budget_label(r['budget'])} | "
            f"{_pct(r['niah_query_aware'], r['niah_query_aware_cases'])} | "
            f"{_pct(r['niah_query_agnostic'], r['niah_query_agnostic_cases'])} | {_f(r['ppl'], '.3f')} | "
            f"{_f(r['ppl_ratio'], '.4f')} | {_f(r['attn_rel_err'], '.4f')} | {_f(r['recall'], '.3f')} | "
            f"{_f(r['niah_cache_ratio'], '.1%')} | {_f(mib, '.2f')} |")
    lines += ["", "`full` against plain transformers (same tokens, greedy):"]
    for mode, a in agreement.items():
        lines.append(f"- {mode}: identical output tokens in {a['same_tokens']}/{a['cases']} cases, "
                     f"same exact-match score in {a['same_score']}/{a['cases']}.")
    if not agreement:
        lines.append("- not run yet.")
    lines += ["", "Plots: " + ", ".join(f"`{p.name}`" for p in sorted(heat.values())[:3]) +
              (", ..." if len(heat) > 3 else "") + (f", `ppl-{model}.png`, `fidelity-{model}.png`" if lm_cases else "")]
    md = out_dir / f"quality-{model}.md"
    md.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return md


def _by_device(cases: list[dict]) -> dict[str, list[dict]]:
    """Cases per device ('cpu' or the GPU's name; cases stored before devices were recorded ran on the CPU)."""
    by: dict[str, list[dict]] = {}
    for c in cases:
        by.setdefault(c.get("device", "cpu"), []).append(c)
    return by


def _device_counts(cases: list[dict]) -> dict[str, int]:
    return {d: len(cs) for d, cs in _by_device(cases).items()}


def _devices_text(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} on {d}" for d, n in sorted(counts.items(), key=lambda kv: -kv[1])) or "none"


def _mean_seconds(cases: list[dict]) -> str:
    """'1.3 s on <GPU>, 16.2 s on cpu': the mean of the cases' ``seconds`` per device."""
    return ", ".join(f"{sum(c['seconds'] for c in cs) / len(cs):.1f} s on {d}"
                     for d, cs in _by_device(cases).items()) or "-"


def _configs(args: argparse.Namespace) -> set[tuple[str, Any]]:
    from kvpass.eval.common import uses_budget

    return {(p, b if uses_budget(p) else None) for p in args.policies for b in args.budgets}
