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


# An integer budget below this many entries per layer holds too little to answer from: the built-in question alone
# is about 20 tokens, and the sinks + recent window of most policies take 8-36 (``kvpass policies``).
SMALL_BUDGET = 32


def _check_generate_options(args: argparse.Namespace) -> None:
    """Every generate option checked before any model loads (rule ``cli.value``)."""
    from kvpass.validation import check_option, check_readable_file

    if args.prompt_file:
        check_readable_file("--prompt-file", args.prompt_file)
    check_option("--max-new-tokens", args.max_new_tokens >= 1, args.max_new_tokens, "an int >= 1")
    check_option("--context-tokens", args.context_tokens >= 1, args.context_tokens, "an int >= 1")
    check_option("--depth", 0.0 <= args.depth <= 1.0, args.depth, "a number in [0, 1]")
    check_option("--tp", args.tp is None or args.tp >= 1, args.tp, "an int >= 1")
    check_option("--temperature", args.temperature > 0, args.temperature, "a number > 0")
    check_option("--top-k", args.top_k is None or args.top_k >= 0, args.top_k, "an int >= 0 (0: off)")
    check_option("--top-p", args.top_p is None or 0 < args.top_p <= 1, args.top_p, "a number in (0, 1]")
    check_option("--repetition-penalty", args.repetition_penalty > 0, args.repetition_penalty, "a number > 0")
    sampling_only = [name for name, value in (("--temperature", args.temperature != 1.0), ("--top-k", args.top_k),
                                               ("--top-p", args.top_p), ("--sampling-seed", args.sampling_seed))
                     if value is not None and value is not False]
    check_option(sampling_only[0] if sampling_only else "--sample", args.sample or not sampling_only,
                 "given without --sample", "used with --sample (greedy decoding takes no sampling options)")


class _Progress:
    """A streamer (``generate(streamer=...)``) that reports on stderr: the prefill's end (the first ``put``, the
    prompt) and each decoded token on one line."""

    def __init__(self, prompt_tokens: int, max_new_tokens: int, show: bool) -> None:
        self.start, self.show, self.max_new = time.perf_counter(), show, max_new_tokens
        self.tokens = -1                     # the first put is the prompt
        if show:
            print(f"prefilling {prompt_tokens} tokens ...", file=sys.stderr, flush=True)

    def put(self, ids) -> None:
        self.tokens += 1
        if not self.show:
            return
        if self.tokens == 0:
            print(f"prefilled in {time.perf_counter() - self.start:.1f} s; decoding ...", file=sys.stderr, flush=True)
            self.start = time.perf_counter()
        else:
            print(f"\rdecoded {self.tokens}/{self.max_new} tokens ({time.perf_counter() - self.start:.1f} s)",
                  end="", file=sys.stderr, flush=True)

    def end(self) -> None:
        if self.show and self.tokens > 0:
            print(file=sys.stderr, flush=True)


def _budget_warning(args: argparse.Namespace, policy, tokens: int) -> str | None:
    """A warning where the budget leaves a layer fewer than ``SMALL_BUDGET`` entries of a longer sequence."""
    import kvpass

    if not policy.compresses:
        return None
    keep = kvpass.budget_tokens(args.budget, tokens)
    if keep >= min(SMALL_BUDGET, tokens):
        return None
    given = f"budget {args.budget}" + (f" ({keep} entries)" if isinstance(args.budget, float) else "")
    return (f"warning: {given} keeps {keep} of {tokens} tokens per layer; below {SMALL_BUDGET} entries a layer "
            "cannot hold the question and what it asks about, so expect an unrelated answer. An int --budget is a "
            "token count: for a fraction write e.g. --budget 0.2")


def _cache_line(r, kv_model, max_new_tokens: int) -> str:
    """The report's cache line, and where the cache holds more than a full one the reason: slots reserved for new
    tokens not generated, and the position and log-weight kvpass keeps per slot."""
    line = (f"cache bytes:       {r.cache_bytes / 2**20:.2f} MiB compressed vs {r.full_cache_bytes / 2**20:.2f} MiB "
            f"full ({r.compression_ratio:.1%})")
    if r.cache_bytes <= r.full_cache_bytes:
        return line
    heads = sum(s.n_kv_heads for s in kv_model.graphs.sites) * r.batch
    kv_slot = sum(2 * s.n_kv_heads * s.head_dim for s in kv_model.graphs.sites) * r.batch * kv_model.dtype.itemsize
    if not kv_model.policy.compresses:
        slots = r.prompt_tokens + max_new_tokens
        unused = (slots - r.prompt_tokens - r.new_tokens) * kv_slot / r.full_cache_bytes
        meta = 12 * heads * slots / r.full_cache_bytes
        line += (f"\n                   (more than full: the cache holds prompt + max_new_tokens = {slots} slots a layer, "
                 f"{slots - r.prompt_tokens - r.new_tokens} not used as generation stopped early (+{unused:.1%}), "
                 f"and kvpass keeps a position and a log-weight per slot (+{meta:.1%}))")
    else:
        line += ("\n                   (more than full: the budget plus the policy's interval and per-slot statistics "
                 "exceed what the sequence needs; lower --budget)")
    return line


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    import kvpass
    from kvpass.models import load_model

    policy_kwargs = parse_policy_args(args.policy_args)
    policy = kvpass.get_policy(args.policy, **policy_kwargs)     # fail fast, before loading the model
    kvpass.check_budget(args.budget)
    _check_generate_options(args)
    device = "cpu"
    show = not args.quiet
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
    if show:
        print(f"loading {args.model} ...", file=sys.stderr, flush=True)
    model, tokenizer = load_model(args.model, device=device)
    print(f"loaded {args.model} ({model.config.model_type}, {model.config.num_hidden_layers} layers) "
          f"in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    ids, answer = _prompt_ids(args, tokenizer)
    warning = _budget_warning(args, policy, len(ids) + args.max_new_tokens)
    if warning:
        print(warning, file=sys.stderr)
    t0 = time.perf_counter()
    if show:
        print(f"rewriting {model.config.num_hidden_layers} layers for {policy.name} (tracing the model) ...",
              file=sys.stderr, flush=True)
    kv_model = kvpass.apply(model, policy=args.policy, budget=args.budget, tp=args.tp,
                            compile={"auto": None, "on": True, "off": False}[args.compile], kv_dtype=args.kv_dtype,
                            **policy_kwargs)
    print(f"rewrote {len(kv_model.graphs.sites)} attention sites in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    sampling = dict(do_sample=True, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p) \
        if args.sample else dict(do_sample=False)
    if args.sample and args.sampling_seed is not None:
        sampling["generator"] = torch.Generator(kv_model.device).manual_seed(args.sampling_seed)
    out = kv_model.generate(torch.tensor([ids], device=kv_model.device), max_new_tokens=args.max_new_tokens,
                            repetition_penalty=args.repetition_penalty,
                            streamer=_Progress(len(ids), args.max_new_tokens, show), **sampling)
    _print_report(args, kv_model, tokenizer.decode(out[0, len(ids):], skip_special_tokens=True).strip(), answer)
    return 0


def _prompt_ids(args: argparse.Namespace, tokenizer) -> tuple[list[int], str | None]:
    """The prompt's token ids (--prompt-file as the user message, else the built-in needle prompt) and the
    expected answer (None for a file)."""
    from kvpass.prompts import chat_ids

    if args.prompt_file:
        text = open(args.prompt_file, encoding="utf-8").read()
        return chat_ids(tokenizer, [{"role": "user", "content": text}]), None
    from kvpass.eval.tasks.single_needle import demo_case

    case = demo_case(tokenizer, args.context_tokens, args.depth, args.seed)
    answer = case.answers[0]
    print(f"built-in prompt: {args.context_tokens} tokens of Paul Graham essays, passphrase "
          f"{answer!r} hidden at depth {args.depth:.0%} (the quality suite's single needle)", file=sys.stderr)
    print(f"prompt ends:       ...{tokenizer.decode(case.question_ids[-12:]).strip()}")
    return case.context_ids + case.question_ids, answer


def _print_report(args: argparse.Namespace, kv_model, text: str, answer: str | None) -> None:
    """The answer and the last generate's report (``KVPassModel.last_report``) on stdout."""
    from kvpass.eval.scoring import score

    r = kv_model.last_report
    print(f"answer:            {text}")
    if answer is not None:
        print(f"expected:          {answer}  ({'correct' if score(text, [answer], 'all') else 'wrong'})")
    if kv_model.policy.compresses:
        print(f"policy:            {r.policy} at budget {args.budget} = {r.budget_tokens} entries per layer")
    else:
        print(f"policy:            {r.policy} (every token kept; the budget does not apply)")
    if args.sample:
        top_k = args.top_k if args.top_k is not None else "50 (transformers' default)"
        print(f"sampling:          temperature {args.temperature}, top-k {top_k}, top-p {args.top_p or 1.0}"
              + (f", seed {args.sampling_seed}" if args.sampling_seed is not None else ""))
    if args.tp and args.tp > 1:
        print(f"tensor parallel:   {args.tp} processes; cache bytes below are per process (its 1/{args.tp} of the KV heads)")
    if r.full_heads:
        heads = ", ".join(f"L{layer}.H{h}" for layer, hs in r.full_heads.items() for h in hs)
        print(f"full-cache heads:  {heads} (calibration, §1.10); the other heads keep "
              f"{min(r.layer_budgets.values())} entries")
    if r.compiled:
        print(f"compiled decode:   {r.compilations} compilation(s), {r.compile_seconds:.1f} s (once per model)")
    if r.kv_dtype is not None:
        print(f"cache entries:     {r.kv_dtype} codes + a scale per (token, KV head) ({kv_model.dtype} scales)")
    print(f"prompt tokens:     {r.prompt_tokens}")
    print(_cache_line(r, kv_model, args.max_new_tokens))
    print(f"time:              prefill {r.prefill_seconds:.2f} s, {r.new_tokens} tokens at "
          f"{r.new_tokens / max(r.decode_seconds, 1e-9):.1f} tokens/s decode ({r.tokens_per_second:.1f} with prefill)")


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
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (with --sample; default 1)")
    p.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens (with --sample; "
                   "default: transformers' 50)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass in (0, 1] (with --sample)")
    p.add_argument("--sampling-seed", type=int, default=None, help="seed of the sampling generator (with --sample)")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="transformers' repetition penalty (> 0; 1: off)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("--tp", type=int, default=None,
                   help="tensor parallel over N processes: run under `torchrun --nproc-per-node N -m kvpass.cli`")
    p.add_argument("--kv-dtype", choices=("int8", "fp8_e4m3"), default=None,
                   help="store the cache's K, V as 8-bit codes with a scale per (token, KV head) (default: the "
                        "model's dtype; fp8_e4m3 needs CUDA compute capability 8.9+; docs/quantization.md)")
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
