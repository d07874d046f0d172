"""The ``kvpass`` command line: ``generate`` (the main job), ``policies``; more subcommands register
themselves in ``COMMANDS``."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable

from kvpass.budget import parse_budget
from kvpass.policies import DEFAULT_POLICY, POLICIES, Policy, parse_value, split_spec


def parse_policy_args(items: list[str]) -> dict[str, object]:
    """['sinks=8', 'interval=1'] -> {'sinks': 8, 'interval': 1} (ints, floats, true/false, else strings)."""
    out: dict[str, object] = {}
    for item in items:
        if "=" not in item:
            from kvpass.validation import refuse

            raise refuse("cli.set", got=item)
        name, value = item.split("=", 1)
        out[name] = parse_value(value)
    return out


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="smollm2, gemma3-270m, a .gguf file or a transformers directory")
    p.add_argument("--policy", default=DEFAULT_POLICY,
                   help=f"one of: {', '.join(sorted(POLICIES))}, or a spec name[key=value,...] "
                        f"(default {DEFAULT_POLICY})")
    p.add_argument("--budget", type=parse_budget, default=0.2,
                   help="fraction in (0, 1] of prompt + new tokens, or an int token count (default 0.2)")
    p.add_argument("--set", dest="policy_args", action="append", default=[], metavar="NAME=VALUE",
                   help="a policy hyperparameter, e.g. --set sinks=8 (repeatable)")


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    import kvpass
    from kvpass.eval.scoring import score
    from kvpass.models import load_model
    from kvpass.prompts import chat_ids
    from kvpass.validation import check_option, check_readable_file

    policy_kwargs = parse_policy_args(args.policy_args)
    kvpass.get_policy(args.policy, **policy_kwargs)              # fail fast, before loading the model
    kvpass.check_budget(args.budget)
    if args.prompt_file:
        check_readable_file("--prompt-file", args.prompt_file)
    check_option("--max-new-tokens", args.max_new_tokens >= 1, args.max_new_tokens, "an int >= 1")
    check_option("--context-tokens", args.context_tokens >= 1, args.context_tokens, "an int >= 1")
    check_option("--depth", 0.0 <= args.depth <= 1.0, args.depth, "a number in [0, 1]")
    check_option("--tp", args.tp is None or args.tp >= 1, args.tp, "an int >= 1")
    device = "cpu"
    if args.tp is not None and args.tp > 1:                 # one process per shard (torchrun), rank 0 prints
        if "RANK" not in os.environ:
            raise ValueError(f"--tp {args.tp} runs one process per shard: start it with "
                             f"`torchrun --nproc-per-node {args.tp} -m kvpass.cli generate --tp {args.tp} ...`")
        from kvpass.tensor_parallel import init_distributed
        rank, world, device = init_distributed()
        if world != args.tp:
            raise ValueError(f"--tp {args.tp} but torchrun started {world} processes")
        if rank:
            sys.stdout = sys.stderr = open(os.devnull, "w")  # noqa: SIM115  (for the process's life)
    t0 = time.perf_counter()
    model, tokenizer = load_model(args.model, device=device)
    print(f"loaded {args.model} ({model.config.model_type}, {model.config.num_hidden_layers} layers) "
          f"in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    answer = None
    if args.prompt_file:
        text = open(args.prompt_file, encoding="utf-8").read()
        ids = chat_ids(tokenizer, [{"role": "user", "content": text}])
    else:
        from kvpass.eval.tasks.single_needle import demo_case

        case = demo_case(tokenizer, args.context_tokens, args.depth, args.seed)
        ids = case.context_ids + case.question_ids
        answer = case.answers[0]
        print(f"built-in prompt: {args.context_tokens} tokens of Paul Graham essays, passphrase "
              f"{answer!r} hidden at depth {args.depth:.0%} (the quality suite's single needle)", file=sys.stderr)
        print(f"prompt ends:       ...{tokenizer.decode(case.question_ids[-12:]).strip()}")
    t0 = time.perf_counter()
    kv_model = kvpass.apply(model, policy=args.policy, budget=args.budget, tp=args.tp,
                            compile={"auto": None, "on": True, "off": False}[args.compile], **policy_kwargs)
    print(f"rewrote {len(kv_model.graphs.sites)} attention sites in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    out = kv_model.generate(torch.tensor([ids], device=kv_model.device), max_new_tokens=args.max_new_tokens, do_sample=False)
    text = tokenizer.decode(out[0, len(ids):], skip_special_tokens=True).strip()
    r = kv_model.last_report
    print(f"answer:            {text}")
    if answer is not None:
        print(f"expected:          {answer}  ({'correct' if score(text, [answer], 'all') else 'wrong'})")
    print(f"policy:            {r.policy} at budget {args.budget} = {r.budget_tokens} entries per layer")
    if args.tp and args.tp > 1:
        print(f"tensor parallel:   {args.tp} processes; cache bytes below are per process (its 1/{args.tp} of the KV heads)")
    if r.full_heads:
        heads = ", ".join(f"L{layer}.H{h}" for layer, hs in r.full_heads.items() for h in hs)
        print(f"full-cache heads:  {heads} (calibration, §1.10); the other heads keep "
              f"{min(r.layer_budgets.values())} entries")
    if r.compiled:
        print(f"compiled decode:   {r.compilations} compilation(s), {r.compile_seconds:.1f} s (once per model)")
    print(f"prompt tokens:     {r.prompt_tokens}")
    print(f"cache bytes:       {r.cache_bytes / 2**20:.2f} MiB compressed vs {r.full_cache_bytes / 2**20:.2f} MiB "
          f"full ({r.compression_ratio:.1%})")
    print(f"time:              prefill {r.prefill_seconds:.2f} s, {r.new_tokens} tokens at "
          f"{r.new_tokens / max(r.decode_seconds, 1e-9):.1f} tokens/s decode ({r.tokens_per_second:.1f} with prefill)")
    return 0


def cmd_policies(args: argparse.Namespace) -> int:
    shared = Policy.defaults()            # parameters every policy takes, listed once below the table
    rows = [(name, cls.section, cls.summary,
             ", ".join(f"{k}={v}" for k, v in cls.defaults().items() if k not in shared) or "-")
            for name, cls in sorted(POLICIES.items())]
    widths = [max(len(r[i]) for r in rows + [("policy", "spec", "what", "defaults")]) for i in range(3)]
    default_name, default_kwargs = split_spec(DEFAULT_POLICY)
    options = ", ".join(f"{k}={v}" for k, v in default_kwargs.items())
    print(f"{'policy':<{widths[0]}}  {'spec':<{widths[1]}}  {'what':<{widths[2]}}  defaults")
    for name, section, summary, defaults in rows:
        mark = (f" (default{' with ' + options if options else ''})") if name == default_name else ""
        print(f"{name:<{widths[0]}}  {section:<{widths[1]}}  {summary:<{widths[2]}}  {defaults}{mark}")
    print("spec: the section of docs/policies.md that says what the policy computes")
    print(f"every policy also takes {', '.join(f'{k}={v}' for k, v in shared.items())} "
          "(expand_kv_heads=true: cache per query head, G = Hq/Hkv times the memory; docs/policies.md §0.5)")
    return 0


def _generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="answer the built-in needle prompt (or --prompt-file) with a compressed cache")
    _add_model_args(p)
    p.add_argument("--prompt-file", help="a text file to use as the user message instead of the built-in prompt")
    p.add_argument("--context-tokens", type=int, default=2000, help="length of the built-in prompt (default 2000)")
    p.add_argument("--depth", type=float, default=0.5, help="where the passphrase hides, 0..1 (default 0.5)")
    p.add_argument("--seed", type=int, default=1, help="seed of the passphrase (default 1)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--tp", type=int, default=None,
                   help="tensor parallel over N processes: run under `torchrun --nproc-per-node N -m kvpass.cli`")
    p.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                   help="decode with Inductor's compiled graph: auto (default) on CUDA only, as kvpass.apply; a "
                        "one-off generate pays the compilation (docs/compiled-decode.md)")
    p.set_defaults(func=cmd_generate)


def _policies_parser(sub) -> None:
    p = sub.add_parser("policies", help="list the policies, their defaults and the spec section each implements")
    p.set_defaults(func=cmd_policies)


def _bench_parser(sub) -> None:
    # listed for --help only: main() runs the checkout's benchmarks/speed.py with the options that follow
    sub.add_parser("bench", help="GPU speed benchmark (kernels + end-to-end decode); `kvpass bench --help`")


def _eval_parser(sub) -> None:
    from kvpass.eval.cli import add_eval_parser

    add_eval_parser(sub)


def _calibrate_parser(sub) -> None:
    from kvpass.calibrate import add_calibrate_parser

    add_calibrate_parser(sub)


# Each entry adds one subcommand to the parser.
COMMANDS: list[Callable] = [_generate_parser, _policies_parser, _eval_parser, _calibrate_parser, _bench_parser]


def run_benchmark(argv: list[str]) -> int:
    """``kvpass bench ARGS``: ``python benchmarks/speed.py ARGS`` of the checkout kvpass runs from. The
    benchmark harnesses are not part of the installed library (a wheel has no ``benchmarks/``)."""
    import runpy
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "speed.py"
    if not script.is_file():
        print("kvpass: error: `kvpass bench` runs benchmarks/speed.py of a source checkout, and this kvpass "
              f"is installed without one ({script} is missing); clone the repository and run it there",
              file=sys.stderr)
        return 2
    saved = sys.argv
    sys.argv = [str(script), *argv]
    try:                                        # the script ends in SystemExit(its status), as when run itself
        runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv = saved
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpass", description="compressed KV caches for any decoder LLM")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:                   # its own options, passed through untouched
        return _reported(lambda: run_benchmark(argv[1:]))
    args = build_parser().parse_args(argv)
    args.argv = list(argv)                      # for commands that record how they were run
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    return _reported(lambda: args.func(args))


def _reported(command: Callable[[], int]) -> int:
    """Run a command; bad input (kvpass's refusals are ValueErrors / TypeErrors) and missing files become one
    line on stderr and exit code 2, not a traceback."""
    try:
        return command()
    except (ValueError, TypeError, FileNotFoundError) as err:
        print(f"kvpass: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
