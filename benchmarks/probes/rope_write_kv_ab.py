"""The decode step with and without ``rope_into_write_kv`` (each layer's q and k rotations in the cache write's
launch), in one process on one GPU: ``compiled_default_gpu.main`` per arm (32k, batch 1, the Llama-3.1-8B-shaped
random bf16 model, plain ``kvpass.apply``), the arms interleaved ``--rounds`` times.

    PYTHONPATH=$PWD python3 benchmarks/probes/rope_write_kv_ab.py --out $OUT/rope-write-kv-ab-<gpu>.json \\
        --policies "streamingllm,snapkv[kernel=31],d2o"
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import benchmarks.compiled_default_gpu as bench
import kvpass.rewrites.pipeline as pipeline


def run_arm(fused: bool, policies: str, steps: int, time_limit: float) -> dict:
    original = pipeline.rope_into_write_kv
    if not fused:
        pipeline.rope_into_write_kv = lambda gm: 0
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "arm.json"
            bench.main(["--no-generate", "--sweep", "0", "--steps", str(steps), "--time-limit", str(time_limit),
                        "--policies", policies, "--out", str(out)])
            return json.loads(out.read_text())
    finally:
        pipeline.rope_into_write_kv = original


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="the .json file to write")
    ap.add_argument("--policies", default="streamingllm,snapkv[kernel=31],d2o")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--time-limit", type=float, default=200.0, help="per arm")
    args = ap.parse_args()
    arms, summary = [], {}
    for r in range(args.rounds):
        for fused in (True, False):
            res = run_arm(fused, args.policies, args.steps, args.time_limit)
            rows = {p: {k: v for k, v in row.items() if k in ("ms_per_token", "floor_ms", "over_floor", "error")}
                    for p, row in res["speed"].items()}
            arms.append({"round": r, "fused": fused, "rows": rows, "setup": res["setup"],
                         "device": res["config"]["device"]})
            for p, row in rows.items():
                if "ms_per_token" in row:
                    summary.setdefault(p, {}).setdefault("fused" if fused else "unfused", []).append(row["ms_per_token"])
            print(f"[rope-write-kv-ab] round {r} fused={fused}: {rows}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"arms": arms, "ms_per_token": summary}, indent=1) + "\n")
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
