"""D2O's decode step at a large batch, one layer at Llama-3.1-8B's shapes (Hq 32, Hkv 8, D 128, bf16,
C = 6555 = a 0.2 budget of 32k + 1), B = 32: what the scores cost the decode attention (want_scores off
against on, and on at each block / warps / stages) and the launch of the one-in-one-out eviction
(splits, key block, warps), which the B = 1 and 4 sweep (d2o_evict_one_sweep.py) tuned.

    PYTHONUNBUFFERED=1 python3 benchmarks/probes/d2o_batch_step_sweep.py --out $OUT [--b 32 --c 6555]

The profile of the compiled step at batch 32 (benchmarks/profile_decode.py --compiled --batch 32, H200)
put d2o's attention at 8.85 + 0.90 ms a step against streamingllm's 6.25 + 0.09, and its nearest-key
scan at 5.56 ms. Timed from a CUDA graph by triton's do_bench (median). Writes d2o-batch-step-sweep.json.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
from pathlib import Path

import torch
from kvpass.kernels.d2o_evict_one import d2o_evict_one_triton

from benchmarks.bench.kernels import decode_case
from benchmarks.bench.timing import time_fn
from benchmarks.probes.d2o_evict_one_sweep import layer
from kvpass.kernels.decode_attention import decode_attention_triton


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--b", type=int, default=32)
    ap.add_argument("--c", type=int, default=6555)
    a = ap.parse_args()
    dev, b, c = torch.device("cuda"), a.b, a.c
    out: dict = {"gpu": torch.cuda.get_device_name(), "b": b, "c": c, "attention": [], "evict": []}
    q, k, v, lw = decode_case(b, 32, 8, c, 128, torch.bfloat16, dev, seed=c + b)
    lw.clamp_(min=0.0)                                   # every slot live, as in a full D2O layer
    attend = functools.partial(decode_attention_triton, q, k, v, lw, 128 ** -0.5)
    for scores in (False, True):
        out["attention"].append({"want_scores": scores, "default": True,
                                 "us": time_fn(functools.partial(attend, want_scores=scores), dev) * 1e6})
    for bn, nw, ns in itertools.product((32, 64, 128), (4, 8), (2, 3)):
        cfg = dict(block_n=bn, num_warps=nw, num_stages=ns)
        try:
            us = time_fn(functools.partial(attend, want_scores=True, **cfg), dev) * 1e6
            out["attention"].append({"want_scores": True, **cfg, "us": us})
        except Exception as exc:  # noqa: BLE001  (a config may not fit shared memory)
            out["attention"].append({"want_scores": True, **cfg, "error": repr(exc)[:200]})
    print(json.dumps(out["attention"][:2]), flush=True)
    print("best attention with scores:", min((r for r in out["attention"][2:] if "us" in r), key=lambda r: r["us"]))
    del q, k, v, lw
    st = layer(b, c, b)
    keep = c - 1

    def call(**kw):
        st["length"].fill_(c)
        d2o_evict_one_triton(st["k"], st["v"], st["col_sum"], st["position"], st["log_weight"], st["length"],
                             st["tau"], st["tau_set"], [], keep, 4, keep // 4, 0.7, "paper", **kw)

    arm = time_fn(lambda: st["length"].fill_(c), dev) * 1e6
    for splits, block_c, warps in itertools.product((None, 8, 16, 32), (32, 64, 128), (4, 8)):
        kw = dict(splits=splits, block_c=block_c, num_warps=warps)
        try:
            out["evict"].append({**kw, "us": time_fn(functools.partial(call, **kw), dev) * 1e6 - arm})
        except Exception as exc:  # noqa: BLE001
            out["evict"].append({**kw, "error": repr(exc)[:200]})
    default = next(r for r in out["evict"] if r["splits"] is None and r["block_c"] == 32 and r["num_warps"] == 8)
    print("evict default:", default, "best:", min((r for r in out["evict"] if "us" in r), key=lambda r: r["us"]))
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "d2o-batch-step-sweep.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
