"""``kvpass eval suite run | calibrate | export``: the long-context suite's argument parsing, grid, stores and
report (kvpass/eval/suite.py runs the cases)."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from kvpass.budget import parse_budget
from kvpass.eval.cli_options import _shard, check_policies_and_budgets, family_tokens
from kvpass.models import model_label
from kvpass.policies import DEFAULT_POLICY

SUITE_QUICK = {"lengths": [512], "cases": 2, "policies": ["full", "streamingllm", "snapkv", DEFAULT_POLICY], "budgets": [0.2],
               "families": ["single_needle", "multi_key", "multi_value", "variable_tracking", "common_words",
                            "essay_qa"]}


def _suite_common(p: argparse.ArgumentParser) -> None:
    from kvpass.eval.tasks import FAMILIES

    p.add_argument("--model", default="smollm2",
                   help="smollm2, gemma3-270m, qwen2.5-1.5b, qwen2.5-0.5b, a .gguf file or a transformers directory")
    p.add_argument("--families", nargs="+", choices=list(FAMILIES), metavar="FAMILY",
                   help=f"task families (default: the model's calibrated cells, else all: {', '.join(FAMILIES)})")
    p.add_argument("--lengths", nargs="+", type=int,
                   help="context tokens per case (default: the model's calibrated cells, else suite.DEFAULT_LENGTHS)")
    p.add_argument("--cases", type=int, default=10,
                   help="cases per (family, length): seeds FIRST..FIRST+N-1, FIRST from --first-seed (default 10)")
    p.add_argument("--first-seed", type=int, default=0,
                   help="the first case seed (default 0; the leaderboard's cases are seeds 0..99: from 100, cases it "
                        "never saw)")
    p.add_argument("--calibration", default=None, help="the calibration file (default kvpass/eval/tasks/calibration.json)")


def _suite_run_options(p: argparse.ArgumentParser, calibrate: bool) -> None:
    from kvpass.policies import POLICIES

    if not calibrate:
        p.add_argument("--policies", nargs="+", default=sorted(POLICIES), metavar="NAME",
                       help="registered policy names (default: all registered)")
        p.add_argument("--budgets", nargs="+", type=parse_budget, default=[0.1, 0.2, 0.5], metavar="B",
                       help="fractions like 0.2 or token counts (default 0.1 0.2 0.5)")
        p.add_argument("--no-reference", dest="reference", action="store_false",
                       help="skip the plain transformers generate run per case")
        p.add_argument("--quick", action="store_true", help=f"a small CPU grid (minutes): {SUITE_QUICK}")
        p.add_argument("--shard", type=_shard, default=None, metavar="I/N",
                       help="run only every N-th case from the I-th (processes sharing a GPU; each its own store)")
        p.add_argument("--peers", action="append", default=[], metavar="PATH",
                       help="another store to read records from for the report (kvpress peers); repeatable")
        p.add_argument("--prefill-chunk", type=int, default=None, metavar="TOKENS",
                       help="prefill every kvpass cell's prompt this many tokens at a time, compressed between "
                            "chunks (kvpass/runtime/chunked_prefill.py); its own store and report, "
                            "quality-suite-<model>-chunk<TOKENS>.*")
        p.add_argument("--kv-dtype", choices=["int8", "fp8_e4m3"], default=None,
                       help="every kvpass cell's cache entries as 8-bit codes with a scale per (token, KV head) "
                            "(default: the model's dtype; docs/quantization.md); its records and keys carry it, its "
                            "report is quality-suite-<model>-<KV_DTYPE>.*")
    p.add_argument("--modes", nargs="+", default=["query_aware", "query_agnostic"],
                   choices=["query_aware", "query_agnostic", "query_agnostic_bounded"])
    p.add_argument("--batch", type=int, default=16, help="rows per session (results do not depend on it)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda; each case records it")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="the model's dtype (default: float32, bfloat16 for the Qwen models); each case records it")
    p.add_argument("--store", action="append", default=[], metavar="PATH",
                   help="the resumable JSON of every case, gzipped when the name ends in .json.gz "
                        "(default <out-dir>/quality-suite-<model>-cases.json.gz); "
                        "given several times, the first is written and all are read")
    p.add_argument("--out-dir", default="benchmarks/results", help="where the JSON, Markdown and PNG go")
    p.add_argument("--report-only", action="store_true", help="run nothing: report the stored cases")
    p.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                   help="stop starting new sessions after this many seconds (store written; exit 0)")
    p.add_argument("--max-new-tokens", nargs="+", default=[], metavar="FAMILY=N",
                   help="answer tokens per family (default: each family's own)")


def _suite_grid(args: argparse.Namespace, tokenizer_len: int | None = None) -> list[tuple[str, int]]:
    """The (family, length) cells: the explicit --families x --lengths, else the model's calibrated
    cells (restricted to whichever of the two is given), else every family x DEFAULT_LENGTHS."""
    from kvpass.eval import suite
    from kvpass.eval.tasks import FAMILIES

    name = model_label(args.model)
    reads = not (args.families and args.lengths) and not getattr(args, "calibrating", False)  # calibrate may create it
    if args.calibration and reads:
        from kvpass.validation import check_readable_file

        check_readable_file("--calibration", args.calibration)
    calibrated = None if (args.families and args.lengths) else suite.calibrated_grid(
        name, args.calibration or suite.CALIBRATION)
    if calibrated and not getattr(args, "calibrating", False):
        kept = [(f, n) for f, n in calibrated if (not args.families or f in args.families)
                and (not args.lengths or n in args.lengths)]
        if kept:
            return kept
    families = args.families or list(FAMILIES)
    lengths = args.lengths or suite.DEFAULT_LENGTHS.get(name, [2048])
    return [(f, n) for f in families for n in lengths]


def _suite_cases(args: argparse.Namespace, tokenizer) -> list:
    from dataclasses import replace

    from kvpass.eval import suite

    items = suite.cases(tokenizer, [], [], args.cases, grid=_suite_grid(args), first=args.first_seed)
    overrides = family_tokens(getattr(args, "max_new_tokens", []) or [])
    return [replace(c, max_new_tokens=overrides[c.family]) if c.family in overrides else c for c in items]


def _suite_stores(args: argparse.Namespace):
    from kvpass.eval.store import Store

    model = model_label(args.model) + _chunk_suffix(args)
    paths = args.store or [str(Path(args.out_dir) / f"quality-suite-{model}-cases.json.gz")]
    return Store(paths[0], meta={"model": args.model}), [Store(p) for p in paths[1:] + list(getattr(args, "peers", []))]


def _chunk_suffix(args: argparse.Namespace) -> str:
    """'-chunk<N>' for a run with --prefill-chunk N, '-<kv_dtype>' for one with --kv-dtype (its store and report
    files), else ''."""
    chunk, kv_dtype = getattr(args, "prefill_chunk", None), getattr(args, "kv_dtype", None)
    return (f"-chunk{chunk}" if chunk is not None else "") + (f"-{kv_dtype}" if kv_dtype is not None else "")


def _suite_records(args: argparse.Namespace, stores, policies: list[str] | None, budgets: list | None) -> list[dict]:
    """The stored suite records of this model and grid (peers' ``kvpress:*`` records whatever their
    policy list), one per key; kvpass cells prefilled in chunks only in a --prefill-chunk run of that chunk."""
    from kvpass.eval.common import uses_budget

    grid = set(_suite_grid(args))
    seeds = range(args.first_seed, args.first_seed + args.cases)
    seen: dict[str, dict] = {}
    for store in stores:
        for c in store.cases.values():
            if "family" not in c or model_label(str(c.get("model", ""))) != model_label(args.model):
                continue
            if (c["family"], c["length"]) not in grid or c["seed"] not in seeds or c["mode"] not in (
                    *args.modes, "reference"):
                continue
            peer = str(c["policy"]).startswith("kvpress:")
            if not peer and policies is not None and c["policy"] not in (*policies, "transformers"):
                continue
            if budgets is not None and c["budget"] is not None and c["budget"] not in budgets:
                continue
            if not peer and c["policy"] not in ("transformers",) and c["budget"] is None and uses_budget(c["policy"]):
                continue
            if c["mode"] != "reference" and c.get("prefill_chunk") != getattr(args, "prefill_chunk", None):
                continue                          # chunked and unchunked records never share a report
            if not peer and c["mode"] != "reference" and c.get("kv_dtype") != getattr(args, "kv_dtype", None):
                continue                          # nor do records of other cache entry formats
            seen.setdefault(c["key"], c)
    return list(seen.values())


def _peer_failures(args: argparse.Namespace, stores) -> list[dict]:
    """The stored ``peer-error`` records of this model (a press that raised at some prompt length, so
    its cases there stay unscored), for the report to name beside the table."""
    model = model_label(args.model)
    return [c for store in stores for c in store.cases.values()
            if c.get("kind") == "peer-error" and model_label(str(c.get("model", ""))) == model
            and str(c["policy"]).startswith("kvpress:")]       # the peer venv's own transformers check is not a row


def cmd_suite(args: argparse.Namespace) -> int:
    import time

    from kvpass.eval import suite, suite_report

    command = args.suite_command
    calibrating = command == "calibrate"
    args.calibrating = calibrating
    family_tokens(getattr(args, "max_new_tokens", []) or [])          # refused before any model loads
    from kvpass.validation import check_option

    check_option("--cases", args.cases >= 1, args.cases, "an int >= 1")
    check_option("--first-seed", args.first_seed >= 0, args.first_seed, "an int >= 0")
    check_option("--batch", getattr(args, "batch", 1) >= 1, getattr(args, "batch", 1), "an int >= 1")
    _suite_grid(args)                                                  # reads --calibration: refused here if bad
    if command == "export":
        loaded = _load_suite(args)
        path = suite.export(loaded.name, _suite_cases(args, loaded.tokenizer), args.out)
        print(f"wrote {path}")
        return 0
    if getattr(args, "quick", False):
        for name, value in SUITE_QUICK.items():
            setattr(args, name, value)
    policies = ["full"] if calibrating else args.policies
    budgets = [] if calibrating else args.budgets
    check_policies_and_budgets(policies, budgets)
    reference = True if calibrating else args.reference
    store, others = _suite_stores(args)
    finished = True
    if not args.report_only:
        loaded = _load_suite(args)
        items = _suite_cases(args, loaded.tokenizer)
        if getattr(args, "shard", None):
            items = [c for k, c in enumerate(items) if k % args.shard[1] == args.shard[0]]
        deadline = None if args.time_limit is None else time.monotonic() + args.time_limit
        finished = suite.run(loaded, items, suite.cells(policies, budgets, args.modes, reference=reference), store,
                             batch=args.batch, deadline=deadline, prefill_chunk=getattr(args, "prefill_chunk", None),
                             kv_dtype=getattr(args, "kv_dtype", None))
        if not finished:
            print(f"time limit reached: {len(store)} cases stored in {store.path}")
    model = model_label(args.model)
    records = _suite_records(args, [store, *others], policies, budgets)
    grid = _suite_grid(args)
    from kvpass.eval.leaderboard import recorded_argv

    cmd = "kvpass " + shlex.join(recorded_argv(args.argv))
    if calibrating:
        summary = suite.calibration(records)
        lines = ["| family | length | full (worst mode) | transformers | cases | kept |", "|---|---|---|---|---|---|"]
        for c in summary["cells"]:
            lines.append(f"| {c['family']} | {c['length']} | {_pct1(c['full_accuracy'])} | "
                         f"{_pct1(c['transformers_accuracy'])} | {c['cases']} | {'yes' if c['kept'] else 'no'} |")
        print("\n".join(lines))
        complete = finished and all(c["cases"] >= args.cases for c in summary["cells"]) and len(summary["cells"]) == len(grid)
        if args.write and complete:
            path = suite.write_calibration(model, summary, args.calibration or suite.CALIBRATION, command=cmd,
                                           cases_per_cell=args.cases)
            print(f"wrote {path}")
        elif args.write:
            print("calibration incomplete: not written")
        return 0
    grid_text = {"cells": [list(g) for g in grid], "cases": args.cases, "first_seed": args.first_seed,
                 "policies": policies, "budgets": budgets,
                 "modes": args.modes,
                 "cells_text": ", ".join(f"{f}@{n}" for f, n in grid)}
    expected = len(grid) * args.cases
    wanted = [(c.policy, c.budget, c.mode) for c in suite.cells(policies, budgets, args.modes, reference=reference)]
    md = suite_report.write(records, args.out_dir, model + _chunk_suffix(args), cmd, grid_text, expected,
                            [str(s.path) for s in [store, *others]], wanted,
                            failures=_peer_failures(args, [store, *others]))
    print(md.read_text(encoding="utf-8"))
    return 0


def _pct1(v) -> str:
    return "-" if v is None else f"{v:.0%}"


def _load_suite(args: argparse.Namespace):
    from kvpass.eval.common import load, set_threads

    set_threads(1)
    return load(args.model, getattr(args, "device", "cpu"), getattr(args, "dtype", None))


def add_suite_parser(esub) -> None:
    """``kvpass eval suite run | export | calibrate``."""
    p = esub.add_parser("suite", help="the long-context quality suite (RULER-style task families)")
    ssub = p.add_subparsers(dest="suite_command", required=True)
    run = ssub.add_parser("run", help="score policies x budgets x modes on the suite -> quality-suite-<model>.md")
    _suite_common(run)
    _suite_run_options(run, calibrate=False)
    cal = ssub.add_parser("calibrate", help="full cache and transformers accuracy per (family, length); keeps the "
                                            ">= 90%% cells in kvpass/eval/tasks/calibration.json")
    _suite_common(cal)
    _suite_run_options(cal, calibrate=True)
    cal.add_argument("--no-write", dest="write", action="store_false", help="print the table only")
    exp = ssub.add_parser("export", help="write the cases in the shared JSON Lines format (for the kvpress runner)")
    _suite_common(exp)
    exp.add_argument("--out", required=True, help="the .jsonl file")
    exp.add_argument("--max-new-tokens", nargs="+", default=[], metavar="FAMILY=N")
    exp.add_argument("--device", default="cpu", help=argparse.SUPPRESS)
    for sp in (run, cal, exp):
        sp.set_defaults(func=cmd_suite)
