"""What finding D2O's next nearest keys inside the decode attention costs, one layer, graphed (session 39).

    PYTHONUNBUFFERED=1 python3 benchmarks/probes/nearest_in_attention_timing.py --out $OUT

Llama-3.1-8B's attention shape (Hq 32, Hkv 8, D 128, bf16), batch 1 and 32, C = 6555 slots (a 0.2 budget of 32k).
Each row is timed from a CUDA graph by ``time_fn`` (triton's do_bench, median):

* ``attention``: the decode attention with the per-slot scores, as D2O's step runs it;
* ``nearest[computed]``: the same launch with 4 candidates in the query tile, the keys' norms computed from each
  K tile (session 32's kernel, reverted for its cost on the H100);
* ``nearest[stored]``: the keys' inverse norms read from a [B, Hkv, C] fp32 tensor instead;
* ``...+lazy``: the argmax over a tile only where some candidate's best improves;
* ``...+elementwise``: a running (max, slot) per lane of the tile, reduced once after the loop;
* ``evict[scan]`` / ``evict[hit]``: D2O's one-in-one-out op (scores, positions and log-weights restored before
  each call, so every call evicts the same entries; the restore is timed apart and subtracted) with its nearest-key scan, and with the attention's
  result for its entry (the scan kernel's programs return at once); ``2 a split``: each split lists its 2 lowest
  entries for the next step's candidates, not M + 1.

Also checks that every nearest variant finds the same slots as the scanning reference where the top two cosines
are apart. Writes nearest-in-attention-timing.json under --out.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from benchmarks.bench.timing import time_fn
from kvpass.kernels.d2o_evict_one import d2o_evict_one_triton, pick_one
from kvpass.kernels.decode_attention import decode_attention_triton
from kvpass.kernels.decode_attention_nearest import nearest_of_candidates_reference


def case(b: int, c: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    k = torch.randn(b, 8, c, 128, device="cuda", generator=g).to(torch.bfloat16)
    cand = torch.randint(0, c, (b, 8, 4), device="cuda", generator=g)
    return dict(
        q=torch.randn(b, 32, 1, 128, device="cuda", generator=g).to(torch.bfloat16), k=k,
        v=torch.randn(b, 8, c, 128, device="cuda", generator=g).to(torch.bfloat16),
        lw=torch.zeros(b, 8, c, device="cuda"), cand=cand, tfrom=torch.zeros(b, 8, dtype=torch.long, device="cuda"),
        near=[torch.empty(b, 8, 4, dtype=torch.long, device="cuda"), torch.empty(b, 8, 4, device="cuda"),
              torch.empty(b, 8, 4, dtype=torch.long, device="cuda")],
        inv=1.0 / k.float().norm(dim=-1).clamp(min=1e-12))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--c", type=int, default=6555)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--variants", default="all", help="'all', or 'ew' (the plain attention, the elementwise search "
                    "under a launch sweep, and the evictions)")
    a = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for b in (int(x) for x in a.batches.split(",")):
        x = case(b, a.c, b)
        scale = 1 / math.sqrt(128)
        nearest = (x["cand"], x["tfrom"], *x["near"])
        variants = {"attention": {}, "nearest[computed]": dict(nearest=nearest),
                    "nearest[computed]+lazy": dict(nearest=nearest, lazy_argmax=True),
                    "nearest[stored]": dict(nearest=nearest, key_inv_norm=x["inv"]),
                    "nearest[stored]+lazy": dict(nearest=nearest, key_inv_norm=x["inv"], lazy_argmax=True),
                    "nearest[stored]+elementwise": dict(nearest=nearest, key_inv_norm=x["inv"], elementwise=True)}
        if a.variants == "ew":
            ew = dict(nearest=nearest, key_inv_norm=x["inv"], elementwise=True)
            variants = {"attention": {}, "nearest[stored]+elementwise": ew}
            for warps, stages, bn in ((4, 2, 128), (8, 3, 128), (8, 2, 128), (4, 3, 64), (4, 4, 64), (8, 3, 64)):
                variants[f"nearest[stored]+elementwise w{warps} s{stages} n{bn}"] = dict(
                    ew, num_warps=warps, num_stages=stages, block_n=bn)
        want_best, want_slot = nearest_of_candidates_reference(x["k"], x["lw"], x["cand"], x["tfrom"])
        for name, kw in variants.items():
            def call(kw=kw):
                decode_attention_triton(x["q"], x["k"], x["v"], x["lw"], scale, None, True, **kw)
            us = time_fn(call, dev) * 1e6
            row = {"b": b, "variant": name, "us": us}
            if "nearest" in kw:
                call()
                row["same_slots"] = float((x["near"][2] == want_slot).float().mean())
                row["max_cos_err"] = float((x["near"][1] - want_best).abs().max())
            rows.append(row)
            print(row, flush=True)
        # the eviction op: every row full and evicting, re-armed before each call (the fill timed apart)
        keep = a.c - 1
        st = dict(k=x["k"], v=x["v"], col_sum=torch.rand(b, 8, a.c, device="cuda"),
                  position=torch.arange(a.c, device="cuda").expand(b, 8, a.c).contiguous(),
                  log_weight=torch.zeros(b, 8, a.c, device="cuda"), length=torch.full((b, 8), a.c, device="cuda"),
                  tau=torch.zeros(b, device="cuda"), tau_set=torch.zeros(b, dtype=torch.bool, device="cuda"))
        e = pick_one(st["k"], st["v"], st["col_sum"], st["position"], st["length"], keep, 4, keep // 4).e
        hit_state = [torch.full((b, 8, 4), -1, dtype=torch.long, device="cuda"),
                     torch.zeros(b, 8, dtype=torch.long, device="cuda"),
                     e.expand(-1, -1, 4).contiguous(), torch.full((b, 8, 4), 0.5, device="cuda"),
                     torch.zeros(b, 8, 4, dtype=torch.long, device="cuda")]
        saved = {n: st[n].clone() for n in ("col_sum", "position", "log_weight")}

        def rearm():                                  # the same e every call, so a hit stays a hit
            st["length"].fill_(a.c)
            for n, t in saved.items():
                st[n].copy_(t)

        arm = time_fn(rearm, dev) * 1e6
        import kvpass.kernels.d2o_evict_one as evict_module
        for name, state, per_split in (("evict[scan]", [], None), ("evict[hit]", hit_state, None),
                                       ("evict[hit,2 a split]", hit_state, 2)):
            evict_module.NEXT_PER_SPLIT = per_split

            def evict(state=state):
                rearm()
                d2o_evict_one_triton(st["k"], st["v"], st["col_sum"], st["position"], st["log_weight"],
                                     st["length"], st["tau"], st["tau_set"], [], state, keep, 4, keep // 4, 0.7,
                                     "paper")
            row = {"b": b, "variant": name, "us": time_fn(evict, dev) * 1e6 - arm}
            rows.append(row)
            print(row, flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "nearest-in-attention-timing.json").write_text(json.dumps(
        {"gpu": torch.cuda.get_device_name(), "c": a.c, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
