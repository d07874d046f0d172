"""Whether one GEMV over concatenated weights beats sibling GEMVs that read the same input, at the
Llama-3.1-8B shapes of a decode step (q/k/v: 4096 -> 4096 + 1024 + 1024; gate/up: 4096 -> 2 x 14336).

    PYTHONUNBUFFERED=1 python3 benchmarks/probes/sibling_linears.py --out $OUT

For each batch: --layers layers' worth of a block's linears (q, k, v, o, gate, up, down; bf16, random)
run back to back from one CUDA graph, with q/k/v and gate/up as separate GEMVs or as one each, timed by
``time_fn`` (do_bench median, L2 flushed). The floor is the weights' bytes over the copy bandwidth
measured in the same run. Writes sibling-linears.json under --out.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.bench.timing import copy_bandwidth, time_fn


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batches", default="1,4,16,32")
    a = ap.parse_args()
    dev, dt, h, kv, inter = torch.device("cuda"), torch.bfloat16, 4096, 1024, 14336

    def w(n: int, k: int) -> torch.Tensor:
        return torch.randn(n, k, device=dev, dtype=dt) * k ** -0.5

    layers = [{"q": w(h, h), "k": w(kv, h), "v": w(kv, h), "o": w(h, h), "gate": w(inter, h), "up": w(inter, h),
               "down": w(h, inter)} for _ in range(a.layers)]
    for lay in layers:
        lay["qkv"] = torch.cat([lay["q"], lay["k"], lay["v"]])
        lay["gate_up"] = torch.cat([lay["gate"], lay["up"]])
    weight_bytes = sum(lay[n].numel() * 2 for lay in layers for n in ("q", "k", "v", "o", "gate", "up", "down"))
    copy_bw = copy_bandwidth(dev, 1 << 30)

    def separate(x: torch.Tensor) -> torch.Tensor:
        for lay in layers:
            q, _, _ = F.linear(x, lay["q"]), F.linear(x, lay["k"]), F.linear(x, lay["v"])
            y = F.linear(q, lay["o"])
            g, u = F.linear(y, lay["gate"]), F.linear(y, lay["up"])
            x = F.linear(F.silu(g) * u, lay["down"])
        return x

    def fused(x: torch.Tensor) -> torch.Tensor:
        for lay in layers:
            q = F.linear(x, lay["qkv"])[..., :h]
            y = F.linear(q, lay["o"])
            g, u = F.linear(y, lay["gate_up"]).split(inter, dim=-1)
            x = F.linear(F.silu(g) * u, lay["down"])
        return x

    rows = []
    for b in (int(s) for s in a.batches.split(",")):
        x = torch.randn(b, h, device=dev, dtype=dt)
        got, want = fused(x), separate(x)
        row = {"batch": b, "max_abs_diff": float((got.float() - want.float()).abs().max())}
        for name, fn in (("separate", separate), ("fused", fused)):
            s = time_fn(lambda fn=fn, x=x: fn(x), dev)
            row[f"{name}_ms"] = s * 1e3
            row[f"{name}_x_floor"] = s / (weight_bytes / copy_bw)
        row["fused_over_separate"] = row["fused_ms"] / row["separate_ms"]
        rows.append(row)
        print(row, flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "sibling-linears.json").write_text(json.dumps(
        {"gpu": torch.cuda.get_device_name(), "layers": a.layers, "copy_GBps": copy_bw / 1e9,
         "floor_ms": weight_bytes / copy_bw * 1e3, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
