"""Launch parameters of the cosine matcher at D2O's prefill shape (every evicted key against the kept ones),
one GPU: B 1, Hkv 8, S = 0.8 x 32k evicted, N = 0.2 x 32k kept, D 128, bf16; or, with ``--decode B``, at its
decode-time shape under ``interval`` m: B rows, S = m evicted keys, N = 0.2 x 32k kept (``--m``).

    PYTHONUNBUFFERED=1 python3 benchmarks/probes/cosine_match_sweep.py --out $OUT
    PYTHONUNBUFFERED=1 python3 benchmarks/probes/cosine_match_sweep.py --out $OUT --decode 32 --m 16

Each (block_s, block_n, warps, stages) timed from a CUDA graph (do_bench median); its indices compared with
the default launch's (fraction equal). The decode sweep varies (block_n, warps, stages, n_splits, norm_here)
and reports each launch's read rate of the kept keys against the copy bandwidth (the kernel's floor: it reads
every kept key once). Writes cosine-match-sweep.json (decode: cosine-match-sweep-decode-b<B>-m<m>.json) under --out.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
from pathlib import Path

import torch

from benchmarks.bench.timing import time_fn
from kvpass.kernels.cosine_match import cosine_match_triton


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prompt", type=int, default=32768)
    ap.add_argument("--decode", type=int, default=0, help="B: sweep the decode shape at this batch instead")
    ap.add_argument("--m", type=int, default=16, help="the decode shape's evicted keys per (row, head)")
    a = ap.parse_args()
    if a.decode:
        return decode_sweep(a.out, a.decode, a.m, a.prompt // 5)
    dev = torch.device("cuda")
    n = a.prompt // 5
    s = a.prompt - n
    g = torch.Generator(device=dev).manual_seed(0)
    src = torch.randn(1, 8, s, 128, device=dev, generator=g).to(torch.bfloat16)
    dst = torch.randn(1, 8, n, 128, device=dev, generator=g).to(torch.bfloat16)
    valid = torch.rand(1, 8, n, device=dev, generator=g) < 0.99
    want = cosine_match_triton(src, dst, valid)
    default_ms = time_fn(functools.partial(cosine_match_triton, src, dst, valid), dev) * 1e3
    flops = 2 * 8 * s * n * 128
    rows = []
    for bs, bn, nw, ns in itertools.product((32, 64, 128), (32, 64, 128), (4, 8), (2, 3)):
        kw = dict(block_s=bs, block_n=bn, num_warps=nw, num_stages=ns)
        try:
            fn = functools.partial(cosine_match_triton, src, dst, valid, **kw)
            got = fn()
            ms = time_fn(fn, dev) * 1e3
            rows.append({**kw, "ms": ms, "tflops": flops / ms / 1e9,
                         "same_index": float((got[0] == want[0]).float().mean()),
                         "max_best_diff": float((got[1] - want[1]).abs().max())})
        except Exception as exc:  # noqa: BLE001  (a config may not fit shared memory)
            rows.append({**kw, "error": repr(exc)[:200]})
    best = min((r for r in rows if "ms" in r), key=lambda r: r["ms"])
    print(f"default {default_ms:.2f} ms ({flops / default_ms / 1e9:.0f} TFLOP/s); best {best}", flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "cosine-match-sweep.json").write_text(json.dumps(
        {"gpu": torch.cuda.get_device_name(), "S": s, "N": n, "default_ms": default_ms, "rows": rows}, indent=1))


def decode_sweep(out: Path, b: int, m: int, n: int) -> None:
    """The decode-time shape: [B, 8, m, 128] evicted keys against [B, 8, n, 128] kept ones (99% live)."""
    from benchmarks.bench.timing import copy_bandwidth
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    src = torch.randn(b, 8, m, 128, device=dev, generator=g).to(torch.bfloat16)
    dst = torch.randn(b, 8, n, 128, device=dev, generator=g).to(torch.bfloat16)
    valid = torch.rand(b, 8, n, device=dev, generator=g) < 0.99
    want = cosine_match_triton(src, dst, valid)
    bw = copy_bandwidth(dev, 1 << 30)                          # bytes / s
    floor_us = (dst.numel() * dst.element_size() + valid.numel()) / bw * 1e6
    default_us = time_fn(functools.partial(cosine_match_triton, src, dst, valid), dev) * 1e6
    rows = []
    for bn, nw, ns, splits, here in itertools.product((64, 128, 256), (4, 8), (2, 3, 4), (1, 2, 3, 6), (True, False)):
        kw = dict(block_n=bn, num_warps=nw, num_stages=ns, n_splits=splits, norm_here=here)
        try:
            fn = functools.partial(cosine_match_triton, src, dst, valid, **kw)
            got = fn()
            us = time_fn(fn, dev) * 1e6
            rows.append({**kw, "us": us, "over_floor": us / floor_us,
                         "same_index": float((got[0] == want[0]).float().mean()),
                         "max_best_diff": float((got[1] - want[1]).abs().max())})
        except Exception as exc:  # noqa: BLE001  (a config may not fit shared memory)
            rows.append({**kw, "error": repr(exc)[:200]})
    best = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])[:5]
    print(f"decode B {b} m {m} N {n}: default {default_us:.1f} us, floor {floor_us:.1f} us; best {best}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"cosine-match-sweep-decode-b{b}-m{m}.json").write_text(json.dumps(
        {"gpu": torch.cuda.get_device_name(), "B": b, "S": m, "N": n, "copy_bandwidth_GBps": bw / 1e9,
         "floor_us": floor_us, "default_us": default_us, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
