"""How close D2O under ``interval`` m > 1 stays to the paper's one-in-one-out step, entry by entry (CPU, SmolLM2).

For each policy the probe runs the quality suite on the same case (seed 0 of one cell) (``kvpass eval suite run``, one process each)
with a hook on ``D2O.compress_into`` / ``compress_rows_into`` that keeps, after every compression of every layer,
batch row 0's live positions and K|V rows (every KV head). At each newest position where both forms compressed
(every interval step), it compares with ``--base`` (default ``d2o``):

    kept_differ  the entries one form holds and the other does not (both directions), over the entries held
    rel_dev      |x_int - x_base| / |x_base| of the K|V row of each position both hold: mean, p90, max, apart for
                 the prompt's entries (only merges move them) and the decode steps'

    PYTHONPATH=$PWD python benchmarks/probes/d2o_interval_fidelity.py --out d2o-interval-fidelity.json \\
        --policies "d2o[interval=16]" "d2o[interval=16,merge_chains=False]"

On essay cloze (512 tokens, query-agnostic, seed 0; benchmarks/results/d2o-merge-chains-smollm2-cpu/): without merging the kept sets agree at the
compression points, so what separates the two forms there is the merged values.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile

import torch

import kvpass.policies.d2o as d2o_module
from kvpass.cli import main as kvpass_main

Snapshots = list[dict[int, tuple[list[list[int]], torch.Tensor]]]   # per layer: newest -> (positions, K|V)


def record(policy: str, args: argparse.Namespace) -> Snapshots:
    """Run one suite cell for ``policy`` and return every layer's snapshots (layers in first-compression order)."""
    layers: dict[int, dict] = {}
    originals = {name: getattr(d2o_module.D2O, name) for name in ("compress_into", "compress_rows_into")}

    def hooked(orig):
        def step(self, cache, keep):
            orig(self, cache, keep)
            pos = cache.position[0]                                          # [Hkv, C]
            heads = [p[p >= 0].tolist() for p in pos]
            kv = torch.cat((cache.k[0], cache.v[0]), dim=-1).double().clone()   # [Hkv, C, 2D]
            layers.setdefault(id(cache), {})[max(max(h) for h in heads)] = (heads, kv)
        return step

    try:
        for name, orig in originals.items():
            setattr(d2o_module.D2O, name, hooked(orig))
        with tempfile.TemporaryDirectory() as tmp:
            kvpass_main(["eval", "suite", "run", "--model", "smollm2", "--families", args.family, "--lengths",
                         str(args.length), "--cases", "1", "--budgets", str(args.budget), "--modes",
                         args.mode, "--no-reference", "--batch", "1", "--policies", policy, "--out-dir", tmp,
                         "--store", f"{tmp}/store.json.gz"])
    finally:
        for name, orig in originals.items():
            setattr(d2o_module.D2O, name, orig)
    return list(layers.values())


def compare(base: Snapshots, other: Snapshots) -> dict:
    """The module docstring's figures over every layer, head and shared compression point, for the prompt's entries
    (identical after the shared prefill: only merges move them) and the decode steps' (their K, V also follow what
    the earlier layers attended to, so they differ wherever the caches did)."""
    first_decode = min(min(layer) for layer in base)          # the first step's position: the base compresses there
    devs: dict[str, list[float]] = {"prompt": [], "decode": []}
    held, differ = 0, 0
    for a, b in zip(base, other, strict=True):
        for newest, (heads_b, kv_b) in b.items():
            if newest not in a:
                continue
            heads_a, kv_a = a[newest]
            for g, (pa, pb) in enumerate(zip(heads_a, heads_b, strict=True)):
                slot_a = {p: i for i, p in enumerate(pa)}
                held += len(pa)
                differ += len(set(pa) ^ set(pb))
                for j, p in enumerate(pb):
                    if p in slot_a:
                        x = kv_a[g, slot_a[p]]
                        dev = float((kv_b[g, j] - x).norm() / x.norm().clamp(min=1e-12))
                        devs["prompt" if p < first_decode else "decode"].append(dev)
    out: dict = {"kept_differ": differ / max(held, 1), "first_decode_position": first_decode}
    for part, values in devs.items():
        d = torch.tensor(values, dtype=torch.float64)
        out[part] = {"entries": len(values), "rel_dev_mean": float(d.mean()), "rel_dev_p90": float(d.quantile(0.9)),
                     "rel_dev_max": float(d.max()), "share_above_1e-3": float((d > 1e-3).double().mean())}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", nargs="+", default=["d2o[interval=16]", "d2o[interval=16,merge_chains=False]"])
    ap.add_argument("--base", default="d2o")
    ap.add_argument("--family", default="essay_qa")
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--budget", type=float, default=0.2)
    ap.add_argument("--mode", default="query_agnostic", choices=["query_agnostic", "query_aware"])
    ap.add_argument("--out", default=None, help="a .json file (default: print only)")
    args = ap.parse_args(argv)
    base = record(args.base, args)
    out = {"config": vars(args), "against": args.base,
           "policies": {p: compare(base, record(p, args)) for p in args.policies}}
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
