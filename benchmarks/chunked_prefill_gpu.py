"""Peak GPU memory, TTFT and decode speed of chunked prefill (issue 29), one run per row.

    PYTHONUNBUFFERED=1 python benchmarks/chunked_prefill_gpu.py --out benchmarks/results/chunked-prefill-<gpu>.json
    python benchmarks/chunked_prefill_gpu.py --smoke --out /tmp/chunked-smoke.json     # CPU, tiny shapes, seconds

A Llama-3.1-8B-shaped model (hidden 4096, 32 layers, 32 query / 8 KV heads of 128, vocab 128256; ``--layers``
fewer) with random bf16 weights, built on the meta device and materialised on the GPU (seconds, not the
minutes of a random CPU init). Rows: prompts of 32k and 128k tokens at batch 1, and 128k at batch 8 (``--smoke``:
a 2-layer model, 96 and 160 tokens, chunk 32, batch 2);
``full`` prefilled in one piece (the baseline: weights + the whole cache), ``d2o`` and ``streamingllm`` at
budget 0.2 with ``prefill_chunk`` 4096 (``--chunk``), and ``d2o`` unchunked at batch 1 for comparison (order:
``plan``). A ``full`` row whose cache cannot fit the device is recorded as skipped, with the bytes it would need.

Per row: ``peak_gib`` (torch.cuda.max_memory_allocated over the prefill and the decode steps, reset before),
``weights_gib``, ``full_cache_gib`` (K, V of prompt + new tokens in every layer, bf16) and
``peak_over_full_cache`` = (peak - weights) / full cache (the issue's target at 128k: <= 0.35 for d2o and
streamingllm), ``ttft_s`` (``KVPassModel.start``: the prefill, its compressions and the first logits, CUDA
events), ``ms_per_token`` and ``tokens_per_s`` (CUDA events over ``--steps`` greedy decode steps after
``--warmup`` steps), and the report's ``peak_entries`` (most entries a layer held) and layer budgets. No new row
starts after ``--time-limit`` seconds (default 240, so the run stays near five minutes on an H200; the rows left
are recorded as skipped; ``--layers 16`` halves every row's time).

Runs from a plain checkout (the repository root goes on ``sys.path``, as benchmarks/speed.py).
"""

from __future__ import annotations

import argparse
import json
import os
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
from benchmarks.bench.models import LLAMA_8B, TINY_LLAMA  # noqa: E402


def plan(prompts: list[int], chunk: int, big_batch: int) -> list[tuple[int, int, str, int | None]]:
    """(prompt tokens, batch, policy, prefill_chunk or None) of every row, the issue's targets first (the longest
    prompt chunked at batch 1 against ``full``, then d2o at ``big_batch``; 0: no big-batch rows), then the shorter
    prompts, streamingllm at ``big_batch`` and d2o unchunked at the longest prompt. Rows without a chunk are the
    unchunked baselines."""
    top, rest = max(prompts), sorted(set(prompts) - {max(prompts)})
    rows = [(top, 1, "d2o", chunk), (top, 1, "streamingllm", chunk), (top, 1, "full", None)]
    if big_batch:
        rows += [(top, big_batch, "d2o", chunk), (top, big_batch, "full", None)]
    for prompt in rest:
        rows += [(prompt, 1, "full", None), (prompt, 1, "d2o", chunk), (prompt, 1, "streamingllm", chunk),
                 (prompt, 1, "d2o", None)]
    if big_batch:
        rows.append((top, big_batch, "streamingllm", chunk))
    return rows + [(top, 1, "d2o", None)]


def build_model(config_kwargs: dict, device: torch.device, dtype: torch.dtype, context: int):
    """A LlamaForCausalLM with random weights: built on the meta device, materialised on ``device`` with
    ``to_empty`` and filled there (normal(0, 0.02) matrices, unit norms), the rotary embedding rebuilt there."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(**{**config_kwargs, "max_position_embeddings": context}, attn_implementation="sdpa")
    config.eos_token_id, config.pad_token_id = None, 0
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(dtype)
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.fill_(1.0)                                 # RMSNorm weights
            else:
                p.normal_(0.0, 0.02, generator=gen)
        model.model.rotary_emb = LlamaRotaryEmbedding(config).to(device)     # inv_freq in fp32, as transformers
    model.eval()
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
    return model


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Clock:
    """Elapsed seconds between two points: CUDA events on CUDA, the host clock elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        if device.type == "cuda":
            self.a, self.b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        _sync(self.device)
        if self.device.type == "cuda":
            self.a.record()
        else:
            self.t0 = time.perf_counter()

    def stop(self) -> float:
        if self.device.type == "cuda":
            self.b.record()
            torch.cuda.synchronize(self.device)
            return self.a.elapsed_time(self.b) / 1e3
        return time.perf_counter() - self.t0


def full_cache_bytes(config, batch: int, tokens: int, elem: int) -> int:
    head_dim = config.hidden_size // config.num_attention_heads
    return 2 * batch * config.num_hidden_layers * config.num_key_value_heads * head_dim * tokens * elem


def run_row(kv, prompt: int, batch: int, chunk: int | None, warmup: int, steps: int, device: torch.device,
            weights: int) -> dict:
    model, policy, budget = kv.model, kv.policy.name, kv.budget
    ids = torch.randint(1, model.config.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(prompt))
    ids = ids.to(device)
    new = warmup + steps + 1
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    clock = _Clock(device)
    clock.start()
    session = kv.start(ids, max_new_tokens=new, prefill_chunk=chunk)
    tok = session.logits.argmax(-1)
    ttft = clock.stop()
    for _ in range(warmup):
        tok = session.step(tok).argmax(-1)
    clock.start()
    for _ in range(steps):
        tok = session.step(tok).argmax(-1)
    decode = clock.stop()
    report = session.report()
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    full = full_cache_bytes(model.config, batch, prompt + new, next(model.parameters()).element_size())
    budgets = list(report.layer_budgets.values())
    del session
    return {"prompt": prompt, "batch": batch, "policy": policy, "budget": budget if policy != "full" else None,
            "prefill_chunk": chunk, "ttft_s": round(ttft, 4), "ms_per_token": round(decode / steps * 1e3, 3),
            "tokens_per_s": round(batch * steps / decode, 1),
            "peak_gib": None if peak is None else round(peak / 2**30, 3), "weights_gib": round(weights / 2**30, 3),
            "full_cache_gib": round(full / 2**30, 3),
            "peak_over_full_cache": None if peak is None else round((peak - weights) / full, 4),
            "cache_gib_after": round(report.cache_bytes / 2**30, 3),
            "peak_entries_max": max(report.peak_entries.values()), "peak_entries_min": min(report.peak_entries.values()),
            "layer_budget_min": min(budgets, default=None), "layer_budget_max": max(budgets, default=None),
            "compressions": report.compressions, "new_tokens": new}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the JSON file to write")
    p.add_argument("--smoke", action="store_true", help="tiny model, short prompts, on the CPU (tests the script)")
    p.add_argument("--prompts", nargs="+", type=int, default=None, help="prompt tokens (default 32768 131072)")
    p.add_argument("--chunk", type=int, default=None, help="prefill_chunk of the chunked rows (default 4096)")
    p.add_argument("--budget", type=float, default=0.2)
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 32, the 8B model's)")
    p.add_argument("--no-batch8", dest="batch8", action="store_false", help="skip the batch-8 rows")
    p.add_argument("--warmup", type=int, default=4, help="decode steps before timing (CUDA-graph capture)")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps")
    p.add_argument("--time-limit", type=float, default=240.0, help="start no new row after this many seconds")
    args = p.parse_args(argv)
    began = time.monotonic()
    if args.smoke:
        device, dtype, shape = torch.device("cpu"), torch.float32, dict(TINY_LLAMA)
        prompts, chunk, args.steps, args.warmup = args.prompts or [96, 160], args.chunk or 32, 2, 1
    else:
        if not torch.cuda.is_available():
            p.error("needs a CUDA device (or --smoke)")
        device, dtype, shape = torch.device("cuda"), torch.bfloat16, dict(LLAMA_8B)
        prompts, chunk = args.prompts or [32768, 131072], args.chunk or 4096
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    context = max(prompts) + args.warmup + args.steps + 8
    t0 = time.monotonic()
    model = build_model(shape, device, dtype, context)
    _sync(device)
    built = time.monotonic() - t0
    weights = sum(t.numel() * t.element_size() for t in model.parameters())
    total_memory = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    rows = []
    kv = {policy: kvpass.apply(model, policy, 1.0 if policy == "full" else args.budget)    # one trace per policy
          for policy in ("full", "d2o", "streamingllm")}
    # warm-up: Triton compilation and cuBLAS plans at a short prompt, every policy and the chunked path
    for policy, c in (("full", None), ("d2o", None), ("d2o", chunk), ("streamingllm", chunk)):
        run_row(kv[policy], 3 * chunk + 17, 1, c, 1, 2, device, weights)
    for prompt, batch, policy, c in plan(prompts, chunk, (2 if args.smoke else 8) if args.batch8 else 0):
        row = {"prompt": prompt, "batch": batch, "policy": policy, "prefill_chunk": c}
        need = weights + full_cache_bytes(model.config, batch, prompt, dtype.itemsize)
        if policy == "full" and total_memory is not None and need > 0.95 * total_memory:
            row["skipped"] = (f"weights + the full cache need {need / 2**30:.1f} GiB, the device has "
                              f"{total_memory / 2**30:.1f} GiB")
        elif time.monotonic() - began > args.time_limit:
            row["skipped"] = f"time limit of {args.time_limit:.0f} s reached"
        else:
            try:
                row = run_row(kv[policy], prompt, batch, c, args.warmup, args.steps, device, weights)
            except torch.OutOfMemoryError as err:
                row["error"] = f"out of memory: {str(err).splitlines()[0]}"
            except Exception as err:                      # noqa: BLE001 - recorded; the other rows still run
                row["error"] = f"{type(err).__name__}: {err}"
                row["traceback"] = traceback.format_exc(limit=6)
        print(json.dumps(row), flush=True)
        rows.append(row)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out = {"what": "chunked prefill (issue 29): peak memory, TTFT and decode speed; one run per row",
           "command": "python benchmarks/chunked_prefill_gpu.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "model": ("tiny Llama" if args.smoke else "Llama-3.1-8B-shaped, random weights")
                    + f", {shape['num_hidden_layers']} layers", "dtype": str(dtype),
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "device_memory_gib": None if total_memory is None else round(total_memory / 2**30, 2),
           "torch": torch.__version__, "build_seconds": round(built, 2), "seconds": round(time.monotonic() - began, 1),
           "budget": args.budget, "chunk": chunk, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out} ({out['seconds']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
