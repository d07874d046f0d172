"""8-bit cache entries on one GPU: the largest batch that fits and its decode tokens/s at long contexts, and decode
ms/token at batch 1, fp8_e4m3 (``kvpass.apply(..., kv_dtype="fp8_e4m3")``) against the model's bf16 cache.

    PYTHONUNBUFFERED=1 python benchmarks/kv_dtype_throughput_gpu.py --contexts 32768 --out $OUT
    PYTHONUNBUFFERED=1 python benchmarks/kv_dtype_throughput_gpu.py --contexts 131072 --layers 8 --out $OUT
    python benchmarks/kv_dtype_throughput_gpu.py --tiny --out /tmp/kv-dtype-tiny.json      # CPU smoke, < 2 min

A Llama-3.1-8B-shaped model with random bf16 weights (``benchmarks/chunked_prefill_gpu.build_model``; ``--layers``
fewer decoder layers), budget ``--budget`` (0.2). Rows, per context of ``--contexts`` (default 32768 131072):

* ``transformers``: plain transformers' decode (its DynamicCache, eager): one row prefilled, its cache repeated to
  the batch (every row holds the context's K, V as a batch of prompts would), greedy steps;
* ``full/bf16``, ``default/bf16``, ``default/fp8``, ``guard/bf16``, ``guard/fp8``: ``kvpass.apply`` of ``full``, the
  default policy (``kvpass.policies.DEFAULT_POLICY``) and the D2O guard (``GUARD``), kv_dtype None or "fp8_e4m3",
  decode compiled as on CUDA by default, rows prefilled one at a time (``prefill_rows = 1``).

The largest batch: a batch-1 run gives the bytes a row holds (``last_report.cache_bytes``, or the cache's tensors
for transformers) and the peak above them; the batch the free memory then allows (``--memory-fraction`` of the
card) is tried, and 0.85x of it again while out of memory (``oom_tries`` records each). Its ``tokens_per_s`` = batch /
seconds per step: ``--steps`` greedy steps timed with CUDA events after ``--warmup`` steps (at least one compression
period: ``compiled_default_gpu.decode_speed``). ``batch1``: the same timing at batch 1 for every kvpass row
(``fp8_over_bf16`` = fp8's ms/token over bf16's, per policy). ``over_transformers``: tokens/s over transformers'
at its own largest batch. No row starts after ``--time-limit`` seconds (recorded as skipped). JSON to ``--out``
(a file or a directory; default $OUT).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if "--tiny" in sys.argv:                  # Triton decides at import whether to interpret its kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import kvpass  # noqa: E402
from benchmarks.bench.models import LLAMA_8B, TINY_LLAMA  # noqa: E402
from benchmarks.bench.timing import gpu_name, slug  # noqa: E402
from benchmarks.chunked_prefill_gpu import _Clock, build_model  # noqa: E402
from benchmarks.compiled_default_gpu import decode_speed, random_ids  # noqa: E402
from kvpass.policies import DEFAULT_POLICY  # noqa: E402
from kvpass.rewrites import capture_model  # noqa: E402

GUARD = "d2o[scores=window,window_kernel=31,merge_protect=0.5]"
# row name -> (policy spec, kv_dtype)
ROWS = {"full/bf16": ("full", None), "default/bf16": (DEFAULT_POLICY, None), "default/fp8": (DEFAULT_POLICY, "fp8_e4m3"),
        "guard/bf16": (GUARD, None), "guard/fp8": (GUARD, "fp8_e4m3")}


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def _peak(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def transformers_speed(model, ids: torch.Tensor, batch: int, warmup: int, steps: int, device: torch.device) -> dict:
    """Plain transformers' greedy decode at ``batch``: ``ids`` [1, T] prefilled once (its last logits only), its
    DynamicCache repeated to ``batch`` rows, ``warmup`` steps, then ``steps`` timed (CUDA events)."""
    with torch.no_grad():
        out = model(ids, use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
        cache.batch_repeat_interleave(batch)
        tok = out.logits[:, -1].argmax(-1).repeat(batch)[:, None]
        del out
        held = _allocated(device)

        def step(tok):
            logits = model(tok, past_key_values=cache, use_cache=True).logits
            return logits[:, -1].argmax(-1)[:, None]

        for _ in range(warmup):
            tok = step(tok)
        clock = _Clock(device)
        clock.start()
        for _ in range(steps):
            tok = step(tok)
        seconds = clock.stop()
    return {"ms_per_token": seconds / steps * 1e3, "held_bytes": held}


def kvpass_speed(kv, vocab: int, context: int, batch: int, warmup: int, steps: int, device: torch.device) -> dict:
    ids = random_ids(vocab, context, 0, device, batch)
    return decode_speed(kv, ids, warmup, steps, device)


def largest_batch(run, device: torch.device, per_row: int, base: int, total: int, max_batch: int) -> dict:
    """``run(batch)`` at the batch the memory allows (``total`` - ``base`` over ``per_row``), then 0.85x of it while
    out of memory. -> the last successful run's result with ``batch`` and ``oom_tries``."""
    batch = max(1, min(max_batch, (total - base) // max(per_row, 1)))
    tries = []
    while batch >= 1:
        _free(device)
        try:
            out = run(batch)
            out.update(batch=batch, oom_tries=tries, peak_memory_gib=_peak(device) / 2**30)
            return out
        except torch.OutOfMemoryError:
            tries.append(batch)
            batch = int(batch * 0.85) if batch > 1 else 0
    return {"error": "out of memory at batch 1", "oom_tries": tries}


def context_rows(model, captured, context: int, args, device: torch.device, deadline: float) -> dict:
    """Every row of ``ROWS`` and transformers at ``context``: batch 1, then the largest batch."""
    vocab = model.config.vocab_size
    total = int(torch.cuda.get_device_properties(device).total_memory * args.memory_fraction) \
        if device.type == "cuda" else 1 << 62
    rows: dict = {}
    for name in ["transformers", *ROWS]:
        if time.monotonic() > deadline:
            rows[name] = {"skipped": "time"}
            continue
        t0 = time.monotonic()
        row: dict = {}
        try:
            _free(device)
            weights = _allocated(device)
            if name == "transformers":
                ids = random_ids(vocab, context, 0, device)

                def run(batch, ids=ids):
                    return transformers_speed(model, ids, batch, args.warmup, args.steps, device)

                row["batch1"] = one = run(1)
                per_row = one["held_bytes"] - weights
            else:
                spec, kv_dtype = ROWS[name]
                kv = kvpass.apply(model, spec, args.budget if spec != "full" else 1.0, captured=captured,
                                  kv_dtype=kv_dtype, compile=None if device.type == "cuda" else False)
                kv.prefill_rows = 1          # one row's full K, V at a time: the batch is bounded by the caches

                def run(batch, kv=kv):
                    return kvpass_speed(kv, vocab, context, batch, args.warmup, args.steps, device)

                row["batch1"] = one = run(1)
                per_row = one["cache_bytes"]
            one["tokens_per_s"] = 1e3 / one["ms_per_token"]
            transient = max(_peak(device) - weights - per_row, 0)
            row["per_row_bytes"] = per_row
            row["largest"] = big = largest_batch(run, device, int(per_row * 1.1), weights + transient,
                                                 total, args.max_batch)
            if "ms_per_token" in big:
                big["tokens_per_s"] = big["batch"] / big["ms_per_token"] * 1e3
        except Exception as exc:  # noqa: BLE001  (recorded; the next row goes on)
            row["error"] = "".join(traceback.format_exception(exc))[-3000:]
        row["wall_s"] = round(time.monotonic() - t0, 1)
        rows[name] = row
        kv = None
        print(f"[kv-dtype] {context}: {name}: {json.dumps(row, default=str)[:600]}", flush=True)
    return rows


def summarize(rows: dict) -> dict:
    """tokens/s over transformers' at the largest batches, and fp8's batch-1 ms/token over bf16's per policy."""
    base = rows.get("transformers", {}).get("largest", {}).get("tokens_per_s")
    over = {n: r["largest"]["tokens_per_s"] / base for n, r in rows.items()
            if n != "transformers" and base and "tokens_per_s" in r.get("largest", {})}
    ratio = {}
    for policy in ("default", "guard"):
        fp8 = rows.get(f"{policy}/fp8", {}).get("batch1", {}).get("ms_per_token")
        bf16 = rows.get(f"{policy}/bf16", {}).get("batch1", {}).get("ms_per_token")
        if fp8 and bf16:
            ratio[policy] = fp8 / bf16
    return {"over_transformers": over, "fp8_over_bf16_batch1_ms": ratio}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="CPU, a 2-layer model, contexts 96 and 160 (smoke)")
    ap.add_argument("--contexts", type=int, nargs="+", default=None, help="context tokens (default 32768 131072)")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 32; 2 with --tiny)")
    ap.add_argument("--budget", type=float, default=0.2)
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps (default 16; 2 tiny)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 32; 4 tiny)")
    ap.add_argument("--max-batch", type=int, default=None, help="largest batch tried (default 512; 3 tiny)")
    ap.add_argument("--memory-fraction", type=float, default=0.92, help="of the card's memory the batch may take")
    ap.add_argument("--time-limit", type=float, default=540.0, help="no row starts after this many seconds")
    ap.add_argument("--out", default=None, help="a .json file or a directory (default $OUT, else .)")
    args = ap.parse_args(argv)
    started = time.monotonic()
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    base = TINY_LLAMA if args.tiny else LLAMA_8B
    contexts = args.contexts or ([96, 160] if args.tiny else [32768, 131072])
    args.warmup = args.warmup if args.warmup is not None else (2 if args.tiny else 16)
    args.steps = args.steps or (4 if args.tiny else 32)
    args.max_batch = args.max_batch or (3 if args.tiny else 512)
    layers = args.layers or base["num_hidden_layers"]
    model = build_model({**base, "num_hidden_layers": layers}, device, dtype,
                        max(contexts) + args.warmup + args.steps + 64)
    captured = capture_model(model)
    results: dict = {"config": {"tiny": args.tiny, "device": gpu_name(device) if device.type == "cuda" else "cpu",
                                "dtype": str(dtype), "layers": layers, "model_layers": base["num_hidden_layers"],
                                "budget": args.budget, "contexts": contexts, "warmup": args.warmup,
                                "steps": args.steps, "max_batch": args.max_batch, "rows": ROWS,
                                "memory_fraction": args.memory_fraction, "torch": torch.__version__,
                                "argv": sys.argv[1:] if argv is None else argv}, "contexts": {}}
    deadline = started + args.time_limit
    for context in contexts:
        rows = context_rows(model, captured, context, args, device, deadline)
        results["contexts"][str(context)] = {"rows": rows, **summarize(rows)}
    results["wall_s"] = round(time.monotonic() - started, 1)
    out = Path(args.out or os.environ.get("OUT", "."))
    if out.suffix != ".json":
        out = out / ("kv-dtype-throughput-" + ("tiny" if args.tiny else slug(results["config"]["device"])) + ".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1, default=str) + "\n")
    print(f"[kv-dtype] wrote {out}", flush=True)
    errors = [n for c in results["contexts"].values() for n, r in c["rows"].items() if "error" in r]
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
