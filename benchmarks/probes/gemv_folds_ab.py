"""The decode step with and without the GEMV folds (RMSNorm into q/k/v and gate/up, residual adds into o and
down: ``linears_to_gemv(..., fold_norms=...)``), in one process on one GPU: ``compiled_default_gpu.main`` per
arm (32k, batch 1, the Llama-3.1-8B-shaped random bf16 model, plain ``kvpass.apply``), arms interleaved
``--rounds`` times so a drift of the machine shows as a spread, not as a difference.

    PYTHONPATH=$PWD python3 benchmarks/probes/gemv_folds_ab.py --out $OUT/gemv-folds-ab-<gpu>.json \\
        --policies "streamingllm,snapkv[kernel=31]"
"""

from __future__ import annotations

import argparse
import functools
import json
import tempfile
from pathlib import Path

import benchmarks.compiled_default_gpu as bench
import kvpass.rewrites.pipeline as pipeline
from kvpass.rewrites.linears_to_gemv import linears_to_gemv


def run_arm(folded: bool, policies: str, steps: int, time_limit: float) -> dict:
    pipeline.linears_to_gemv = functools.partial(linears_to_gemv, fold_norms=folded)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "arm.json"
            bench.main(["--no-generate", "--sweep", "0", "--steps", str(steps), "--time-limit", str(time_limit),
                        "--policies", policies, "--out", str(out)])
            return json.loads(out.read_text())
    finally:
        pipeline.linears_to_gemv = linears_to_gemv


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="the .json file to write")
    ap.add_argument("--policies", default="streamingllm,snapkv[kernel=31]")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--time-limit", type=float, default=240.0, help="per arm")
    args = ap.parse_args()
    arms = []
    for r in range(args.rounds):
        for folded in (True, False):
            res = run_arm(folded, args.policies, args.steps, args.time_limit)
            rows = {p: {k: v for k, v in row.items() if k in ("ms_per_token", "floor_ms", "over_floor", "error")}
                    for p, row in res["speed"].items()}
            arms.append({"round": r, "folded": folded, "rows": rows, "setup": res["setup"],
                         "device": res["config"]["device"]})
            print(f"[gemv-folds-ab] round {r} folded={folded}: {rows}", flush=True)
    summary = {}
    for p in bench.split_specs(args.policies):
        for folded in (True, False):
            ms = [a["rows"][p]["ms_per_token"] for a in arms if a["folded"] is folded and "ms_per_token" in a["rows"].get(p, {})]
            summary.setdefault(p, {})["folded" if folded else "unfolded"] = ms
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"arms": arms, "ms_per_token": summary}, indent=1) + "\n")
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
