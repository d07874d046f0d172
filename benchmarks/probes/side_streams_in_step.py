"""How many side streams D2O's per-step eviction should fork over, timed inside whole decode steps.

    PYTHONPATH=. PYTHONUNBUFFERED=1 python benchmarks/probes/side_streams_in_step.py --out $OUT/side-streams-in-step.json \
        [--batch 1] [--branches 8,4,2,1,8,4,2,1] [--policy d2o]

``benchmarks/probes/side_stream_branches.py`` chose the count (8) from the compressions timed alone. In a step
the layers' evictions are forked at its start and each layer's attention waits for its own
(``kvpass.decode_step.fork_side_by_side``): with many streams the first layers' evictions run at once, beside
the first GEMVs, and layer 0 waits for a slowed eviction. One model (Llama-3.1-8B shape, random bf16 weights,
compiled by ``kvpass.apply``), one prompt of ``--prompt`` tokens prefilled once; then for each count in
``--branches`` (repeated to see the spread): the step's CUDA graphs are dropped, ``--warmup`` steps recapture
them, and ``--steps`` steps are timed with CUDA events.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import kvpass  # noqa: E402
from benchmarks.bench.models import LLAMA_8B, TINY_LLAMA  # noqa: E402
from benchmarks.bench.timing import gpu_name  # noqa: E402
from benchmarks.chunked_prefill_gpu import _Clock, build_model  # noqa: E402
from benchmarks.compiled_default_gpu import random_ids  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="a .json file")
    ap.add_argument("--policy", default="d2o")
    ap.add_argument("--budget", type=float, default=0.2)
    ap.add_argument("--prompt", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--branches", default="8,4,2,1,8,4,2,1")
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--smoke", action="store_true", help="CPU, a 2-layer model, a 192-token prompt (no side streams)")
    args = ap.parse_args(argv)
    device = torch.device("cpu" if args.smoke else "cuda")
    counts = [int(x) for x in args.branches.split(",")]
    total = len(counts) * (args.warmup + args.steps) + 8
    prompt = 192 if args.smoke else args.prompt
    model = build_model(TINY_LLAMA if args.smoke else LLAMA_8B, device,
                        torch.float32 if args.smoke else torch.bfloat16, prompt + total + 64)
    kv = kvpass.apply(model, args.policy, args.budget)
    if args.batch > 1:
        kv.prefill_rows = 1
    session = kv.start(random_ids(model.config.vocab_size, prompt, 0, device, args.batch), max_new_tokens=total)
    tok = session.logits.argmax(-1)
    for _ in range(8):                       # the first compressions and the compilation
        tok = session.step(tok).argmax(-1)
    rows = []
    for n in counts:
        kv.decode_step.fork_branches = n     # the next capture forks over n streams
        kv.decode_step.reset()
        for _ in range(args.warmup):
            tok = session.step(tok).argmax(-1)
        clock = _Clock(device)
        clock.start()
        for _ in range(args.steps):
            tok = session.step(tok).argmax(-1)
        ms = clock.stop() / args.steps * 1e3
        rows.append({"branches": n, "ms_per_step": ms})
        print(f"[side-streams-in-step] branches {n}: {ms:.4f} ms a step", flush=True)
    by_count = {n: sorted(r["ms_per_step"] for r in rows if r["branches"] == n) for n in dict.fromkeys(counts)}
    result = {"gpu": gpu_name(device) if device.type == "cuda" else "cpu", "policy": args.policy,
              "budget": args.budget, "prompt": prompt, "batch": args.batch, "warmup": args.warmup, "steps": args.steps, "rows": rows,
              "ms_per_step_by_branches": by_count, "argv": sys.argv[1:] if argv is None else argv}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"[side-streams-in-step] {by_count}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
