"""The speed benchmark (``benchmarks/speed.py``, ``kvpass bench``): the kernels and end-to-end decoding,
measured side by side in one run.

    python benchmarks/speed.py --out DIR            # on a GPU: <= 9 minutes, everything time-boxed
    python benchmarks/speed.py --out DIR --smoke    # on CPU: a tiny model, tiny shapes (CI runs this)

Sections, each guarded (an exception is recorded in the JSON and the next section runs) and each
time-boxed (items that would start after the section's deadline are recorded as skipped):

1. ``env``: GPU name, versions, and the device-to-device copy bandwidth (bytes read + written).
2. ``correctness``: every Triton op against its reference at real shapes, bf16 (relative error).
3. ``kernels``: decode attention over caches of 1k-64k entries x batch 1-32 (Hq=32, Hkv=8, D=128,
   Llama-3.1-8B), Triton vs torch SDPA over a dense cache of the same size vs a device copy of the
   same bytes, each replayed from a CUDA graph and timed by ``triton.testing.do_bench`` (median; it
   flushes L2 between runs); plus a small sweep of launch parameters at three sizes; plus ClusterKV's
   compression ops (cosine K-means assign and update, cluster gather from device or pinned host
   memory), each as bytes moved per second against a copy of as many bytes timed in the same run.
4. ``e2e``: a Llama-3.1-8B-shaped model with random bf16 weights (``transformers.LlamaConfig``, no
   hub), batch 1, prompts of 16k and 32k (64k with time left): plain transformers ``generate``
   with its full cache, kvpass ``full``, ``streamingllm`` at budget 0.2, and every other registered
   policy (``d2o``, ``chelsea``, ...). TTFT = a ``generate`` of one token (median of 3); time per output token =
   (time of N2 tokens - time of N1 tokens) / (N2 - N1), which cancels prefill and CUDA-graph capture;
   peak memory; cache bytes; the bandwidth floor (weight bytes read per step + KV bytes) / copy rate.

Writes ``speed-<gpu>.json``, ``speed-<gpu>.md`` and ``speed-<gpu>.png`` under ``--out`` and prints
the Markdown tables last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from benchmarks.bench.e2e import COMPILED_ROWS, THROUGHPUT_METHODS, VARIANTS, section_e2e, section_throughput
from benchmarks.bench.kernels import section_correctness, section_kernels
from benchmarks.bench.report import markdown, plot
from benchmarks.bench.timing import Deadline, copy_bandwidth, gpu_name, guarded, slug


def section_env(device: torch.device, smoke: bool) -> dict:
    import transformers

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    out = {"device": gpu_name(device), "torch": torch.__version__, "triton": triton_version,
           "transformers": transformers.__version__, "python": sys.version.split()[0]}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        out.update(sm_count=props.multi_processor_count, memory_gib=round(props.total_memory / 2**30, 1))
    out["copy_bytes_per_s"] = copy_bandwidth(device, (1 << 20) if smoke else (2 << 30))
    return out


def run(out: Path, smoke: bool = False, total_s: float = 450.0,
        sections: tuple[str, ...] = ("correctness", "kernels", "e2e", "throughput"),
        prompts: list[int] | None = None, budget: float = 0.2, methods: set[str] | None = None,
        max_batch: int = 32) -> dict:
    """Run the benchmark, write JSON, Markdown and PNG under ``out``; returns the results."""
    start = time.monotonic()
    device = torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu")
    if smoke and device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    total = Deadline(total_s)
    results: dict = {"smoke": smoke, "argv": sys.argv, "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    guarded(results, "env", lambda: section_env(device, smoke))
    copy_bw = results.get("env", {}).get("copy_bytes_per_s") or 1e12
    if prompts is None:
        prompts = [48, 80] if smoke else [16384, 32768, 65536]
    # time boxes, as fractions of what is left when the section starts (e2e takes the rest)
    boxes = {"correctness": 0.08, "kernels": 0.3, "e2e": 0.65 if "throughput" in sections else 1.0, "throughput": 1.0}
    for name in sections:
        box = Deadline(max(0.0, min(total.left() - 15.0, boxes[name] * (total.left() - 15.0))))
        if name == "correctness":
            guarded(results, name, lambda box=box: section_correctness(device, smoke, box))
        elif name == "kernels":
            guarded(results, name, lambda box=box: section_kernels(device, smoke, box, copy_bw))
        elif name == "e2e":
            guarded(results, name, lambda box=box: section_e2e(device, smoke, box, copy_bw, prompts, budget, methods))
        elif name == "throughput":
            wanted = tuple(m for m in THROUGHPUT_METHODS if methods is None or m in methods)
            guarded(results, name, lambda box=box, wanted=wanted: section_throughput(
                device, smoke, box, max(prompts), budget, wanted, max_batch=max_batch))
    results["total_seconds"] = round(time.monotonic() - start, 1)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"speed-{slug(results.get('env', {}).get('device', 'unknown'))}"
    Path(f"{stem}.json").write_text(json.dumps(results, indent=1, default=str))
    md = markdown(results)
    Path(f"{stem}.md").write_text(md)
    try:
        plot(results, Path(f"{stem}.png"))
    except Exception as exc:  # noqa: BLE001  (a plotting problem must not lose the numbers)
        print(f"[bench] plot failed: {exc!r}", flush=True)
    print(md, flush=True)
    return results


def _split_tp(argv: list[str]) -> tuple[int | None, list[str]]:
    """(the value of ``--tp N`` / ``--tp=N`` or None, the other arguments)."""
    tp, rest, i = None, [], 0
    while i < len(argv):
        if argv[i] == "--tp" and i + 1 < len(argv):
            tp, i = int(argv[i + 1]), i + 2
            continue
        if argv[i].startswith("--tp="):
            tp = int(argv[i].split("=", 1)[1])
        else:
            rest.append(argv[i])
        i += 1
    return tp, rest


SECTIONS = ("correctness", "kernels", "e2e", "throughput")


def bench_methods() -> set[str]:
    """Every name ``--methods`` may hold: the e2e section's rows (without their "kvpass-" prefix)."""
    import kvpass

    return ({"transformers", "streamingllm-eager"} | set(kvpass.POLICIES) | set(VARIANTS)
            | {f"{p}-compiled" for p in COMPILED_ROWS})


def _checked_options(args: argparse.Namespace) -> tuple[list[int] | None, set[str] | None]:
    """(prompt lengths, methods) from the command line, every option checked before any work
    (``kvpass.validation.check_option``: a KVPassError naming the option)."""
    from kvpass.validation import check_budget, check_option

    check_budget(args.budget)
    check_option("--total-s", args.total_s > 0, args.total_s, "a number of seconds > 0")
    check_option("--max-batch", args.max_batch >= 1, args.max_batch, "an int >= 1")
    sections = [s for s in args.sections.split(",") if s]
    check_option("--sections", bool(sections) and set(sections) <= set(SECTIONS), args.sections,
                 f"a comma-separated subset of {','.join(SECTIONS)}")
    prompts = None
    if args.prompts:
        parts = args.prompts.split(",")
        check_option("--prompts", all(p.strip().isdigit() and int(p) >= 1 for p in parts), args.prompts,
                     "comma-separated prompt lengths (ints >= 1)")
        prompts = [int(p) for p in parts]
    methods = set(args.methods.split(",")) if args.methods else None
    if methods is not None:
        unknown = sorted(methods - bench_methods())
        check_option("--methods", not unknown, ",".join(unknown),
                     f"comma-separated names among {', '.join(sorted(bench_methods()))}")
    return prompts, methods


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"), help="output folder")
    ap.add_argument("--smoke", action="store_true", help="tiny model and shapes on CPU (CI)")
    ap.add_argument("--total-s", type=float, default=450.0, help="wall-clock budget for all sections")
    ap.add_argument("--sections", default="correctness,kernels,e2e,throughput")
    ap.add_argument("--prompts", default=None, help="comma-separated prompt lengths (default 16k,32k,64k)")
    ap.add_argument("--budget", type=float, default=0.2)
    ap.add_argument("--methods", default=None,
                    help="comma-separated methods (transformers, full, streamingllm, d2o, chelsea, d2o-compiled, ...; "
                         "default all); the throughput section takes the uncompiled ones")
    ap.add_argument("--max-batch", type=int, default=32, help="largest batch the throughput section tries")
    ap.add_argument("--tp", type=int, default=None,
                    help="tensor parallel over N processes (under torchrun --nproc-per-node N): benchmarks/bench/tp.py")
    tp, rest = _split_tp(sys.argv[1:] if argv is None else list(argv))
    if tp is not None and tp > 1:              # its own sections and options (benchmarks/bench/tp.py)
        from benchmarks.bench.tp import main as tp_main
        return tp_main([*rest, "--tp", str(tp)])
    args = ap.parse_args(argv)
    prompts, methods = _checked_options(args)
    run(Path(args.out), args.smoke, args.total_s, tuple(s for s in args.sections.split(",") if s), prompts, args.budget,
        methods, args.max_batch)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
