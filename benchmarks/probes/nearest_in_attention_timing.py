"""What finding D2O's next nearest keys inside the decode attention costs and saves, one layer, graphed.

    PYTHONUNBUFFERED=1 python3 benchmarks/probes/nearest_in_attention_timing.py --out $OUT [--batches 1,4,8,16,32]

Llama-3.1-8B's attention shape (Hq 32, Hkv 8, D 128, bf16), C = 6555 slots (a 0.2 budget of 32k). Each row is
timed from a CUDA graph by ``time_fn`` (triton's do_bench, median), in microseconds a layer:

* ``attention``: the decode attention with the per-slot scores, as D2O's step runs it;
* ``nearest``: the same launch with 4 candidates in the query tile and the keys' inverse norms read from a
  [B, Hkv, C] fp32 tensor (``decode_attention_nearest``'s Triton kernel);
* ``evict[scan]``: D2O's one-in-one-out op with its nearest-key scan (every row full and evicting);
* ``evict[hit]``: the same op given the attention's result for its entry (its scan kernel's programs skip the
  keys). Scores, positions and log-weights are restored before each call, so every call evicts the same entries;
  the restore is timed apart and subtracted.

Also checks that the attention's search finds the same slots as the plain-torch reference. Writes
nearest-in-attention-timing.json under --out. Three more forms of the search were measured and removed (in the
history at commit f689496; their timings are in benchmarks/results/d2o-nearest-in-attention-nvidia-h200/): the norms
computed from each K tile (the form of e26ed3c, 2.2x the attention at batch 1), a max and argmax over each tile, and
a lazy argmax.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
from pathlib import Path

import torch
from kvpass.kernels.d2o_evict_one import d2o_evict_one_triton, pick_one

from benchmarks.bench.timing import time_fn
from kvpass.kernels.decode_attention import decode_attention_triton
from kvpass.kernels.decode_attention_nearest import nearest_of_candidates_reference


def case(b: int, c: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    k = torch.randn(b, 8, c, 128, device="cuda", generator=g).to(torch.bfloat16)
    return dict(
        q=torch.randn(b, 32, 1, 128, device="cuda", generator=g).to(torch.bfloat16), k=k,
        v=torch.randn(b, 8, c, 128, device="cuda", generator=g).to(torch.bfloat16),
        lw=torch.zeros(b, 8, c, device="cuda"), cand=torch.randint(0, c, (b, 8, 4), device="cuda", generator=g),
        tfrom=torch.zeros(b, 8, dtype=torch.long, device="cuda"),
        near=[torch.empty(b, 8, 4, dtype=torch.long, device="cuda"), torch.empty(b, 8, 4, device="cuda"),
              torch.empty(b, 8, 4, dtype=torch.long, device="cuda")],
        inv=1.0 / k.float().norm(dim=-1).clamp(min=1e-12))


def evictions(b: int, c: int, x: dict[str, torch.Tensor], dev: torch.device) -> list[dict]:
    """``evict[scan]`` and ``evict[hit]`` of one layer at batch b."""
    keep = c - 1
    st = dict(k=x["k"], v=x["v"], col_sum=torch.rand(b, 8, c, device="cuda"),
              position=torch.arange(c, device="cuda").expand(b, 8, c).contiguous(),
              log_weight=torch.zeros(b, 8, c, device="cuda"), length=torch.full((b, 8), c, device="cuda"),
              tau=torch.zeros(b, device="cuda"), tau_set=torch.zeros(b, dtype=torch.bool, device="cuda"))
    e = pick_one(st["k"], st["v"], st["col_sum"], st["position"], st["length"], keep, 4, keep // 4).e
    hit = [torch.full((b, 8, 4), -1, dtype=torch.long, device="cuda"), torch.zeros(b, 8, dtype=torch.long,
           device="cuda"), x["inv"].clone(), e.expand(-1, -1, 4).contiguous(),
           torch.full((b, 8, 4), 0.5, device="cuda"), torch.zeros(b, 8, 4, dtype=torch.long, device="cuda")]
    saved = {n: st[n].clone() for n in ("col_sum", "position", "log_weight")}

    def rearm():
        st["length"].fill_(c)
        for n, t in saved.items():
            st[n].copy_(t)

    arm = time_fn(rearm, dev) * 1e6
    rows = []
    for name, state in (("evict[scan]", []), ("evict[hit]", hit)):
        def evict(state=state):
            rearm()
            d2o_evict_one_triton(st["k"], st["v"], st["col_sum"], st["position"], st["log_weight"], st["length"],
                                 st["tau"], st["tau_set"], [], state, keep, 4, keep // 4, 0.7, "paper")
        rows.append({"b": b, "variant": name, "us": time_fn(evict, dev) * 1e6 - arm})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--c", type=int, default=6555)
    ap.add_argument("--batches", default="1,4,8,16,32")
    a = ap.parse_args()
    dev = torch.device("cuda")
    importlib.import_module("kvpass.kernels.decode_attention_nearest").FUSE_FROM_BATCH = 1   # time every batch
    rows = []
    for b in (int(x) for x in a.batches.split(",")):
        x = case(b, a.c, b)
        nearest = (x["cand"], x["tfrom"], x["inv"], *x["near"])
        want_best, want_slot = nearest_of_candidates_reference(x["k"], x["lw"], x["cand"], x["tfrom"])
        for name, kw in (("attention", {}), ("nearest", dict(nearest=nearest))):
            def call(kw=kw, x=x):
                decode_attention_triton(x["q"], x["k"], x["v"], x["lw"], 1 / math.sqrt(128), None, True, **kw)
            row = {"b": b, "variant": name, "us": time_fn(call, dev) * 1e6}
            if kw:
                call()
                row["same_slots"] = float((x["near"][2] == want_slot).float().mean())
                row["max_cos_err"] = float((x["near"][1] - want_best).abs().max())
            rows.append(row)
        rows += evictions(b, a.c, x, dev)
        for r in rows[-4:]:
            print(r, flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "nearest-in-attention-timing.json").write_text(json.dumps(
        {"gpu": torch.cuda.get_device_name(), "c": a.c, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
