"""``kvpass eval niah | ppl | fidelity | leaderboard``: argument parsing, ``--jobs`` worker
processes (each takes every n-th spec, ``--shard i/n``, and writes its own shard of the store) and
the outputs of each subcommand."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from kvpass.budget import parse_budget
from kvpass.eval.cli_options import _shard, check_policies_and_budgets
from kvpass.eval.suite_cli import _suite_grid, add_suite_parser  # noqa: F401  (_suite_grid: benchmarks/suite_gpu.sh)
from kvpass.models import model_label

QUICK = {"lengths": [512, 1024], "depths": [0.0, 0.5, 1.0], "prefix": 512, "steps": 64, "segments": 1, "probes": 2}


def _common(p: argparse.ArgumentParser, lm: bool, niah: bool) -> None:
    from kvpass.policies import POLICIES

    p.add_argument("--model", default="smollm2", help="smollm2, gemma3-270m, a .gguf file or a transformers directory")
    p.add_argument("--policies", nargs="+", default=sorted(POLICIES), metavar="NAME",
                   help="registered policy names (default: all registered)")
    p.add_argument("--budgets", nargs="+", type=parse_budget, default=[0.1, 0.2, 0.5], metavar="B",
                   help="fractions like 0.2 or token counts (default 0.1 0.2 0.5)")
    p.add_argument("--out-dir", default="benchmarks/results", help="where JSON, Markdown and PNGs go")
    p.add_argument("--store", help="the resumable JSON of every case, gzipped when the name ends in .json.gz "
                                   "(default: <out-dir>/<command>-<model>-cases.json.gz)")
    p.add_argument("--quick", action="store_true", help=f"a small grid that finishes in minutes: {QUICK}")
    p.add_argument("--device", default="cpu",
                   help="where the model runs: cpu (default) or cuda; each case records it")
    p.add_argument("--jobs", type=int, default=1, help="worker processes (they split the machine's cores)")
    p.add_argument("--shard", type=_shard, help=argparse.SUPPRESS)
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: write the tables and plots from the cases already stored")
    if lm and niah:
        p.add_argument("--part", choices=["all", "niah", "lm"], default="all",
                       help="run only the needle cases or only the ppl/fidelity passes, into their own shard of "
                            "the store, so two processes can share the work; a later plain run reads both")
    if niah:
        p.add_argument("--lengths", nargs="+", type=int, default=[1000, 2000, 4000, 8000],
                       help="context lengths in tokens (capped to the model's window)")
        p.add_argument("--depths", nargs="+", type=float, default=[i / 8 for i in range(9)],
                       help="needle depths in [0, 1] (default 0, 0.125, ..., 1)")
        p.add_argument("--seeds", nargs="+", type=int, default=[0], help="passphrase seeds (one case per seed)")
        p.add_argument("--needles", type=int, default=1, help="passphrases in the haystack (multi-needle: > 1)")
        p.add_argument("--max-new-tokens", type=int, default=32)
        p.add_argument("--modes", nargs="+", default=["query_aware", "query_agnostic"],
                       choices=["query_aware", "query_agnostic", "query_agnostic_bounded"])
        p.add_argument("--batch", type=int, default=8,
                       help="needle cases of equal token counts decoded together per (policy, budget) (results "
                            "do not depend on it)")
        p.add_argument("--no-reference", dest="reference", action="store_false",
                       help="skip the plain transformers generate run per case")
    if lm:
        p.add_argument("--prefix", type=int, default=2048, help="prefilled tokens per segment")
        p.add_argument("--steps", type=int, default=256, help="teacher-forced decode steps per segment")
        p.add_argument("--segments", type=int, default=1, help="segments of essay text (consecutive offsets)")
        p.add_argument("--probes", type=int, default=4, help="fidelity probe positions per segment")


def _apply_quick(args: argparse.Namespace) -> None:
    if args.quick:
        for name, value in QUICK.items():
            if hasattr(args, name):
                setattr(args, name, value)


def _spawn(args: argparse.Namespace, store_path: Path) -> None:
    """Run ``args.jobs`` copies of this command, each on one shard, then merge their shards."""
    from kvpass.eval.store import merge_shards

    argv = list(args.argv)
    procs = [subprocess.Popen([sys.executable, "-m", "kvpass.cli", *argv, "--jobs", "1",
                               "--store", str(store_path), "--shard", f"{i}/{args.jobs}"])
             for i in range(args.jobs)]
    codes = [p.wait() for p in procs]
    merge_shards(store_path)
    if any(codes):
        raise RuntimeError(f"worker exit codes {codes}")


def _store(args: argparse.Namespace, command: str):
    from kvpass.eval.store import Store, shard_path

    path = Path(args.store or Path(args.out_dir) / f"{command}-{model_label(args.model)}-cases.json.gz")
    write = shard_path(path, args.shard[0]) if args.shard else None
    if getattr(args, "part", "all") != "all":
        write = shard_path(path, f"-{args.part}{'' if not args.shard else args.shard[0]}")
    return path, Store(path, meta={"model": args.model}, write_path=write)


def _load(args: argparse.Namespace):
    from kvpass.eval.common import load, set_threads

    parts = 2 if getattr(args, "part", "all") != "all" else 1          # --part runs share the cores
    set_threads(max(args.jobs if args.shard is None else args.shard[1], parts))
    return load(args.model, args.device)


def niah_specs(args: argparse.Namespace, loaded) -> list:
    from kvpass.eval import niah

    room = loaded.context_length - args.max_new_tokens - 64          # the question and chat template
    lengths = sorted({min(n, room) for n in args.lengths})
    return niah.grid(lengths, args.depths, args.seeds, args.needles)


def lm_segments(args: argparse.Namespace) -> list:
    from kvpass.eval.lm import Segment

    return [Segment(offset=i * (args.prefix + args.steps), prefix=args.prefix, steps=args.steps)
            for i in range(args.segments)]


def run_niah(args: argparse.Namespace, store, loaded) -> None:
    from kvpass.eval import niah

    cell_list = niah.cells(args.policies, args.budgets, args.modes, reference=args.reference)
    niah.run(loaded, niah_specs(args, loaded), cell_list, store, args.max_new_tokens,
             shard=args.shard or (0, 1), batch=args.batch)


def run_lm(args: argparse.Namespace, store, loaded) -> None:
    from kvpass.eval import lm

    configs = [(p, b) for b in args.budgets for p in args.policies]       # budget-major, as niah
    lm.run(loaded, lm_segments(args), configs, store, args.probes, shard=args.shard or (0, 1))


def check_eval_options(args: argparse.Namespace) -> None:
    """The numeric options of ``kvpass eval niah | ppl | fidelity | leaderboard`` (those the command has)."""
    from kvpass.validation import check_option

    at_least = {"--jobs": ("jobs", 1), "--needles": ("needles", 1), "--max-new-tokens": ("max_new_tokens", 1),
                "--batch": ("batch", 1), "--prefix": ("prefix", 1), "--steps": ("steps", 1),
                "--segments": ("segments", 1), "--probes": ("probes", 0)}
    for option, (name, low) in at_least.items():
        if hasattr(args, name):
            value = getattr(args, name)
            check_option(option, value >= low, value, f"an int >= {low}")
    if hasattr(args, "lengths"):
        check_option("--lengths", all(n >= 1 for n in args.lengths), args.lengths, "token counts >= 1")
    if hasattr(args, "depths"):
        check_option("--depths", all(0.0 <= d <= 1.0 for d in args.depths), args.depths, "depths in [0, 1]")


def cmd_eval(args: argparse.Namespace) -> int:
    from kvpass.eval import report
    from kvpass.eval.common import selected_cases

    _apply_quick(args)
    check_policies_and_budgets(args.policies, args.budgets)
    check_eval_options(args)
    command = args.eval_command
    path, store = _store(args, "quality" if command == "leaderboard" else "lm" if command in ("ppl", "fidelity")
                         else command)
    if args.report_only:
        pass
    elif args.jobs > 1 and args.shard is None:
        _spawn(args, path)
        path, store = _store(args, "quality" if command == "leaderboard" else "lm" if command in ("ppl", "fidelity")
                             else command)
    else:
        loaded = _load(args)
        part = getattr(args, "part", "all")
        if command == "niah" or (command == "leaderboard" and part in ("all", "niah")):
            run_niah(args, store, loaded)
        if command in ("ppl", "fidelity") or (command == "leaderboard" and part in ("all", "lm")):
            run_lm(args, store, loaded)
        if args.shard is not None or part != "all":
            return 0
    out, model = Path(args.out_dir), model_label(args.model)
    if command == "niah":
        md, _ = report.niah_outputs(selected_cases(store, args, "niah"), out, model)
        print(md.read_text(encoding="utf-8"))
    elif command in ("ppl", "fidelity"):
        cases = selected_cases(store, args, "lm")
        png = (report.nll_plot(cases, out / f"ppl-{model}.png", f"{model}: cumulative NLL by position")
               if command == "ppl" else
               report.fidelity_plot(cases, out / f"fidelity-{model}.png", f"{model}: attention fidelity per layer"))
        print(report.lm_markdown(cases) + f"\nplot: {png}")
    else:
        from kvpass.eval.leaderboard import write_leaderboard

        md = write_leaderboard(args, store, out, model)
        print(md.read_text(encoding="utf-8"))
    return 0


def add_eval_parser(sub) -> None:
    """Register ``kvpass eval`` and its subcommands (called from ``kvpass.cli.COMMANDS``)."""
    p = sub.add_parser("eval", help="quality against the full cache: niah, ppl, fidelity, leaderboard")
    esub = p.add_subparsers(dest="eval_command", required=True)
    for name, text, lm, nh in [
        ("niah", "needle in a haystack: length x depth grid, both modes, heatmaps", False, True),
        ("ppl", "perplexity with teacher forcing through decode steps, cumulative NLL plot", True, False),
        ("fidelity", "per-layer attention-output error and top-B recall against the full cache", True, False),
        ("leaderboard", "niah + ppl + fidelity for policies x budgets -> quality-<model>.md/.json", True, True),
    ]:
        sp = esub.add_parser(name, help=text, description=text)
        _common(sp, lm=lm, niah=nh)
        sp.set_defaults(func=cmd_eval)
    add_suite_parser(esub)
