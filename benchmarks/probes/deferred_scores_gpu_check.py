"""Deferred scores on a GPU (the CUDA kernels, CUDA-graph replays): D2O with ``interval`` m keeps the decode steps'
queries and adds their rows at each compression; against every step returning its row (``defer_scores=False``),
the same fed tokens must keep the same entries with the same accumulated scores, up to rounding.

    PYTHONUNBUFFERED=1 python3 benchmarks/probes/deferred_scores_gpu_check.py --out $OUT

Llama-3.1-8B's layer shape (``--layers`` 4 of them), random bf16 weights, batch ``--batch`` (4) of ``--prompt``
(4096) random tokens, budget 0.2, ``--steps`` (48) fed tokens (teacher forcing, the same for both), eager graphs
replayed from CUDA graphs (``compile=False``: the compiled path is timed by compiled_default_gpu.py). Writes
deferred-scores-gpu-check.json: per layer whether the kept positions are equal and the largest relative
difference of ``col_sum``, and the largest logit difference over the steps.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import kvpass
from benchmarks.bench.models import LLAMA_8B
from benchmarks.chunked_prefill_gpu import build_model
from kvpass.runtime.recent_queries import add_recent_rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--interval", type=int, default=16)
    a = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")        # cpu: a smoke run of the script
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = build_model({**LLAMA_8B, "num_hidden_layers": a.layers}, dev, dtype, a.prompt + a.steps + 64)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, model.config.vocab_size, (a.batch, a.prompt), generator=gen).to(dev)
    fed = torch.randint(1, model.config.vocab_size, (a.steps, a.batch), generator=gen).to(dev)
    spec = f"d2o[interval={a.interval}]"
    sessions, logits = {}, {}
    for name, options in (("deferred", {}), ("per_step", {"defer_scores": False})):
        kv = kvpass.apply(model, spec, 0.2, compile=False, **options)
        session = kv.start(ids, max_new_tokens=a.steps + 1)
        logits[name] = torch.stack([session.step(t) for t in fed])
        sessions[name] = (kv, session)
    kv, deferred = sessions["deferred"]
    for site, lay in zip(kv.graphs.sites, deferred.layers, strict=True):
        add_recent_rows(lay.cache, site)                       # the queries still waiting
    layers = []
    for lay_a, lay_b in zip(deferred.layers, sessions["per_step"][1].layers, strict=True):
        ca, cb = lay_a.cache.slot_meta["col_sum"], lay_b.cache.slot_meta["col_sum"]
        layers.append({"same_positions": bool(torch.equal(lay_a.cache.position, lay_b.cache.position)),
                       "col_sum_max_rel_diff": float(((ca - cb).abs() / cb.abs().clamp(min=1e-6)).max()),
                       "col_sum_max": float(cb.max())})
    out = {"gpu": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "policy": spec, "config": vars(a) | {"out": str(a.out)},
           "command": "python3 benchmarks/probes/deferred_scores_gpu_check.py " + " ".join(sys.argv[1:]),
           "compressions": [s.compressions for _, s in sessions.values()],
           "logits_max_abs_diff": float((logits["deferred"] - logits["per_step"]).abs().max()),
           "argmax_agree": float((logits["deferred"].argmax(-1) == logits["per_step"].argmax(-1)).float().mean()),
           "layers": layers}
    print(json.dumps({k: v for k, v in out.items() if k != "layers"}), [r["same_positions"] for r in layers],
          max(r["col_sum_max_rel_diff"] for r in layers), flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "deferred-scores-gpu-check.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
