"""The speed benchmark's ``correctness`` and ``kernels`` sections: every Triton op against its reference
at real shapes, decode attention against SDPA and a copy, ClusterKV's compression ops."""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable

import torch

from benchmarks.bench.timing import Deadline, rel_err, time_fn, time_graphed_or_eager, timed


def decode_case(b, hq, hkv, c, d, dtype, device, seed):
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
        q, k, v, lw = decode_case(b, hq, hkv, c, d, dtype, device, seed=100 + i)
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
            "info_rows_ms": timed(device, functools.partial(head_column_sums_rows, *args)) * 1e3,
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
                q, k, v, lw = decode_case(b, hq, hkv, c, d, dtype, device, seed=c + b)
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
            q, k, v, lw = decode_case(b, hq, hkv, c, d, dtype, device, seed=7)
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

