"""Tensor-parallel benchmark (``benchmarks/tp_gpu.py``, ``kvpass bench --tp N``): run under
``torchrun --nproc-per-node N``, one process per GPU (NCCL, ``NCCL_NVLS_ENABLE=0``), or on CPU with gloo
(``--smoke``: tiny shapes, for tests).

Sections (rank 0 writes ``tp-<device>-x<N>-<sections>.json`` / ``.md`` under ``--out``):

    correctness  a small Llama in fp32 (random weights): greedy tokens of ``full`` at tp=N equal tp=1's
    8b           the Llama-3.1-8B-shaped model, random bf16 weights, a 32k prompt: for each policy (full,
                 streamingllm, d2o at budget 0.2) at tp=1 (rank 0 alone, the others wait) and tp=N (all
                 ranks), batch 1 and the largest batch that fits: ms/token, tokens/s, TTFT, peak memory per
                 GPU and the floor per GPU, (weight + cache bytes per rank) / copy bandwidth
    70b          Llama-3.1-70B's layer shape at tp=N, d2o at 0.2, batch 1: as many of its 80 layers as the
                 unsharded model fits in 80% of one GPU's memory (every rank builds the whole model before
                 sharding it), the count stated in the results

Every timed number is measured here; the floors are computed from measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from benchmarks.bench.models import LLAMA_8B, TINY_LLAMA, build_model, build_model_of_views, materialise_views
from benchmarks.bench.timing import copy_bandwidth, gpu_name, slug, stepped_tpot, timed
from kvpass.tensor_parallel import init_distributed

LLAMA_70B_LAYER = dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_attention_heads=64,
                       num_key_value_heads=8, max_position_embeddings=131072, rope_theta=500000.0,
                       rms_norm_eps=1e-5, tie_word_embeddings=False)
SMALL_FP32 = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=8, max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-5,
                  tie_word_embeddings=False, initializer_range=0.1)
TINY_TP = {**TINY_LLAMA, "num_attention_heads": 4, "num_key_value_heads": 4}
METHODS = ("full", "streamingllm", "d2o")


def _barrier() -> None:
    import torch.distributed as dist
    dist.barrier()


def _all_ok(ok: bool, device: torch.device) -> bool:
    import torch.distributed as dist
    flag = torch.tensor([1 if ok else 0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


_CLOCK = {"start": time.monotonic(), "total_s": float("inf")}


def _have_time(need_s: float, collective: bool, device: torch.device) -> bool:
    """Whether ``need_s`` more seconds fit in ``--total-s`` (agreed by every rank when ``collective``)."""
    ok = time.monotonic() - _CLOCK["start"] + need_s < _CLOCK["total_s"]
    return _all_ok(ok, device) if collective else ok


def _say(what: str) -> None:
    """One progress line (elapsed seconds, rank) on stdout: where a cut-off run was."""
    print(f"[tp {time.monotonic() - _CLOCK['start']:7.1f}s rank {os.environ.get('RANK', '0')}] {what}", flush=True)


def _peak_reset(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gib(device: torch.device, phases: dict | None = None) -> float | None:
    """The peak allocated memory since ``_peak_reset``, with the peaks of ``phases`` (``stepped_tpot``'s
    ``memory``, which resets the counter between them)."""
    if device.type != "cuda":
        return None
    peaks = [v for k, v in (phases or {}).items() if k.endswith("peak_bytes") and v is not None]
    return max([torch.cuda.max_memory_allocated(device), *peaks]) / 2**30


def _weight_bytes(model) -> int:
    """Bytes one decode step reads per rank: every parameter but the input embedding (one row of it)."""
    emb = model.get_input_embeddings().weight
    seen, total = set(), 0
    for p in model.parameters():
        if p is emb or id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel() * p.element_size()
    return total


def measure(model, policy: str, budget: float, ids: torch.Tensor, tp: int | None, device: torch.device,
            copy_bw: float, steps: int, compile: bool | None = None, prefill_chunk: int | None = None) -> dict:
    """One policy at one batch: TTFT (batch 1: the median of 2 ``generate(max_new_tokens=1)``; above, the stepped
    decode's ``start``, so that every row is prefilled once; both after an untimed call on the first row), ms/token
    from stepped
    greedy tokens (``benchmarks.bench.timing.stepped_tpot``), peak memory, cache bytes and the copy floor.
    ``compile``: ``kvpass.apply``'s (None: its default, compiled on CUDA)."""
    import kvpass

    where = f"{policy} tp={tp or 1} batch={ids.shape[0]}"
    _say(f"{where}: apply")
    kv = kvpass.apply(model, policy=policy, budget=budget, tp=tp, compile=compile, prefill_chunk=prefill_chunk)
    materialise_views(model)                      # a build_model_of_views model's unsharded weights (the embedding)
    kv.prefill_rows = 1
    _peak_reset(device)
    kv.generate(ids[:1], max_new_tokens=1)        # untimed: the first call's Triton compilations and plans
    if ids.shape[0] == 1:
        ttft = statistics.median(timed(device, lambda: kv.generate(ids, max_new_tokens=1)) for _ in range(2))
        _say(f"{where}: TTFT {ttft:.2f} s; stepped decode")
    else:                                         # a batch is prefilled once: the stepped decode's start is its TTFT
        _say(f"{where}: stepped decode (its start is the TTFT)")
    stepped = stepped_tpot(kv, ids, device, warm=4, steps=steps)
    cache_bytes = stepped["start_cache_bytes"]   # after the prompt's compression, as a generate's report has it
    if ids.shape[0] > 1:
        ttft = stepped["start_s"]
        _say(f"{where}: TTFT {ttft:.2f} s")
    weights = _weight_bytes(model)
    compiled = kv.compile_report
    row = {"policy": policy, "tp": tp or 1, "batch": ids.shape[0], "prompt": ids.shape[1], "ttft_s": ttft,
           "tpot_ms": stepped["tpot_ms"], "tokens_per_s": stepped["decode_tokens_per_s"],
           "peak_memory_gib": _peak_gib(device, stepped["memory"]), "memory_phases": stepped["memory"],
           "weight_bytes_per_rank": weights,
           "cache_bytes_per_rank": cache_bytes,
           "floor_ms": (weights + cache_bytes) / copy_bw * 1e3,
           "compiled": compiled["compiled"], "compile_seconds": compiled["compile_seconds"],
           "compile_failure": compiled.get("failure"), "graph_captures": kv.decode_step.captures,
           "prefill_chunk": prefill_chunk, **{k: v for k, v in stepped.items() if k.startswith("decode_compress")}}
    _say(f"{where}: {row['tpot_ms']:.2f} ms/token")
    kv = None                                     # its caches and graphs go before the next measurement
    _peak_reset(device)
    _PARTIAL["rows"].append(row)
    if _PARTIAL["path"] is not None and int(os.environ.get("RANK", "0")) == 0:    # kept if the run is cut off
        Path(_PARTIAL["path"]).write_text(json.dumps(_PARTIAL["rows"], indent=1, default=str))
    return row


_PARTIAL: dict = {"path": None, "rows": []}


def _try_batch(make_model, policy, budget, prompt, tp, device, copy_bw, steps, batch: int, collective: bool,
               compile: bool | None) -> dict | None:
    """``measure`` at ``batch`` rows of a fresh model (``make_model()``); None where any rank ran out of memory."""
    from kvpass.errors import OutOfDeviceMemory

    row, ok = None, True
    try:
        model = make_model()
        ids = torch.randint(1, model.config.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(1))
        row = measure(model, policy, budget, ids.to(device), tp, device, copy_bw, steps, compile)
    except (torch.OutOfMemoryError, OutOfDeviceMemory) as err:
        _say(f"{policy} tp={tp or 1} batch={batch}: out of memory ({type(err).__name__})")
        ok = False
    model = None
    _peak_reset(device)
    return row if (_all_ok(ok, device) if collective else ok) and row is not None else None


def rows_that_fit(one: dict, two: dict, total_bytes: int, fill: float) -> tuple[int, float]:
    """(the most rows whose peak stays within ``fill`` x ``total_bytes``, the bytes one more row costs), from the
    rows of batch 1 (``one``) and 2 (``two``). A row costs its cache: the difference of the two rows' cache bytes.
    Batch 2's peak already holds what a batch of several rows adds once (one row's prefill beside the batch's
    buffers, which batch 1 does not have), so batch 2's peak less batch 1's is no row's cost: 0.97 GiB against
    0.41 GiB of cache at tp=2 for Llama-3.1-8B at 32k, where batch 120 then peaked at 2's + 118 x 0.415 GiB
    (b74865a's runs, benchmarks/results/tp-nvidia-h200-x2-8b-*-largest-b74865a.md)."""
    per_row = max(two["cache_bytes_per_rank"] - one["cache_bytes_per_rank"], 1.0)
    room = fill * total_bytes - two["peak_memory_gib"] * 2**30
    return max(2 + int(room // per_row), 1), per_row


def batch_in_time(left_s: float, ttft_s: float, fixed_s: float) -> int:
    """The largest batch whose estimate, (batch + 1) prefills of ``ttft_s`` (every row's and the warm row's) and
    ``fixed_s``, fits in ``left_s`` seconds (0 where none does)."""
    return max(int((left_s - fixed_s) // ttft_s) - 1, 0)


def _largest_batch(make_model, policy, budget, prompt, tp, device, copy_bw, steps, one: dict, max_batch: int,
                   collective: bool, compile: bool | None, fill: float = 0.9) -> list[dict]:
    """Batch 2, then the largest batch that fits: the largest whose peak, batch 2's and a cache for each further
    row (``rows_that_fit``), stays within ``fill`` of the GPU, capped by ``max_batch`` and by the time box; 15% fewer rows on
    out-of-memory (all ranks agree before the next try). Off CUDA: batch 2 alone. The largest row's ``largest``
    says what limited it and the estimate. ``make_model()``: the model to run (a fresh one per try under tp,
    whose apply shards it)."""
    fixed_s = 1.5 * (one.get("compile_seconds") or 30) + 60      # a compile and a build

    def need_s(batch: int) -> float:     # every row's prefill (the steps' start) and the warm row's, and fixed_s
        return (batch + 1) * one["ttft_s"] + fixed_s

    if max_batch < 2 or not _have_time(need_s(2), collective, device):
        return []
    _say(f"{policy} tp={tp or 1}: batch 2 (what a row costs)")
    two = _try_batch(make_model, policy, budget, prompt, tp, device, copy_bw, steps, 2, collective, compile)
    if two is None or device.type != "cuda":
        return [two] if two is not None else []
    fits, per_row = rows_that_fit(one, two, torch.cuda.get_device_properties(device).total_memory, fill)
    batch, limit = (fits, "memory") if fits <= max_batch else (max_batch, "max_batch")
    left = _CLOCK["total_s"] - (time.monotonic() - _CLOCK["start"])
    if need_s(batch) > left:                  # the time box, not memory, limits this one
        batch, limit = batch_in_time(left, one["ttft_s"], fixed_s), "time"
    if collective:                            # every rank tries rank 0's batch (peaks and clocks differ a little)
        batch, limit, fits, per_row = _from_rank0((batch, limit, fits, per_row), device)
    while batch > 2:
        _say(f"{policy} tp={tp or 1}: trying batch {batch} (limited by {limit}; estimated {need_s(batch):.0f} s; "
             f"{per_row / 2**30:.3f} GiB a row, {fits} rows fit)")
        row = _try_batch(make_model, policy, budget, prompt, tp, device, copy_bw, steps, batch, collective, compile)
        if row is not None:
            row["largest"] = {"limited_by": limit, "rows_estimated_to_fit": fits, "bytes_per_row": per_row,
                              "fill": fill}
            return [two, row]
        batch, limit = int(batch * 0.85), "memory (out of memory at a larger batch)"
    return [two]


def section_speed(model_kwargs: dict, label: str, world: int, rank: int, device: torch.device, copy_bw: float,
                  prompt: int, budget: float, methods: tuple[str, ...], with_tp1: bool, max_batch: int,
                  steps: int, compile: bool | None = None, prefill_chunk: int | None = None,
                  views: bool = False) -> list[dict]:
    """Batch 1 of every policy first (tp=1 on rank 0 while the others wait, then tp=world), then the
    largest batches in the time left. ``views``: build the model with ``build_model_of_views`` (each rank
    then holds only its shards: a model larger than one GPU)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    build = build_model_of_views if views else build_model

    def fresh():
        torch.manual_seed(0)
        return build(model_kwargs, device, dtype)

    ids = torch.randint(1, model_kwargs["vocab_size"], (1, prompt), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    tp1: dict[str, dict] = {}
    tpn: dict[str, dict] = {}
    if with_tp1:                                   # one GPU, before any model is sharded
        if rank == 0:
            model = fresh()
            for policy in methods:
                tp1[policy] = {"model": label, **measure(model, policy, budget, ids, None, device, copy_bw, steps,
                                                         None, prefill_chunk)}
            del model
            _peak_reset(device)
        _barrier()
    if world > 1:
        for policy in methods:                     # a fresh model each time: apply(tp) shards its parameters
            tpn[policy] = {"model": label, **measure(fresh(), policy, budget, ids, world, device, copy_bw, steps,
                                                     compile, prefill_chunk)}
            _peak_reset(device)
    rows = [*tp1.values(), *tpn.values()]
    for policy in methods:                         # what is left of the time box: the largest batches
        if policy in tp1:
            model = fresh()
            rows += [{"model": label, **r} for r in _largest_batch(lambda m=model: m, policy, budget, prompt, None,
                                                                    device, copy_bw, steps, tp1[policy], max_batch,
                                                                    False, None)]
            del model
            _peak_reset(device)
        if with_tp1:
            _barrier()
        if world > 1:
            one = _from_rank0(tpn[policy], device)
            rows += [{"model": label, **r} for r in _largest_batch(fresh, policy, budget, prompt, world, device,
                                                                    copy_bw, steps, one, max_batch, True, compile)]
    return rows


def _from_rank0(obj, device: torch.device):
    """Rank 0's ``obj`` (any picklable object) on every rank: every rank's batch-1 row is its own, and the batch
    search needs the same start, and the same batch, on all."""
    import torch.distributed as dist
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def section_correctness(world: int, device: torch.device, smoke: bool) -> dict:
    """Greedy tokens of ``full`` in fp32 at tp=world equal tp=1 (same random weights on every rank)."""
    import kvpass

    torch.manual_seed(0)
    model = build_model(TINY_TP if smoke else SMALL_FP32, torch.device("cpu"), torch.float32).to(device)
    ids = torch.randint(1, model.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(2)).to(device)
    gen = dict(max_new_tokens=24, do_sample=False, eos_token_id=None, return_dict_in_generate=True, output_logits=True)
    ref = kvpass.apply(model, policy="full").generate(ids, **gen)
    got = kvpass.apply(model, policy="full", tp=world).generate(ids, **gen)
    err = max((a - b).abs().max().item() for a, b in zip(got.logits, ref.logits, strict=True))
    same = torch.equal(got.sequences, ref.sequences)
    return {"tokens_equal": same and _all_ok(same, device), "max_logit_diff": err, "new_tokens": 24, "batch": 2,
            "tp": world, "dtype": "float32"}


def _layer_params(layer_kwargs: dict) -> tuple[int, int]:
    """(a layer's q, k, v, o and MLP weights, the embedding's = the LM head's), in parameters."""
    h, i, v = layer_kwargs["hidden_size"], layer_kwargs["intermediate_size"], layer_kwargs["vocab_size"]
    kv = layer_kwargs["num_key_value_heads"] * h // layer_kwargs["num_attention_heads"]
    return 2 * h * h + 2 * h * kv + 3 * h * i, v * h


def layers_that_fit(device: torch.device, layer_kwargs: dict, world: int, want: int = 80, fraction: float = 0.92,
                    reserve_gib: float = 6.0) -> int:
    """How many 70B-shaped layers (of ``want``) one rank's bf16 weights fit in ``fraction`` of its GPU less
    ``reserve_gib`` (the caches and a prefill chunk's transients): the embedding whole, the LM head and the
    layers' projections split ``world`` ways (``build_model_of_views``: no rank ever holds the whole model).
    2 off the GPU."""
    if device.type != "cuda":
        return 2
    h = layer_kwargs["hidden_size"]
    projections, table = _layer_params(layer_kwargs)
    per_layer = 2 * (projections / world + 2 * h)
    fixed = 2 * table * (1 + 1 / world)
    budget = fraction * torch.cuda.get_device_properties(device).total_memory - reserve_gib * 2**30
    return max(1, min(want, int((budget - fixed) // per_layer)))


def unsharded_weight_gib(layer_kwargs: dict, layers: int) -> float:
    """The bf16 weights of the whole model (what tp=1 would hold on one GPU)."""
    h = layer_kwargs["hidden_size"]
    projections, table = _layer_params(layer_kwargs)
    return 2 * (layers * (projections + 2 * h) + 2 * table + h) / 2**30


def markdown(results: dict) -> str:
    lines = [f"# kvpass tensor parallel: {results['device']} x {results['world']}", "",
             f"correctness (full, fp32, greedy): {results.get('correctness')}", "",
             "| model | policy | tp | batch | prompt | TTFT s | ms/token | tokens/s | peak GiB/GPU | floor ms/GPU "
             "| x floor | compiled | graph captures |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results.get("rows", []):
        peak = "" if r.get("peak_memory_gib") is None else f"{r['peak_memory_gib']:.1f}"
        lines.append(f"| {r['model']} | {r['policy']} | {r['tp']} | {r['batch']} | {r['prompt']} | {r['ttft_s']:.3g} | "
                     f"{r['tpot_ms']:.3g} | {r['tokens_per_s']:.4g} | {peak} | {r['floor_ms']:.3g} | "
                     f"{r['tpot_ms'] / r['floor_ms']:.2f} | {r.get('compiled')} | {r.get('graph_captures')} |")
    for r in results.get("rows", []):
        if "largest" in r:
            big = r["largest"]
            lines.append(f"\nlargest batch, {r['policy']} tp={r['tp']}: {r['batch']} rows, limited by "
                         f"{big['limited_by']} ({big['rows_estimated_to_fit']} estimated to fit in "
                         f"{big['fill']:.0%} of the GPU: batch 2's peak and {big['bytes_per_row'] / 2**30:.3f} GiB "
                         f"of cache a row)")
    for k, v in results.get("errors", {}).items():
        lines.append(f"\n{k}: {v}")
    return "\n".join(lines) + "\n"


def run(out: Path, smoke: bool, sections: tuple[str, ...], prompt: int | None, budget: float,
        methods: tuple[str, ...], max_batch: int, with_tp1: bool = True, total_s: float = float("inf"),
        compile: bool | None = None, chunk_70b: int | None = 4096, steps: int | None = None) -> dict:
    _CLOCK.update(start=time.monotonic(), total_s=total_s)
    rank, world, device = init_distributed()
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    prompt = prompt or (40 if smoke else 32768)
    steps = steps or (4 if smoke else 32)
    copy_bw = copy_bandwidth(device, (1 << 20) if smoke else (2 << 30))
    tag = "" if compile is None else f"-compile-{'on' if compile else 'off'}"
    stem = out / f"tp-{slug(gpu_name(device))}-x{world}-{'-'.join(sections)}{tag}"
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    _PARTIAL.update(path=f"{stem}.partial.json", rows=[])
    results: dict = {"device": gpu_name(device), "world": world, "argv": sys.argv, "copy_bytes_per_s": copy_bw,
                     "torch": torch.__version__, "started": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": [],
                     "errors": {}, "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"),
                     "compile": {None: "kvpass default", True: "on", False: "off"}[compile]}
    for name in sections:
        try:
            if name == "correctness":
                results["correctness"] = section_correctness(world, device, smoke)
            elif name == "8b":
                results["rows"] += section_speed(TINY_TP if smoke else LLAMA_8B, "tiny" if smoke else "llama-3.1-8b",
                                                 world, rank, device, copy_bw, prompt, budget, methods, with_tp1,
                                                 max_batch, steps, compile)
            elif name == "70b":
                n = layers_that_fit(device, LLAMA_70B_LAYER, world)
                kwargs = TINY_TP if smoke else {**LLAMA_70B_LAYER, "num_hidden_layers": n}
                results["layers_70b"] = n if not smoke else None
                results["unsharded_weight_gib_70b"] = unsharded_weight_gib(kwargs, kwargs["num_hidden_layers"])
                results["gpu_memory_gib"] = (torch.cuda.get_device_properties(device).total_memory / 2**30
                                             if device.type == "cuda" else None)
                results["rows"] += section_speed(kwargs, "tiny" if smoke else f"llama-3.1-70b-shape-{n}-of-80-layers",
                                                 world, rank, device, copy_bw, prompt, budget, ("d2o",), False, 1,
                                                 steps, compile, chunk_70b, views=True)
            else:
                raise ValueError(f"unknown section {name!r}; sections: correctness, 8b, 70b")
        except Exception as err:  # noqa: BLE001  (one section's failure must not lose the others)
            results["errors"][name] = f"{type(err).__name__}: {err}"
            results.setdefault("tracebacks", {})[name] = traceback.format_exc()
            if isinstance(err, ValueError) and "unknown section" in str(err):
                raise
    if rank == 0:
        Path(f"{stem}.json").write_text(json.dumps(results, indent=1, default=str))
        Path(f"{stem}.md").write_text(markdown(results))
        print(markdown(results), flush=True)
    import torch.distributed as dist
    dist.destroy_process_group()
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="tensor-parallel kvpass benchmark; run under torchrun --nproc-per-node N")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"), help="output folder")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU with gloo when KVPASS_TP_CPU=1 or no GPU)")
    ap.add_argument("--sections", default="correctness,8b,70b")
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 32768; 40 with --smoke)")
    ap.add_argument("--budget", type=float, default=0.2)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--max-batch", type=int, default=32, help="largest batch tried (default 32)")
    ap.add_argument("--total-s", type=float, default=float("inf"),
                    help="time box: larger batches are tried only while they fit in it (default none)")
    ap.add_argument("--no-tp1", action="store_true", help="skip the one-GPU comparison rows")
    ap.add_argument("--tp", type=int, default=None, help="the processes torchrun starts (checked; default: all)")
    ap.add_argument("--compile", choices=("default", "on", "off"), default="default",
                    help="compiled decode at tp=N (default: kvpass's, compiled on CUDA); tp=1 rows keep kvpass's default")
    ap.add_argument("--steps", type=int, default=None,
                    help="timed decode steps a row (default 32; 4 with --smoke; cover an interval policy's compressions, "
                         "e.g. 128 for d2o[interval=64])")
    ap.add_argument("--prefill-chunk-70b", type=int, default=4096,
                    help="the 70b section's chunked prefill (0: the whole prompt at once)")
    args = ap.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.tp is not None and args.tp != world:
        raise SystemExit(f"kvpass bench --tp {args.tp}: {world} processes run; start it with "
                         f"`torchrun --nproc-per-node {args.tp} -m kvpass.cli bench --tp {args.tp}`")
    results = run(Path(args.out), args.smoke, tuple(s for s in args.sections.split(",") if s), args.prompt, args.budget,
                  tuple(m for m in args.methods.split(",") if m), args.max_batch, not args.no_tp1, args.total_s,
                  {"default": None, "on": True, "off": False}[args.compile], args.prefill_chunk_70b or None,
                  args.steps)
    return 1 if results["errors"] or (results.get("correctness") or {}).get("tokens_equal") is False else 0


if __name__ == "__main__":
    raise SystemExit(main())
