"""The speed benchmark's ``e2e`` and ``throughput`` sections: transformers and kvpass decoding a
Llama-3.1-8B-shaped model, batch 1 at each prompt length, and the largest batch that fits."""

from __future__ import annotations

import functools
import gc
import time
import traceback

import torch

from benchmarks.bench.models import LLAMA_8B, TINY_LLAMA, build_model, weight_bytes_per_step
from benchmarks.bench.timing import Deadline, measure_generate, stepped_tpot, timed, transformers_stepped_tpot

POLICY_ORDER = ("full", "streamingllm", "d2o", "chelsea")


# Extra end-to-end rows: label suffix -> (policy, hyperparameters). D2O compresses one-in-one-out (the
# paper); with interval 64 it compresses every 64 steps (budget + 64 slots), the amortised form.
VARIANTS = {"d2o-interval64": ("d2o", {"interval": 64})}


# Rows "kvpass-<policy>-compiled": the prefill and decode graphs compiled by the "kvpass" torch.compile
# backend (Inductor fuses the norms, RoPE and residual adds around the kvpass ops), as
# torch.compile(model, backend="kvpass") runs them; the decode step is still replayed from a CUDA graph.
COMPILED_ROWS = ("full", "d2o")


THROUGHPUT_METHODS = ("transformers", "full", "streamingllm", "d2o", "chelsea")


def section_throughput(device: torch.device, smoke: bool, deadline: Deadline, prompt: int, budget: float,
                       methods: tuple[str, ...] = THROUGHPUT_METHODS, max_batch: int = 32) -> dict:
    """Tokens/s at the largest batch that fits, for plain transformers (full cache) and each kvpass policy of
    ``methods`` (prefilling one row at a time, ``KVPassModel.prefill_rows = 1``): the batch is found by doubling
    from 1 until out of memory, ``max_batch`` or the time box; each method's tokens/s = batch / time per output
    token, and the best of its batches is compared with transformers' best (``over_transformers``; the issue's
    target is kvpass ``d2o``'s, ``kvpass_over_transformers``)."""
    import kvpass
    from kvpass.rewrites import capture_model

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(TINY_LLAMA if smoke else LLAMA_8B, device, dtype)
    cfg = model.config
    captured = capture_model(model)
    n1, n2 = (2, 6) if smoke else (2, 34)
    rows = []
    for name in methods:
        label = name if name == "transformers" else f"kvpass-{name}"
        kv = None
        if name != "transformers":
            policy = kvpass.get_policy(name)
            kv = kvpass.apply(model, policy, budget if policy.compresses else 1.0, captured=captured, compile=False)
            kv.prefill_rows = 1        # one row's full K, V at a time: the batch is bounded by compressed caches
        batch = 1
        while True:                    # doubling the batch; out of memory ends it, any other error ends the method
            if not deadline.allows(60 if not smoke else 5):
                rows.append({"method": label, "batch": batch, "skipped": "time"})
                break
            ids = torch.randint(1, cfg.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(batch)).to(device)
            row = {"method": label, "batch": batch, "prompt": prompt}
            try:
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                if kv is None:
                    def gen(n, ids=ids):
                        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                              min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
                    t1 = timed(device, lambda: gen(n1))
                    t2 = timed(device, lambda: gen(n2))
                    tpot = max(t2 - t1, 1e-9) / (n2 - n1)
                else:
                    tpot = stepped_tpot(kv, ids, device, warm=4, steps=16)["tpot_ms"] / 1e3
                row.update(tpot_ms=tpot * 1e3, tokens_per_s=batch / tpot)
                if device.type == "cuda":
                    row["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            except Exception as exc:  # noqa: BLE001  (out of memory is the batch's limit; anything else is recorded)
                row["oom"] = isinstance(exc, torch.OutOfMemoryError)
                row["error"] = "".join(traceback.format_exception(exc))[-1500:]    # where: the batch's limit, or a bug
            rows.append(row)
            print(f"[bench] throughput {row}", flush=True)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if "error" in row or (smoke and batch >= 4) or batch >= max_batch:
                break
            batch *= 2
        del kv
        gc.collect()
    best = {}
    for r in rows:
        if "tokens_per_s" in r and r["tokens_per_s"] > best.get(r["method"], {}).get("tokens_per_s", 0):
            best[r["method"]] = r
    base = best.get("transformers", {}).get("tokens_per_s")
    over = {m: r["tokens_per_s"] / base for m, r in best.items() if base and m != "transformers"}
    return {"prompt": prompt, "budget": budget, "policy": "d2o", "n1": n1, "n2": n2, "rows": rows,
            "best": best, "over_transformers": over, "kvpass_over_transformers": over.get("kvpass-d2o")}


def section_e2e(device: torch.device, smoke: bool, deadline: Deadline, copy_bw: float,
                prompts: list[int], budget: float, methods_wanted: set[str] | None = None) -> dict:
    import kvpass
    from kvpass.compile_backend import compile_graphs
    from kvpass.rewrites import capture_model

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    t0 = time.monotonic()
    model = build_model(TINY_LLAMA if smoke else LLAMA_8B, device, dtype)
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    weight_bytes = weight_bytes_per_step(model)
    build_s = time.monotonic() - t0
    t0 = time.monotonic()
    captured, capture_error = None, None
    try:                                          # a capture failure still leaves the transformers rows
        captured = capture_model(model)
    except Exception as exc:  # noqa: BLE001
        capture_error = "".join(traceback.format_exception(exc))[-3000:]
    capture_s = time.monotonic() - t0
    n1, n2 = (2, 6) if smoke else (4, 52)
    names = [p for p in POLICY_ORDER if p in kvpass.POLICIES] + \
        sorted(p for p in kvpass.POLICIES if p not in POLICY_ORDER)
    rows = []
    elem = torch.tensor([], dtype=dtype).element_size()
    for prompt in prompts:
        gen_ids = torch.Generator(device="cpu").manual_seed(prompt)
        ids = torch.randint(1, cfg.vocab_size, (1, prompt), generator=gen_ids).to(device)
        full_kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * (prompt + n2) * elem
        short = ids[:, : max(64, prompt // 16)]
        # rough seconds per configuration (3 prefills, ~quadratic, plus decoding); raised to the last measured
        est = 5.0 if smoke else 5.0 + 3.0 * (prompt / 16384) ** 2
        methods = [("transformers", None)] + [(f"kvpass-{p}", p) for p in names] + \
            [("kvpass-streamingllm-eager", "streamingllm")] + \
            [(f"kvpass-{label}", policy) for label, (policy, _) in VARIANTS.items()] + \
            ([] if smoke else [(f"kvpass-{p}-compiled", p) for p in COMPILED_ROWS])
        for label, pname in methods:
            if pname is not None and pname not in kvpass.POLICIES:
                continue
            row = {"prompt": prompt, "batch": 1, "method": label}
            if methods_wanted is not None and label.removeprefix("kvpass-") not in methods_wanted:
                continue
            print(f"[bench] e2e start {label} prompt={prompt}", flush=True)
            if not deadline.allows(est):
                row["skipped"] = "time"
                rows.append(row)
                continue
            started = time.monotonic()
            try:
                if pname is not None and captured is None:
                    raise RuntimeError("kvpass capture failed (see e2e.capture_error)")
                if pname is None:
                    def gen(n, ids=ids):
                        return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                              eos_token_id=None, pad_token_id=0)
                    row.update(measure_generate(device, gen, n1, n2, functools.partial(
                        model.generate, short, max_new_tokens=n1, do_sample=False, eos_token_id=None, pad_token_id=0)))
                    row["tpot_stepped_ms"] = transformers_stepped_tpot(model, ids, device)
                    row["cache_bytes"] = full_kv
                    row["kv_bytes_per_step"] = full_kv
                else:
                    policy = kvpass.get_policy(pname, **VARIANTS.get(label.removeprefix("kvpass-"), (None, {}))[1])
                    kv = kvpass.apply(model, policy, 1.0 if not policy.compresses else budget, captured=captured,
                                      compile=False)   # eager rows; "-compiled" rows compile below
                    if label.endswith("-eager"):
                        kv.decode_step.enabled = False

                    warm_ids = short
                    if label.endswith("-compiled"):       # torch.compile(model, backend="kvpass")'s graphs
                        compile_graphs(kv)
                        warm_ids = ids                    # the decode graph compiles per cache shape: warm this one

                    def gen(n, kv=kv, ids=ids):
                        return kv.generate(ids, max_new_tokens=n, do_sample=False)
                    row.update(measure_generate(device, gen, n1, n2, functools.partial(kv.generate, warm_ids, max_new_tokens=n1,
                                                                               do_sample=False)))
                    row["tpot_generate_diff_ms"] = row["tpot_ms"]
                    row.update(stepped_tpot(kv, ids, device))
                    rep = kv.last_report
                    row.update(cache_bytes=rep.cache_bytes, full_cache_bytes=rep.full_cache_bytes,
                               compressions=rep.compressions, budget_tokens=rep.budget_tokens,
                               cuda_graph_captures=kv.decode_step.captures)
                    row["kv_bytes_per_step"] = rep.cache_bytes
                floor = (weight_bytes + row["kv_bytes_per_step"]) / copy_bw
                row["floor_ms"] = floor * 1e3
                row["tpot_over_floor"] = row["tpot_ms"] / row["floor_ms"]
            except Exception as exc:  # noqa: BLE001  (e.g. out of memory at 64k: record, go on)
                row["error"] = "".join(traceback.format_exception(exc))[-1500:]
            finally:
                kv = gen = None                   # free this method's caches and graphs before the next
            row["wall_s"] = time.monotonic() - started
            est = max(est, row["wall_s"])
            rows.append(row)
            print(f"[bench] e2e {row}", flush=True)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        base = next((r for r in rows if r["prompt"] == prompt and r["method"] == "transformers" and "tpot_ms" in r), None)
        for r in rows:
            if base is not None and r["prompt"] == prompt and "tpot_ms" in r:
                r["speedup_vs_transformers"] = base["tpot_ms"] / r["tpot_ms"]
                if "tpot_stepped_ms" in base:
                    r["speedup_vs_transformers_stepped"] = base["tpot_stepped_ms"] / r["tpot_ms"]
    return {"model": "Llama-3.1-8B-shaped, random weights" if not smoke else "tiny Llama", "dtype": str(dtype),
            "weight_bytes_per_step": weight_bytes, "build_s": build_s, "capture_s": capture_s, "budget": budget,
            "capture_error": capture_error,
            "n1": n1, "n2": n2, "rows": rows}

