"""``kvpass bench``: speed of the kernels and of end-to-end decoding, measured side by side in one run.

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
import functools
import gc
import json
import math
import os
import platform
import re
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
TINY_LLAMA = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                  rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
POLICY_ORDER = ("full", "streamingllm", "d2o", "chelsea")
# Extra end-to-end rows: label suffix -> (policy, hyperparameters). D2O compresses one-in-one-out (the
# paper); with interval 64 it compresses every 64 steps (budget + 64 slots), the amortised form.
VARIANTS = {"d2o-interval64": ("d2o", {"interval": 64})}
# Rows "kvpass-<policy>-compiled": the prefill and decode graphs compiled by the "kvpass" torch.compile
# backend (Inductor fuses the norms, RoPE and residual adds around the kvpass ops), as
# torch.compile(model, backend="kvpass") runs them; the decode step is still replayed from a CUDA graph.
COMPILED_ROWS = ("full", "d2o")


# ------------------------------------------------------------------------------------ utilities
class Deadline:
    """A wall-clock budget: ``left()`` seconds remain; ``allows(est)`` if an item of ``est`` seconds fits."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def allows(self, estimate: float = 0.0) -> bool:
        return self.left() > estimate


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn: Callable[[], object], device: torch.device, graph: bool = True) -> float:
    """Median seconds of ``fn``. CUDA: captured in a CUDA graph (no launch overhead, as in the decode
    step) and timed by triton's do_bench (median, L2 flushed before each run). CPU: a few runs."""
    if device.type != "cuda":
        fn()
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    from triton.testing import do_bench

    run = fn
    if graph:
        fn()                                                   # warm up (compiles) outside the capture
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        run = g.replay
    ms = do_bench(run, warmup=10, rep=40, quantiles=[0.5])
    ms = ms[0] if isinstance(ms, (list, tuple)) else ms
    return float(ms) * 1e-3


def time_graphed_or_eager(fn: Callable[[], object], device: torch.device) -> tuple[float, bool]:
    """``time_fn(fn)`` from a CUDA graph, or, where ``fn`` cannot be captured (it synchronises with the
    host, as Chelsea's compression does), timed eagerly with its launches. Returns (seconds, graphed)."""
    try:
        return time_fn(fn, device), device.type == "cuda"
    except RuntimeError:                        # a failed capture (torch.AcceleratorError is a RuntimeError)
        sync(device)
        return time_fn(fn, device, graph=False), False


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    if not bool(torch.isfinite(got).all()):
        return float("nan")
    return float((got - want).norm() / want.norm().clamp(min=1e-30))


def gpu_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu-{platform.machine()}"


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def guarded(results: dict, name: str, fn: Callable[[], object]) -> None:
    """Run one section; record its output, or its exception, and its wall time."""
    t0 = time.monotonic()
    print(f"[bench] section {name} ...", flush=True)
    try:
        results[name] = fn()
    except Exception as exc:  # noqa: BLE001  (any failure of one section must not stop the others)
        results.setdefault("errors", {})[name] = "".join(traceback.format_exception(exc))[-4000:]
        print(f"[bench] section {name} FAILED: {exc!r}", flush=True)
    results.setdefault("section_seconds", {})[name] = round(time.monotonic() - t0, 2)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------ 1. env
def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes/s of a device-to-device copy (counting bytes read + bytes written)."""
    n = nbytes // 2
    src = torch.randn(n, device=device, dtype=torch.float32).to(torch.bfloat16)
    dst = torch.empty_like(src)
    t = time_fn(lambda: dst.copy_(src), device, graph=False)
    return 2 * src.numel() * src.element_size() / t


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


# ------------------------------------------------------------------------------------ 2. correctness
def _decode_case(b, hq, hkv, c, d, dtype, device, seed):
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(b, hq, 1, d, device=device, generator=gen).to(dtype)
    k = torch.randn(b, hkv, c, d, device=device, generator=gen).to(dtype)
    v = torch.randn(b, hkv, c, d, device=device, generator=gen).to(dtype)
    lw = torch.rand(b, hkv, c, device=device, generator=gen) * 2 - 0.5
    length = torch.randint(max(1, c // 2), c + 1, (b, hkv), device=device, generator=gen)
    lw = lw.masked_fill(torch.arange(c, device=device)[None, None] >= length[..., None], float("-inf"))
    return q, k, v, lw


def section_correctness(device: torch.device, smoke: bool, deadline: Deadline) -> dict:
    from kvpass.kernels.cosine_match import cosine_match_reference, cosine_match_triton
    from kvpass.kernels.decode_attention import decode_attention_reference, decode_attention_triton
    from kvpass.kernels.merge_weighted import merge_weighted_reference, merge_weighted_triton

    dtype = torch.bfloat16
    rows = []
    tol = 2e-2

    def record(op, shape, errors, info=None):
        rows.append({"op": op, "shape": shape, **{k: float(v) for k, v in errors.items()}, **(info or {}),
                     "ok": all(math.isfinite(v) and v < tol for v in errors.values())})

    cases = [(1, 8, 2, 37, 16, None), (2, 12, 4, 50, 16, 30.0)] if smoke else \
        [(1, 32, 8, 4099, 128, None), (4, 32, 8, 16411, 128, None), (2, 32, 8, 1000, 128, 50.0), (8, 32, 8, 32768, 128, None)]
    for i, (b, hq, hkv, c, d, cap) in enumerate(cases):
        if not deadline.allows(5):
            rows.append({"op": "decode_attention", "shape": [b, hq, hkv, c, d], "skipped": "time"})
            continue
        q, k, v, lw = _decode_case(b, hq, hkv, c, d, dtype, device, seed=100 + i)
        want_o, want_s = decode_attention_reference(q.float(), k.float(), v.float(), lw, d ** -0.5, cap, True)
        got_o, got_s = decode_attention_triton(q, k, v, lw, d ** -0.5, cap, True)
        record("decode_attention", [b, hq, hkv, c, d, cap], {"rel_err_o": rel_err(got_o, want_o),
                                                              "rel_err_scores": rel_err(got_s, want_s)})
    mcases = [(1, 2, 40, 16)] if smoke else [(1, 8, 8192, 128), (2, 8, 32768, 128)]
    for i, (b, hkv, c, d) in enumerate(mcases):
        if not deadline.allows(5):
            continue
        gen = torch.Generator(device=device).manual_seed(200 + i)
        k = torch.randn(b, hkv, c, d, device=device, generator=gen).to(dtype)
        v = torch.randn(b, hkv, c, d, device=device, generator=gen).to(dtype)
        w = torch.rand(b, hkv, c, device=device, generator=gen) + 0.5
        keep = torch.rand(b, hkv, c, device=device, generator=gen) < 0.25
        keep[..., 0] = True
        kept_idx = torch.cummax(torch.where(keep, torch.arange(c, device=device), 0), dim=-1).values
        target = torch.where(keep, -1, kept_idx)                       # merge each into the previous kept slot
        want = merge_weighted_reference(k.float(), v.float(), w, target)
        got = merge_weighted_triton(k, v, w, target)
        live = want[2] > float("-inf")
        record("merge_weighted", [b, hkv, c, d], {"rel_err_k": rel_err(got[0], want[0]),
                                                  "rel_err_v": rel_err(got[1], want[1]),
                                                  "rel_err_log_weight": rel_err(got[2][live], want[2][live])})
    ccases = [(1, 2, 30, 20, 16, 0)] if smoke else [(1, 8, 8192, 2048, 128, 0), (1, 8, 4096, 4096, 128, 32)]
    for i, (b, hkv, s, n, d, chunk) in enumerate(ccases):
        if not deadline.allows(5):
            continue
        gen = torch.Generator(device=device).manual_seed(300 + i)
        x = torch.randn(b, hkv, s, d, device=device, generator=gen).to(dtype)
        y = torch.randn(b, hkv, n, d, device=device, generator=gen).to(dtype)
        want_i, want_b = cosine_match_reference(x.float(), y.float(), None, chunk, chunk)
        got_i, got_b = cosine_match_triton(x, y, None, chunk, chunk)
        # a near tie may pick another index (fp32 sums in another order): judge the exact similarity of the pick
        xn = torch.nn.functional.normalize(x.float(), dim=-1)
        yn = torch.nn.functional.normalize(y.float(), dim=-1)
        picked = (xn * torch.gather(yn, 2, got_i.clamp(min=0)[..., None].expand(-1, -1, -1, d))).sum(-1)
        record("cosine_match", [b, hkv, s, n, d, chunk], {"abs_err_best": float((got_b - want_b).abs().max()),
                                                          "abs_deficit_of_pick": float((want_b - picked).max())},
               {"info_index_mismatch": float((got_i != want_i).float().mean())})
    from kvpass.kernels.attention_column_sums import head_column_sums_rows, head_column_sums_triton
    scases = [(2, 4, 2, 70, 16)] if smoke else [(1, 32, 8, 4096, 128), (1, 32, 8, 16384, 128)]
    for i, (b, hq, hkv, t, d) in enumerate(scases):
        if not deadline.allows(10):
            continue
        gen = torch.Generator(device=device).manual_seed(400 + i)
        q = torch.randn(b, hq, t, d, device=device, generator=gen).to(dtype)
        k = torch.randn(b, hkv, t, d, device=device, generator=gen).to(dtype)
        v = torch.randn(b, hkv, t, d, device=device, generator=gen).to(dtype)
        pad = torch.arange(b, device=device) * 7
        args = (q, k, pad, d ** -0.5)
        want = head_column_sums_rows(q.float(), k.float(), pad, d ** -0.5)
        got = head_column_sums_triton(*args)
        times = {} if device.type != "cuda" else {
            "info_triton_ms": time_fn(functools.partial(head_column_sums_triton, *args), device) * 1e3,
            "info_rows_ms": _timed(device, functools.partial(head_column_sums_rows, *args)) * 1e3,
            "info_sdpa_causal_ms": time_fn(functools.partial(torch.nn.functional.scaled_dot_product_attention,
                                                             q, k, v, is_causal=True, enable_gqa=True), device) * 1e3}
        record("head_column_sums", [b, hq, hkv, t, d], {"rel_err": rel_err(got, want)}, times)
    _clusterkv_correctness(device, smoke, deadline, record)
    return {"rows": rows, "tolerance": tol, "all_ok": all(r.get("ok", True) for r in rows)}


def _kmeans_case(b, hkv, n, k, d, dtype, device, seed):
    """Keys past 16 sinks, ragged lengths, centroids drawn from the keys (fp32, as ClusterKV)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(b, hkv, n, d, device=device, generator=gen).to(dtype)
    mu = x[:, :, torch.randperm(n, device=device, generator=gen)[:k]].float()
    length = torch.randint(max(1, n // 2), n + 1, (b, hkv), device=device, generator=gen)
    slot = torch.arange(n, device=device)
    valid = (slot >= min(16, n // 4)) & (slot < length[..., None])
    return x, mu, valid


def _gather_case(b, hkv, group, c, width, d, dtype, device, seed):
    """K, V and a selection of about ``width`` slots per query head (16 sinks always)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    k = torch.randn(b, hkv, c, d, device=device, generator=gen).to(dtype)
    v = torch.randn(b, hkv, c, d, device=device, generator=gen).to(dtype)
    lw = torch.zeros(b, hkv, c, device=device)
    keep = torch.rand(b, hkv, group, c, device=device, generator=gen) < width / c
    keep[..., :min(16, c)] = True
    return k, v, lw, keep


def _clusterkv_correctness(device: torch.device, smoke: bool, deadline: Deadline, record) -> None:
    """ClusterKV's K-means assign/update and cluster gather (Triton) against fp32 references, bf16 keys."""
    from kvpass.kernels.cluster_gather import cluster_gather_reference, cluster_gather_triton
    from kvpass.kernels.cosine_kmeans_assign import (
        cosine_kmeans_assign_reference,
        cosine_kmeans_assign_triton,
    )
    from kvpass.kernels.cosine_kmeans_update import (
        cosine_kmeans_update_reference,
        cosine_kmeans_update_triton,
    )

    dtype = torch.bfloat16
    kcases = [(1, 2, 64, 5, 16)] if smoke else [(1, 8, 32768, 410, 128), (2, 8, 8192, 102, 128)]
    for i, (b, hkv, n, k, d) in enumerate(kcases):
        if not deadline.allows(5):
            continue
        x, mu, valid = _kmeans_case(b, hkv, n, k, d, dtype, device, seed=500 + i)
        want = cosine_kmeans_assign_reference(x, mu, valid)
        got = cosine_kmeans_assign_triton(x, mu, valid)
        xn = torch.nn.functional.normalize(x.float(), dim=-1, eps=1e-6)
        mn = torch.nn.functional.normalize(mu, dim=-1, eps=1e-6)

        def cos_of(lab, xn=xn, mn=mn, d=d):
            return (xn * torch.gather(mn, 2, lab.clamp(min=0)[..., None].expand(-1, -1, -1, d))).sum(-1)

        # a near tie may pick another centroid (tf32 products): judge the exact cosine of the pick
        record("cosine_kmeans_assign", [b, hkv, n, k, d],
               {"abs_deficit_of_pick": float((cos_of(want) - cos_of(got))[valid].max())},
               {"info_label_mismatch": float((got != want)[valid].float().mean()),
                "info_same_invalid": float(torch.equal(got < 0, want < 0))})
        new, size = cosine_kmeans_update_triton(x, want, mu)
        want_new, want_size = cosine_kmeans_update_reference(x, want, mu)
        record("cosine_kmeans_update", [b, hkv, n, k, d],
               {"rel_err_centroids": rel_err(new, want_new),
                "abs_err_sizes": float((size - want_size).abs().max())})
    gcases = [(1, 2, 2, 64, 20, 16)] if smoke else [(1, 8, 4, 32768, 1040, 128), (4, 8, 4, 8192, 1040, 128)]
    for i, (b, hkv, group, c, width, d) in enumerate(gcases):
        if not deadline.allows(5):
            continue
        k, v, lw, keep = _gather_case(b, hkv, group, c, width, d, dtype, device, seed=600 + i)
        n = int(keep.sum(-1).max())
        got = cluster_gather_triton(k, v, lw, keep, n)
        want = cluster_gather_reference(k, v, lw, keep, n)
        record("cluster_gather", [b, hkv, group, c, n, d],
               {"rel_err_k": rel_err(got[0], want[0]), "rel_err_v": rel_err(got[1], want[1]),
                "abs_err_log_weight": float((got[2] != want[2]).float().max())})


# ------------------------------------------------------------------------------------ 3. kernels
def section_kernels(device: torch.device, smoke: bool, deadline: Deadline, copy_bw: float) -> dict:
    import torch.nn.functional as F

    from kvpass.kernels.decode_attention import decode_attention_reference, decode_attention_triton

    hq, hkv, d = (8, 2, 16) if smoke else (32, 8, 128)
    sizes = [64, 256] if smoke else [1024, 2048, 4096, 8192, 16384, 32768, 65536]
    batches = [1, 2] if smoke else [1, 4, 8, 16, 32]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    triton_op = decode_attention_triton if (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1") \
        else decode_attention_reference
    rows = []
    for c in sizes:
        for b in batches:
            if not deadline.allows(3):
                rows.append({"C": c, "B": b, "skipped": "time"})
                continue
            row = {"C": c, "B": b}
            try:
                q, k, v, lw = _decode_case(b, hq, hkv, c, d, dtype, device, seed=c + b)
                kv_bytes = 2 * k.numel() * k.element_size()
                read_bytes = kv_bytes + lw.numel() * 4 + 2 * q.numel() * q.element_size()
                scale = d ** -0.5
                row.update(kv_bytes=kv_bytes)
                t_tri = time_fn(functools.partial(triton_op, q, k, v, lw, scale), device)
                row.update(triton_us=t_tri * 1e6, triton_bytes_per_s=read_bytes / t_tri,
                           triton_frac_of_big_copy=(read_bytes / t_tri) / copy_bw)
                # torch SDPA over a dense cache: the G query heads of a KV head as G query rows (no mask)
                qg = q.reshape(b, hkv, hq // hkv, d)
                try:
                    t_sdpa = time_fn(functools.partial(F.scaled_dot_product_attention, qg, k, v, scale=scale), device)
                    row.update(sdpa_us=t_sdpa * 1e6, sdpa_bytes_per_s=kv_bytes / t_sdpa, triton_vs_sdpa=t_sdpa / t_tri)
                except Exception as exc:  # noqa: BLE001
                    row["sdpa_error"] = repr(exc)[:200]
                flat = torch.cat([k.flatten(), v.flatten()])
                dst = torch.empty_like(flat)
                t_copy = time_fn(functools.partial(dst.copy_, flat), device)
                copy_rate = 2 * kv_bytes / t_copy
                row.update(copy_us=t_copy * 1e6, copy_bytes_per_s=copy_rate,
                           triton_frac_of_copy=(read_bytes / t_tri) / copy_rate)
                del q, k, v, lw, flat, dst
            except Exception as exc:  # noqa: BLE001  (one size failing, e.g. out of memory, must not stop the grid)
                row["error"] = repr(exc)[:300]
            rows.append(row)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    sweep = []
    if triton_op is decode_attention_triton:
        points = [(64, 1)] if smoke else [(4096, 1), (16384, 8), (65536, 8)]
        configs = [dict(block_n=bn, num_warps=nw, num_stages=ns) for bn in ((16,) if smoke else (32, 64, 128))
                   for nw in ((4,) if smoke else (4, 8)) for ns in ((1,) if smoke else (2, 3))]
        for c, b in points:
            q, k, v, lw = _decode_case(b, hq, hkv, c, d, dtype, device, seed=7)
            read_bytes = 2 * k.numel() * k.element_size() + lw.numel() * 4
            for cfg in configs:
                for split_mult in ((1,) if smoke else (0.5, 1, 2)):
                    if not deadline.allows(2):
                        break
                    from kvpass.kernels.decode_attention import decode_splits
                    splits = max(1, int(decode_splits(b, hkv, c, cfg["block_n"], device) * split_mult))
                    try:
                        t = time_fn(functools.partial(decode_attention_triton, q, k, v, lw, d ** -0.5,
                                                      num_splits=splits, **cfg), device)
                        sweep.append({"C": c, "B": b, **cfg, "num_splits": splits, "us": t * 1e6,
                                      "bytes_per_s": read_bytes / t})
                    except Exception as exc:  # noqa: BLE001  (a config may not fit the chip's shared memory)
                        sweep.append({"C": c, "B": b, **cfg, "num_splits": splits, "error": repr(exc)[:200]})
            del q, k, v, lw
    best = {}
    for s in sweep:
        if "us" in s and (key := f"{s['C']}x{s['B']}") and (key not in best or s["us"] < best[key]["us"]):
            best[key] = s
    compression = clusterkv_kernel_rows(device, smoke, deadline) if triton_op is decode_attention_triton else []
    return {"shape": {"Hq": hq, "Hkv": hkv, "D": d, "dtype": str(dtype)}, "op": triton_op.__name__,
            "rows": rows, "sweep": sweep, "sweep_best": best, "compression": compression}


def clusterkv_kernel_rows(device: torch.device, smoke: bool, deadline: Deadline) -> list[dict]:
    """ClusterKV's compression ops (Llama-3.1-8B heads: Hkv 8, G 4, D 128; bf16 keys; C0 = n / 80
    clusters; a selection of 1024 + 16 sinks per query head): time (CUDA-graph replay, do_bench median),
    bytes moved (read + written, each tensor once) per second, and that rate over a device copy of the
    same number of bytes timed in the same run (the host-resident gather: over a pinned host-to-device
    copy of the gathered bytes). The K-means assignment also reports its tf32 multiply-add rate."""
    from kvpass.kernels.cluster_gather import cluster_gather_triton
    from kvpass.kernels.cosine_kmeans_assign import cosine_kmeans_assign_triton
    from kvpass.kernels.cosine_kmeans_update import cosine_kmeans_update_triton

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hkv, group, d = (2, 2, 16) if smoke else (8, 4, 128)
    copies: dict[int, float] = {}

    def copy_rate(nbytes: int) -> float:
        """Bytes/s (read + write) of a device copy of ``nbytes``, measured once per size."""
        if nbytes not in copies:
            src = torch.empty(max(1, nbytes // 2), device=device, dtype=torch.bfloat16)
            dst = torch.empty_like(src)
            copies[nbytes] = 2 * src.numel() * 2 / time_fn(functools.partial(dst.copy_, src), device)
        return copies[nbytes]

    def timed_row(row: dict, fn: Callable[[], object], moved: int, baseline: float, **info) -> dict:
        t, graphed = time_graphed_or_eager(fn, device)
        return {**row, "us": t * 1e6, "graphed": graphed, "bytes": moved, "bytes_per_s": moved / t,
                "copy_bytes_per_s": baseline,
                "frac_of_copy": (moved / t) / baseline, **{k: v(t) if callable(v) else v for k, v in info.items()}}

    rows = []
    for n in ([64] if smoke else [8192, 32768]):
        k = max(1, round(n / 80))
        for b in ([1] if smoke else [1, 4]):
            if not deadline.allows(5):
                rows.append({"op": "cosine_kmeans", "B": b, "N": n, "skipped": "time"})
                continue
            row = {"B": b, "Hkv": hkv, "N": n, "K": k, "D": d}
            try:
                x, mu, valid = _kmeans_case(b, hkv, n, k, d, dtype, device, seed=n + b)
                labels = cosine_kmeans_assign_triton(x, mu, valid)
                x_bytes = x.numel() * x.element_size()
                mu_bytes = mu.numel() * mu.element_size()
                lab_bytes = labels.numel() * labels.element_size()
                moved = x_bytes + valid.numel() + mu_bytes + lab_bytes
                flops = 2 * b * hkv * n * k * d
                rows.append(timed_row({"op": "cosine_kmeans_assign", **row},
                                      functools.partial(cosine_kmeans_assign_triton, x, mu, valid), moved,
                                      copy_rate(moved), tflop_per_s=lambda t, f=flops: f / t / 1e12))
                moved = x_bytes + lab_bytes + 2 * mu_bytes + b * hkv * k * 8
                rows.append(timed_row({"op": "cosine_kmeans_update", **row},
                                      functools.partial(cosine_kmeans_update_triton, x, labels, mu), moved,
                                      copy_rate(moved)))
                del x, mu, valid, labels
            except Exception as exc:  # noqa: BLE001  (one size failing must not stop the others)
                rows.append({"op": "cosine_kmeans", **row, "error": repr(exc)[:300]})
    for c in ([64] if smoke else [8192, 32768]):
        for b in ([1] if smoke else [1, 8]):
            for where in (("device",) if device.type != "cuda" else ("device", "pinned-host")):
                if not deadline.allows(5):
                    rows.append({"op": "cluster_gather", "B": b, "C": c, "where": where, "skipped": "time"})
                    continue
                width = 20 if smoke else 1040
                row = {"B": b, "Hkv": hkv, "G": group, "C": c, "D": d, "where": where}
                try:
                    k, v, lw, keep = _gather_case(b, hkv, group, c, width, d, dtype, device, seed=c + b)
                    n = int(keep.sum(-1).max())
                    row["W"] = n
                    kv_bytes = 2 * b * hkv * group * n * d * k.element_size()        # k_sel + v_sel
                    moved = 2 * kv_bytes + keep.numel() + 2 * b * hkv * group * n * 4    # + keep, lw read + written
                    if where == "pinned-host":
                        k, v = k.cpu().pin_memory(), v.cpu().pin_memory()
                        host = torch.empty(kv_bytes // 2, dtype=torch.bfloat16).pin_memory()
                        dst = torch.empty(host.shape, device=device, dtype=torch.bfloat16)
                        baseline = kv_bytes / time_fn(functools.partial(dst.copy_, host, non_blocking=True), device,
                                                      graph=False)            # host-to-device: bytes crossing PCIe
                        moved = kv_bytes
                    else:
                        baseline = copy_rate(moved)
                    rows.append(timed_row({"op": "cluster_gather", **row},
                                          functools.partial(cluster_gather_triton, k, v, lw, keep, n), moved,
                                          baseline))
                    del k, v, lw, keep
                except Exception as exc:  # noqa: BLE001
                    rows.append({"op": "cluster_gather", **row, "error": repr(exc)[:300]})
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------------------------ 4. end to end
def build_model(config_kwargs: dict, device: torch.device, dtype: torch.dtype):
    """A LlamaForCausalLM with random weights, built directly on the device in ``dtype``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**config_kwargs, attn_implementation="sdpa")
    config.eos_token_id = None
    config.pad_token_id = 0
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(old)
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def llama_8b_with_prompt(prompt: int, device: torch.device, seed: int = 0) -> tuple[torch.nn.Module, torch.Tensor]:
    """The GPU probes' setting: the Llama-3.1-8B-shaped model with random bf16 weights on ``device`` and
    random token ids [1, prompt] (CPU generator ``seed``)."""
    ids = torch.randint(1, LLAMA_8B["vocab_size"], (1, prompt), generator=torch.Generator().manual_seed(seed))
    return build_model(LLAMA_8B, device, torch.bfloat16), ids.to(device)


def _weight_bytes_per_step(model) -> int:
    """Parameters one decode step reads: all but the input embedding table (one row of it)."""
    emb = model.get_input_embeddings().weight
    return sum(p.numel() * p.element_size() for p in model.parameters() if p is not emb)


def _timed(device: torch.device, fn: Callable[[], object]) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def _measure(device, gen: Callable[[int], object], n1: int, n2: int, warm: Callable[[], object]) -> dict:
    """TTFT (generate 1 token: the median of 3, so the first call at the prompt's length, which builds
    plans and grows the allocator, does not decide it), time per output token (difference of n2 and n1
    tokens), peak memory. ``warm`` runs first on a short prompt (Triton compilation, cuBLAS handles)."""
    warm()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    ttft = statistics.median(_timed(device, lambda: gen(1)) for _ in range(3))
    t1 = _timed(device, lambda: gen(n1))
    t2 = _timed(device, lambda: gen(n2))
    tpot = max(t2 - t1, 1e-9) / (n2 - n1)
    out = {"ttft_s": ttft, "tpot_ms": tpot * 1e3, "decode_tokens_per_s": 1.0 / tpot,
           "tokens_per_s_n2": n2 / t2}
    if device.type == "cuda":
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return out


def _greedy_step_seconds(step: Callable[[torch.Tensor], torch.Tensor], tok: torch.Tensor, device: torch.device,
                         warm: int, steps: int) -> float:
    """Mean seconds of ``tok = step(tok)`` over ``steps`` synchronised steps, after ``warm`` untimed ones."""
    for _ in range(warm):
        tok = step(tok)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        tok = step(tok)
    sync(device)
    return (time.perf_counter() - t0) / steps


def _stepped_tpot(kv, ids: torch.Tensor, device: torch.device, warm: int = 8, steps: int = 48) -> dict:
    """kvpass's time per output token without prefill noise: after ``start``, ``warm`` steps (CUDA
    graph captures, the first compressions), then the mean of ``steps`` timed steps (greedy tokens).
    A policy compressing every ``interval`` > 1 steps gets ``interval`` more warm-up steps (its first
    compression and that step's graph capture) and at least 2 x ``interval`` timed steps, so the timed
    steps hold whole periods. Then, for a compressing policy, one decode-time compression of every
    compressed layer (``DecodeSession.compress_layers``, what the steps run) timed on its own from a
    CUDA graph: before each timed call every layer's lengths are set back to its capacity (a full
    buffer, as when a step compresses), else every call after the first would find nothing to evict;
    that re-arming is timed alone and subtracted."""
    interval = getattr(kv.policy, "interval", 1) if kv.policy.compresses else 1
    if interval > 1:
        warm, steps = warm + interval, max(steps, 2 * interval)
    session = kv.start(ids, max_new_tokens=warm + steps)
    tpot = _greedy_step_seconds(lambda tok: session.step(tok).argmax(-1), session.logits.argmax(-1), device,
                                warm, steps)
    out = {"tpot_ms": tpot * 1e3, "decode_tokens_per_s": ids.shape[0] / tpot, "tpot_method": f"{steps} stepped tokens",
           "interval": interval}
    due = [i for i, lay in enumerate(session.layers) if lay.compressible]
    layers = [session.layers[i] for i in due]
    if layers:
        def arm() -> None:
            for lay in layers:
                lay.cache.length.fill_(lay.cache.capacity)

        def compress_all() -> None:                                     # as a step does: side by side on CUDA
            arm()
            session.compress_layers(due)

        seconds, graphed = time_graphed_or_eager(compress_all, device)   # the step runs it eagerly too where not graphed
        arm_seconds = time_fn(arm, device, graph=graphed)
        ms = max(seconds - arm_seconds, 0.0) * 1e3
        how = "CUDA graph" if graphed else "eager (capture failed)" if device.type == "cuda" else "eager"
        out.update(decode_compress_ms=ms, decode_compress_frac_of_tpot=ms / interval / out["tpot_ms"],
                   decode_compress_timed=how)
    return out


def _transformers_stepped_tpot(model, ids: torch.Tensor, device: torch.device, warm: int = 8, steps: int = 48) -> float:
    """Plain transformers' ms per output token without ``generate`` or prefill noise: the model's own
    forward and its own cache (greedy), ``warm`` steps, then the mean of ``steps`` timed steps. (The
    ``generate`` difference of two lengths swings between runs: 30 to 100 ms at 32k on one H100.)"""
    with torch.no_grad():
        out = model(ids, use_cache=True, logits_to_keep=1)
        cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        del out

        def step(tok: torch.Tensor) -> torch.Tensor:
            return model(tok, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)

        return _greedy_step_seconds(step, tok, device, warm, steps) * 1e3


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
            kv = kvpass.apply(model, policy, budget if policy.compresses else 1.0, captured=captured)
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
                    t1 = _timed(device, lambda: gen(n1))
                    t2 = _timed(device, lambda: gen(n2))
                    tpot = max(t2 - t1, 1e-9) / (n2 - n1)
                else:
                    tpot = _stepped_tpot(kv, ids, device, warm=4, steps=16)["tpot_ms"] / 1e3
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
    weight_bytes = _weight_bytes_per_step(model)
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
                    row.update(_measure(device, gen, n1, n2, functools.partial(
                        model.generate, short, max_new_tokens=n1, do_sample=False, eos_token_id=None, pad_token_id=0)))
                    row["tpot_stepped_ms"] = _transformers_stepped_tpot(model, ids, device)
                    row["cache_bytes"] = full_kv
                    row["kv_bytes_per_step"] = full_kv
                else:
                    policy = kvpass.get_policy(pname, **VARIANTS.get(label.removeprefix("kvpass-"), (None, {}))[1])
                    kv = kvpass.apply(model, policy, 1.0 if not policy.compresses else budget, captured=captured)
                    if label.endswith("-eager"):
                        kv.decode_step.enabled = False

                    warm_ids = short
                    if label.endswith("-compiled"):       # torch.compile(model, backend="kvpass")'s graphs
                        compile_graphs(kv)
                        warm_ids = ids                    # the decode graph compiles per cache shape: warm this one

                    def gen(n, kv=kv, ids=ids):
                        return kv.generate(ids, max_new_tokens=n, do_sample=False)
                    row.update(_measure(device, gen, n1, n2, functools.partial(kv.generate, warm_ids, max_new_tokens=n1,
                                                                               do_sample=False)))
                    row["tpot_generate_diff_ms"] = row["tpot_ms"]
                    row.update(_stepped_tpot(kv, ids, device))
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


# ------------------------------------------------------------------------------------ report
def _fmt(x, spec=".3g"):
    if x is None:
        return "-"
    if isinstance(x, float):
        return format(x, spec)
    return str(x)


def targets(results: dict) -> list[str]:
    """Issue 6's targets that this run measured, with the measured ratios."""
    out = []
    rows = [r for r in (results.get("kernels") or {}).get("rows", []) if "triton_vs_sdpa" in r]
    if rows:
        worst = min(rows, key=lambda r: r["triton_vs_sdpa"])
        out.append(f"- decode attention within 10% of SDPA at every size: worst SDPA/Triton time "
                   f"{worst['triton_vs_sdpa']:.2f} at C={worst['C']} B={worst['B']} "
                   f"({'met' if worst['triton_vs_sdpa'] >= 0.9 else 'missed'})")
    big = [r for r in rows if r["C"] >= 16384 and r["B"] >= 8 and "triton_frac_of_copy" in r]
    if big:
        worst = min(big, key=lambda r: r["triton_frac_of_copy"])
        out.append(f"- >= 85% of copy bandwidth from 16k x 8 up: worst {worst['triton_frac_of_copy']:.2f} at "
                   f"C={worst['C']} B={worst['B']} ({'met' if worst['triton_frac_of_copy'] >= 0.85 else 'missed'})")
    e2e = [r for r in (results.get("e2e") or {}).get("rows", []) if "tpot_ms" in r]
    for method in ("kvpass-d2o", "kvpass-d2o-compiled", "kvpass-d2o-interval64", "kvpass-streamingllm"):
        r = next((r for r in e2e if r["method"] == method and r["prompt"] == 32768), None)
        if r is not None:
            speedup = r.get("speedup_vs_transformers")
            met = r["tpot_over_floor"] <= 1.3 and speedup is not None and speedup >= 8
            stepped = r.get("speedup_vs_transformers_stepped")
            out.append(f"- {method} at 32k, batch 1: {r['tpot_over_floor']:.2f}x the floor (target <= 1.3), "
                       f"{_fmt(speedup, '.1f')}x transformers' generate (target >= 8) ({'met' if met else 'missed'}); "
                       f"{_fmt(stepped, '.1f')}x transformers' own forward stepped"
                       f" ({'met' if stepped is not None and stepped >= 8 else 'missed'} against that)")
    for r in e2e:
        if r["prompt"] == 32768 and "decode_compress_frac_of_tpot" in r:
            cost, how = _prefill_cost(r, e2e)
            out.append(f"- {r['method']} at 32k: prefill statistics + compression {_fmt(cost, '.1%')} of TTFT ({how}; "
                       f"target <= 15%), decode-time compression {100 * r['decode_compress_frac_of_tpot']:.1f}% of "
                       f"decode time (target <= 5%)")
    thr = results.get("throughput") or {}
    if thr.get("kvpass_over_transformers") is not None:
        out.append(f"- largest-batch tokens/s at {thr['prompt']}: kvpass {thr['policy']} / transformers "
                   f"{thr['kvpass_over_transformers']:.2f} (target >= 4)")
    return out


def _prefill_cost(row: dict, rows: list[dict]) -> tuple[float | None, str]:
    """A compressing row's prefill statistics + compression as a fraction of its TTFT: (its TTFT - the
    full-cache kvpass row's TTFT at the same prompt, measured in the same run) / its TTFT. A compiled row
    is compared with kvpass-full-compiled (the same compiled prefill without statistics, compressing
    nothing), any other with kvpass-full. Returns it and how it was measured."""
    ref = "kvpass-full-compiled" if row["method"].endswith("-compiled") else "kvpass-full"
    full = next((r for r in rows if r["method"] == ref and r["prompt"] == row["prompt"] and "ttft_s" in r), None)
    if full is None or "ttft_s" not in row:
        return None, f"not measured (no {ref} row)"
    return max(row["ttft_s"] - full["ttft_s"], 0.0) / row["ttft_s"], f"TTFT minus {ref}'s"


def markdown(results: dict) -> str:
    env = results.get("env", {})
    lines = [f"# kvpass speed: {env.get('device', '?')}", "",
             f"torch {env.get('torch')}, triton {env.get('triton')}, transformers {env.get('transformers')}; "
             f"copy bandwidth {env.get('copy_bytes_per_s', 0) / 1e12:.3f} TB/s (read + write).", ""]
    corr = results.get("correctness")
    if corr:
        lines += ["## Correctness (bf16 vs fp32 reference)", "", "| op | shape | errors | ok |", "|---|---|---|---|"]
        for r in corr["rows"]:
            errs = ", ".join(f"{k}={v:.2e}" for k, v in r.items() if k.startswith(("rel_", "abs_", "info_")))
            lines.append(f"| {r['op']} | {r['shape']} | {errs or r.get('skipped', '')} | {r.get('ok', '-')} |")
        lines.append("")
    ker = results.get("kernels")
    if ker:
        lines += [f"## Decode attention ({ker['shape']}; CUDA-graph replays, do_bench median, L2 flushed)", "",
                  "Triton TB/s counts K, V, log-weights, q and o; SDPA/Triton time > 1: Triton faster; "
                  "Triton / copy: against a copy of the same K+V bytes (read + write).", "",
                  "| C | B | Triton us | SDPA us | copy us | Triton TB/s | SDPA/Triton time | Triton / copy |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in ker["rows"]:
            if "triton_us" in r:
                lines.append(f"| {r['C']} | {r['B']} | {r['triton_us']:.1f} | {_fmt(r.get('sdpa_us'), '.1f')} | "
                             f"{_fmt(r.get('copy_us'), '.1f')} | {r['triton_bytes_per_s'] / 1e12:.2f} | "
                             f"{_fmt(r.get('triton_vs_sdpa'), '.2f')} | {_fmt(r.get('triton_frac_of_copy'), '.2f')} |")
            else:
                lines.append(f"| {r['C']} | {r['B']} | {r.get('skipped') or r.get('error', '')} | | | | | |")
        if ker.get("compression"):
            lines += ["", "ClusterKV compression kernels (bytes moved = read + written, each tensor once; "
                      "/ copy: against a device copy of as many bytes in this run, or for pinned host K/V "
                      "against a pinned host-to-device copy of the gathered bytes):", "",
                      "| op | shape | us | TB/s | / copy | TFLOP/s |", "|---|---|---|---|---|---|"]
            for r in ker["compression"]:
                shape = " ".join(f"{key}={r[key]}" for key in ("B", "Hkv", "G", "N", "K", "C", "W", "D", "where")
                                 if key in r)
                if "us" in r:
                    lines.append(f"| {r['op']} | {shape} | {r['us']:.1f} | {r['bytes_per_s'] / 1e12:.3f} | "
                                 f"{r['frac_of_copy']:.2f} | {_fmt(r.get('tflop_per_s'), '.1f')} |")
                else:
                    lines.append(f"| {r['op']} | {shape} | {r.get('skipped') or r.get('error', '')[:80]} | | | |")
        if ker.get("sweep_best"):
            lines += ["", "Best launch parameters of the sweep:", ""]
            for key, s in ker["sweep_best"].items():
                lines.append(f"- {key}: block_n={s['block_n']} warps={s['num_warps']} stages={s['num_stages']} "
                             f"splits={s['num_splits']}: {s['us']:.1f} us, {s['bytes_per_s'] / 1e12:.2f} TB/s")
        lines.append("")
    e2e = results.get("e2e")
    if e2e:
        lines += [f"## End to end: {e2e['model']}, batch 1, budget {e2e['budget']}", "",
                  f"ms/token = (time of {e2e['n2']} tokens - time of {e2e['n1']}) / {e2e['n2'] - e2e['n1']}; "
                  "floor = (weights read per step + cache bytes) / copy bandwidth (cache bytes include "
                  "kvpass metadata: positions, log-weights, scores). x transformers: against its generate; x stepped: "
                  "against its own forward stepped with its cache (no generate, no prefill in the difference).", "",
                  "| prompt | method | TTFT s | ms/token | tokens/s | floor ms | x floor | x transformers | x stepped "
                  "| peak GiB | cache MiB |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in e2e["rows"]:
            if "floor_ms" in r:
                lines.append(f"| {r['prompt']} | {r['method']} | {r['ttft_s']:.3f} | {r['tpot_ms']:.2f} | "
                             f"{r['decode_tokens_per_s']:.1f} | {r['floor_ms']:.2f} | {r['tpot_over_floor']:.2f} | "
                             f"{_fmt(r.get('speedup_vs_transformers'), '.2f')} | "
                             f"{_fmt(r.get('speedup_vs_transformers_stepped'), '.2f')} | {_fmt(r.get('peak_memory_gib'), '.1f')} | "
                             f"{r['cache_bytes'] / 2**20:.1f} |")
            else:
                why = r.get("skipped") or (r.get("error", "").strip().splitlines() or ["?"])[-1][:80]
                lines.append(f"| {r['prompt']} | {r['method']} | {why} | | | | | | | | |")
        lines.append("")
    costs = [r for r in (e2e or {}).get("rows", []) if "decode_compress_ms" in r]
    if costs:
        lines += ["## Compression cost", "",
                  "prefill stats + compress = (TTFT - kvpass-full's TTFT) / TTFT (a compiled row: "
                  "kvpass-full-compiled's); "
                  "decode compress = one compression of every layer (CUDA graph) / interval / ms per token.", "",
                  "| prompt | method | prefill stats + compress % TTFT | measured as | decode compress ms | interval | % of ms/token |",
                  "|---|---|---|---|---|---|---|"]
        for r in costs:
            cost, how = _prefill_cost(r, e2e["rows"])
            lines.append(f"| {r['prompt']} | {r['method']} | {_fmt(None if cost is None else 100 * cost, '.1f')} | {how} | "
                         f"{r['decode_compress_ms']:.2f} | {r['interval']} | {100 * r['decode_compress_frac_of_tpot']:.1f} |")
        lines.append("")
    thr = results.get("throughput")
    if thr:
        lines += [f"## Largest batch, prompt {thr['prompt']}, budget {thr['budget']}", "",
                  "| method | batch | ms/token | tokens/s | peak GiB |", "|---|---|---|---|---|"]
        for r in thr["rows"]:
            if "tokens_per_s" in r:
                lines.append(f"| {r['method']} | {r['batch']} | {r['tpot_ms']:.2f} | {r['tokens_per_s']:.1f} | "
                             f"{_fmt(r.get('peak_memory_gib'), '.1f')} |")
            else:
                why = "out of memory" if r.get("oom") else r.get("skipped") or "error: " + r["error"].strip().splitlines()[-1][:80]
                lines.append(f"| {r['method']} | {r['batch']} | {why} | | |")
        lines += ["", "tokens/s at the largest batch, against transformers' at its largest: "
                  + (", ".join(f"{m} {v:.2f}x" for m, v in (thr.get("over_transformers") or {}).items()) or "-"), ""]
    if targets(results):
        lines += ["## Targets (issue 6)", ""] + targets(results) + [""]
    if results.get("errors"):
        lines += ["## Section errors", ""] + [f"- {k}: {v.strip().splitlines()[-1][:200]}" for k, v in results["errors"].items()]
    lines += ["", f"Section seconds: {results.get('section_seconds')}"]
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    """One panel per section that has rows: decode-attention bandwidth, end-to-end ms/token against the
    floor, largest-batch tokens/s against the batch."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ker = [r for r in (results.get("kernels") or {}).get("rows", []) if "triton_us" in r and "sdpa_us" in r]
    e2e = [r for r in (results.get("e2e") or {}).get("rows", []) if "tpot_ms" in r]
    thr = [r for r in (results.get("throughput") or {}).get("rows", []) if "tokens_per_s" in r]
    panels = [(draw, rows) for draw, rows in ((_plot_kernels, ker), (_plot_e2e, e2e), (_plot_throughput, thr)) if rows]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
    for ax, (draw, rows) in zip(axes[0], panels, strict=True):
        draw(ax, rows, results)
    fig.suptitle(results.get("env", {}).get("device", ""))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_kernels(ax, rows: list[dict], results: dict) -> None:
    for b in sorted({r["B"] for r in rows}):
        sel = [r for r in rows if r["B"] == b]
        ax.plot([r["C"] for r in sel], [r["triton_bytes_per_s"] / 1e12 for r in sel], "o-", label=f"Triton B={b}")
        ax.plot([r["C"] for r in sel], [r["sdpa_bytes_per_s"] / 1e12 for r in sel], "x--", alpha=0.5, label=f"SDPA B={b}")
    ax.axhline(results.get("env", {}).get("copy_bytes_per_s", 0) / 1e12, color="k", lw=0.8, label="copy")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="cache entries C", ylabel="TB/s", title="decode attention bandwidth")
    ax.legend(fontsize=6, ncol=2)


def _plot_e2e(ax, rows: list[dict], results: dict) -> None:
    labels = [f"{r['method']}\n{r['prompt'] // 1024}k" for r in rows]
    ax.bar(range(len(rows)), [r["tpot_ms"] for r in rows], color="tab:blue", label="ms/token")
    ax.scatter(range(len(rows)), [r["floor_ms"] for r in rows], color="k", marker="_", s=200, label="floor", zorder=3)
    ax.set_xticks(range(len(rows)), labels, rotation=60, fontsize=6)
    ax.set(ylabel="ms per output token", title="end-to-end decode, batch 1")
    ax.legend(fontsize=7)


def _plot_throughput(ax, rows: list[dict], results: dict) -> None:
    for method in dict.fromkeys(r["method"] for r in rows):
        sel = [r for r in rows if r["method"] == method]
        ax.plot([r["batch"] for r in sel], [r["tokens_per_s"] for r in sel], "o-", label=method)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="batch", ylabel="tokens/s", title=f"largest batch, prompt {results['throughput']['prompt']}")
    ax.legend(fontsize=7)


# ------------------------------------------------------------------------------------ main
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
                    help="tensor parallel over N processes (under torchrun --nproc-per-node N): kvpass.bench_tp")
    tp, rest = _split_tp(sys.argv[1:] if argv is None else list(argv))
    if tp is not None and tp > 1:              # its own sections and options (kvpass/bench_tp.py)
        from kvpass.bench_tp import main as tp_main
        return tp_main([*rest, "--tp", str(tp)])
    args = ap.parse_args(argv)
    prompts, methods = _checked_options(args)
    run(Path(args.out), args.smoke, args.total_s, tuple(s for s in args.sections.split(",") if s), prompts, args.budget,
        methods, args.max_batch)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
