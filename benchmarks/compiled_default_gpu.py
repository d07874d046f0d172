"""Compiled decode by default (issue 29 part 1): ``kvpass.apply`` + ``generate``, no user compile, on a GPU.

    PYTHONUNBUFFERED=1 python benchmarks/compiled_default_gpu.py --out benchmarks/results/compiled-default-<gpu>.json
    python benchmarks/compiled_default_gpu.py --smoke --out /tmp/compiled-smoke.json     # CPU, tiny model, < 1 min

A Llama-3.1-8B-shaped model (32 layers, ``--layers`` fewer) with random bf16 weights (materialised on the GPU,
``benchmarks/chunked_prefill_gpu.build_model``), budget 0.2, for d2o, streamingllm and the default policy
(``kvpass.policies.DEFAULT_POLICY``), each through plain ``kvpass.apply(model, policy, 0.2)`` (on CUDA that
compiles the decode step: docs/compiled-decode.md):

* ``ms_per_token``: a ``--prompt`` (32k) prompt at batch 1, ``KVPassModel.start``, ``--warmup`` greedy steps
  (the compilation, the CUDA-graph captures, the first compressions), then ``--steps`` steps timed with CUDA
  events (whole compression periods: 64 steps by default, a multiple of every interval here);
  ``generate_ms_per_token`` and ``ttft_s``: through ``generate`` (``generate_speed``: TTFT the median of 3
  one-token calls; per token, a repeated call of ``--generate-new`` (513) tokens, which replays the graphs the
  first call at that length captured, less the TTFT; the first call's own figure and its captures beside it.
  Before 2026-11-26 it was the difference of a 2-token and a 130-token call, which held the longer call's
  captures; until 10b4ecb (2026-11-27) the call had ``--steps`` + 1 tokens, 129 in the commands of the results, where 30 ms
  between two prefills moved a token's figure by 4%: two H100 runs read 1.150x and 1.095x for one policy whose
  event-timed steps agreed to 0.1%);
* the floor: (weight bytes a step reads + the cache bytes it holds) / the measured copy bandwidth, the
  formula and code of benchmarks/speed.py (``benchmarks.bench.models.weight_bytes_per_step``,
  ``benchmarks.bench.timing.copy_bandwidth``; cache bytes from ``last_report.cache_bytes``), and
  ``over_floor`` = ms_per_token / floor (issue 29's target: <= 1.15);
* ``compile``: the model's ``compile_report`` (every compilation: batch, seconds, whether the capacity was
  symbolic).

Then the sweep: ``--sweep`` (100) prompts of seeded random lengths in [1k, 32k] (``--sweep-min``/``--sweep-max``),
``--sweep-new`` (4) new tokens each, batch 1, one model of ``--sweep-policy`` (default: the default policy),
counting compilations (target: <= 8 in all; by design 1) and their seconds, and every prompt's wall time.
Where the sweep's policy is one of the speed rows', the sweep continues with that row's model (compiled there:
``compilations`` counts what the sweep's prompts added, ``compilations_in_all`` the model's whole count).

``--batch N --no-generate --sweep 0`` measures the large-batch rows instead (issue 29: d2o's tokens/s at its
largest batch against streamingllm's, ``tokens_per_s_over_streamingllm``; rows prefilled one at a time).

No new part (nor sweep prompt) starts after ``--time-limit`` seconds (default 300: about six minutes of device time with the model
build); what is left is recorded as skipped. ``--layers 24`` cuts every part's time by a quarter (the JSON says
how many layers ran: ``config.layers``). A row still running after ``--row-watchdog`` seconds (240) prints every
thread's stack to stderr, and again every as many seconds, until it ends.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import random
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if "--smoke" in sys.argv:                 # Triton decides at import whether to interpret its kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import kvpass  # noqa: E402
from benchmarks.bench.models import LLAMA_8B, TINY_LLAMA, weight_bytes_per_step  # noqa: E402
from benchmarks.bench.timing import copy_bandwidth, gpu_name, slug, timed  # noqa: E402
from benchmarks.chunked_prefill_gpu import _Clock, build_model  # noqa: E402
from kvpass.policies import DEFAULT_POLICY  # noqa: E402
from kvpass.rewrites import capture_model  # noqa: E402


def random_ids(vocab: int, tokens: int, seed: int, device: torch.device, batch: int = 1) -> torch.Tensor:
    return torch.randint(1, vocab, (batch, tokens), generator=torch.Generator().manual_seed(seed)).to(device)


def decode_speed(kv, ids: torch.Tensor, warmup: int, steps: int, device: torch.device) -> dict:
    """ms per greedy decode step after ``warmup`` steps (CUDA events on CUDA), and the cache bytes then held. The
    warm-up covers at least one compression period (the policy's ``interval`` + 4 steps): the first decode-time
    compression captures the compressing step's CUDA graph, a one-time cost (timed, it made d2o[interval=64] at
    batch 32 read 28.7 ms a step for ~13)."""
    warmup = max(warmup, getattr(kv.policy, "interval", 1) + 4)
    session = kv.start(ids, max_new_tokens=warmup + steps + 1)
    tok = session.logits.argmax(-1)
    for _ in range(warmup):
        tok = session.step(tok).argmax(-1)
    clock = _Clock(device)
    clock.start()
    for _ in range(steps):
        tok = session.step(tok).argmax(-1)
    seconds = clock.stop()
    report = session.report()
    return {"ms_per_token": seconds / steps * 1e3, "warmup_steps": warmup, "cache_bytes": report.cache_bytes,
            "full_cache_bytes": report.full_cache_bytes, "compressions": report.compressions,
            "layer_budgets_max": max(report.layer_budgets.values(), default=None)}


def generate_speed(kv, ids: torch.Tensor, new: int, device: torch.device) -> dict:
    """Through ``generate``, after the event-timed steps (so Triton, cuBLAS and Inductor are warm):

    * ``ttft_s``: the median of 3 calls of one token (no decode step);
    * a first call of ``new`` tokens at this length (a layout the model has not kept: it builds its buffers
      and captures its decode step's CUDA graphs, ``first_call``: wall seconds, captures and their seconds);
    * the same call again (``repeat_call``): it runs in the buffers the first kept (``reused_buffers``) and
      replays its graphs (docs/compiled-decode.md);
    * ``generate_ms_per_token`` = (repeat call - TTFT) / (new - 1): what a token costs in a call of a layout
      seen before; ``generate_ms_per_token_first_call`` the same from the first call, captures included.
    """
    def gen(n: int) -> float:
        return timed(device, lambda: kv.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=[]))

    def call(n: int) -> dict:
        seconds = gen(n)
        rep = kv.last_report
        return {"seconds": seconds, "graph_captures": rep.graph_captures, "capture_seconds": rep.capture_seconds,
                "reused_buffers": rep.reused_buffers, "compilations": rep.compilations}

    ttft = statistics.median(gen(1) for _ in range(3))
    first, repeat = call(new), call(new)
    return {"ttft_s": ttft, "first_call": first, "repeat_call": repeat, "new_tokens": new,
            "generate_ms_per_token": (repeat["seconds"] - ttft) / (new - 1) * 1e3,
            "generate_ms_per_token_first_call": (first["seconds"] - ttft) / (new - 1) * 1e3}


def sweep(kv, vocab: int, count: int, lo: int, hi: int, new: int, seed: int, device: torch.device,
          deadline: float) -> dict:
    """``count`` prompts of random lengths in [lo, hi] through ``generate``: compilations and wall times."""
    rng = random.Random(seed)
    lengths = [rng.randint(lo, hi) for _ in range(count)]
    before = kv.compile_report["compilations"]
    rows = []
    for i, n in enumerate(lengths):
        if time.monotonic() > deadline:
            break
        started = time.perf_counter()
        kv.generate(random_ids(vocab, n, seed + i, device), max_new_tokens=new, do_sample=False, eos_token_id=[])
        rep = kv.last_report
        rows.append({"prompt": n, "seconds": time.perf_counter() - started, "compilations": rep.compilations,
                     "compile_seconds": rep.compile_seconds, "prefill_seconds": rep.prefill_seconds,
                     "graph_captures": rep.graph_captures, "capture_seconds": rep.capture_seconds,
                     "reused_buffers": rep.reused_buffers})
    report = kv.compile_report
    captures = sorted(r["capture_seconds"] for r in rows)
    return {"policy": kv.policy.name, "prompts_asked": count, "prompts_run": len(rows), "new_tokens": new,
            "graph_captures": sum(r["graph_captures"] for r in rows),
            "capture_seconds_median": captures[len(captures) // 2] if captures else None,
            "capture_seconds_max": captures[-1] if captures else None,
            "length_range": [lo, hi], "compilations": report["compilations"] - before,
            "compilations_in_all": report["compilations"], "compile": report, "rows": rows,
            **({"skipped": "time"} if len(rows) < count else {})}


def watch_row(seconds: float) -> None:
    """From now on, every ``seconds`` until ``faulthandler.cancel_dump_traceback_later()``, print every thread's
    stack to the process's stderr (0: off). A row that stalls then shows where: one that did, on an H200 at 0ec1401
    (2026-12-01), left only an idle GPU behind (CHANGELOG.md)."""
    if seconds > 0 and sys.__stderr__ is not None:
        faulthandler.dump_traceback_later(seconds, repeat=True, file=sys.__stderr__)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, a 2-layer model, short prompts (compile=True)")
    ap.add_argument("--out", default=None, help="a .json file or a directory (default $OUT, else .)")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 32; 2 with --smoke)")
    ap.add_argument("--budget", type=float, default=0.2)
    ap.add_argument("--policies", default=f"d2o,streamingllm,{DEFAULT_POLICY}",
                    help="comma-separated policy specs (a spec's own commas inside [] are kept)")
    ap.add_argument("--prompt", type=int, default=None, help="the speed rows' prompt (default 32768; 192 smoke)")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--generate-new", type=int, default=None,
                    help="new tokens of the timed generate call (default 513; --steps + 1 with --smoke): the longer, "
                         "the less a prefill's run-to-run spread moves the per-token figure")
    ap.add_argument("--sweep", type=int, default=None, help="random-length prompts (default 100; 6 smoke)")
    ap.add_argument("--sweep-min", type=int, default=None)
    ap.add_argument("--sweep-max", type=int, default=None)
    ap.add_argument("--sweep-new", type=int, default=4)
    ap.add_argument("--sweep-policy", default=DEFAULT_POLICY)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=1,
                    help="rows of the speed rows (prefilled one row at a time; tokens_per_s = batch / time a step)")
    ap.add_argument("--no-generate", action="store_true", help="skip the generate timing (TTFT x3 at large batch)")
    ap.add_argument("--time-limit", type=float, default=300.0, help="no new part starts after this many seconds")
    ap.add_argument("--row-watchdog", type=float, default=240.0,
                    help="while one policy's row runs longer than this many seconds, print every thread's stack to "
                         "stderr, again every as many seconds (0: off); a row that stalls then says where")
    args = ap.parse_args(argv)
    started = time.monotonic()
    deadline = started + args.time_limit
    smoke = args.smoke
    device = torch.device("cpu" if smoke or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    base = TINY_LLAMA if smoke else LLAMA_8B
    layers = args.layers or base["num_hidden_layers"]
    prompt = args.prompt or (192 if smoke else 32768)
    warmup = args.warmup if args.warmup is not None else (4 if smoke else 24)
    steps = args.steps or (16 if smoke else 64)
    generate_new = args.generate_new or (steps + 1 if smoke else 513)
    count = args.sweep if args.sweep is not None else (6 if smoke else 100)
    lo, hi = args.sweep_min or (16 if smoke else 1024), args.sweep_max or (256 if smoke else 32768)
    context = max(prompt, hi) + max(warmup + steps, generate_new) + 64
    compile_arg = True if device.type == "cpu" else None      # None: kvpass's default (compiled on CUDA)
    policies = split_specs(args.policies)

    results: dict = {"config": {"smoke": smoke, "device": gpu_name(device) if device.type == "cuda" else "cpu",
                                "dtype": str(dtype), "layers": layers, "model_layers": base["num_hidden_layers"],
                                "budget": args.budget, "prompt": prompt, "batch": args.batch, "warmup": warmup,
                                "steps": steps, "generate_new": generate_new, "compile_argument": compile_arg, "policies": policies,
                                "torch": torch.__version__, "argv": sys.argv[1:] if argv is None else argv}}
    t0 = time.monotonic()
    model = build_model({**base, "num_hidden_layers": layers}, device, dtype, context)
    weights = weight_bytes_per_step(model)
    bandwidth = copy_bandwidth(device, (1 << 30) if device.type == "cuda" else (1 << 24))
    captured = capture_model(model)
    results["setup"] = {"build_and_capture_s": time.monotonic() - t0, "weight_bytes": weights,
                        "copy_bandwidth_GBps": bandwidth / 1e9}
    print(f"[compiled-default] setup {results['setup']}", flush=True)

    ids = random_ids(model.config.vocab_size, prompt, args.seed, device, args.batch)
    rows, sweep_model = {}, None
    for spec in policies:
        if time.monotonic() > deadline:
            rows[spec] = {"skipped": "time"}
            continue
        row: dict = {}
        t_row = time.monotonic()
        watch_row(args.row_watchdog)
        try:
            kv = kvpass.apply(model, spec, args.budget, captured=captured, compile=compile_arg)
            row["compiled"] = kv.compiled_decode is not None
            if args.batch > 1:
                kv.prefill_rows = 1             # one row's full K, V at a time: the batch is bounded by the caches
            if device.type == "cuda":           # this row's peak, not the earlier rows'
                torch.cuda.reset_peak_memory_stats(device)
            row.update(decode_speed(kv, ids, warmup, steps, device))
            row["tokens_per_s"] = args.batch / row["ms_per_token"] * 1e3
            if device.type == "cuda":
                row["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            if not args.no_generate:
                row.update(generate_speed(kv, ids, generate_new, device))
            floor = (weights + row["cache_bytes"]) / bandwidth
            row["floor_ms"] = floor * 1e3
            row["over_floor"] = row["ms_per_token"] / row["floor_ms"]
            if "generate_ms_per_token" in row:
                row["generate_over_floor"] = row["generate_ms_per_token"] / row["floor_ms"]
            row["compile"] = kv.compile_report
            if spec == args.sweep_policy:
                sweep_model = kv                  # the sweep goes on with this model: its graph is compiled
        except Exception as exc:  # noqa: BLE001  (record and go on with the next policy)
            row["error"] = "".join(traceback.format_exception(exc))[-3000:]
        finally:
            faulthandler.cancel_dump_traceback_later()
        row["wall_s"] = time.monotonic() - t_row
        rows[spec] = row
        print(f"[compiled-default] {spec}: {row}", flush=True)
        kv = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    results["speed"] = rows
    base = rows.get("streamingllm", {}).get("tokens_per_s")
    if base:
        results["tokens_per_s_over_streamingllm"] = {s: r["tokens_per_s"] / base for s, r in rows.items()
                                                     if "tokens_per_s" in r}

    if time.monotonic() > deadline:
        results["sweep"] = {"skipped": "time"}
    else:
        try:
            kv = sweep_model or kvpass.apply(model, args.sweep_policy, args.budget, captured=captured,
                                             compile=compile_arg)
            results["sweep"] = sweep(kv, model.config.vocab_size, count, lo, hi, args.sweep_new, args.seed, device,
                                     deadline)
        except Exception as exc:  # noqa: BLE001
            results["sweep"] = {"error": "".join(traceback.format_exception(exc))[-3000:]}
    print(f"[compiled-default] sweep: { {k: v for k, v in results['sweep'].items() if k != 'rows'} }", flush=True)
    results["wall_s"] = time.monotonic() - started

    out = Path(args.out or os.environ.get("OUT", "."))
    if out.suffix != ".json":
        name = "compiled-default-" + ("smoke" if smoke else slug(results["config"]["device"])) + ".json"
        out = out / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1, default=str) + "\n")
    print(f"[compiled-default] wrote {out}", flush=True)
    errors = [s for s, r in rows.items() if "error" in r] + (["sweep"] if "error" in results["sweep"] else [])
    return 1 if errors else 0


def split_specs(text: str) -> list[str]:
    """'d2o,snapkv[kernel=31,window=8]' -> ['d2o', 'snapkv[kernel=31,window=8]'] (commas inside [] kept)."""
    specs, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            specs.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return [s for s in [*specs, cur.strip()] if s]


if __name__ == "__main__":
    sys.exit(main())
