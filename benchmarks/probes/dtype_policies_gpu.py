"""Every policy in every dtype at a real head size on the GPU: does prefill + decode run?

The Triton kernels are tested at small shapes under the interpreter on CPU, which has no shared-memory limit,
and on the GPU mostly in bf16. A launch whose tiles fit in bf16 can ask for twice the shared memory in fp32
(2026-11-28, before 2a52477: D2O on an fp32 model stopped with "out of resource: shared memory, Required: 279552, Hardware limit:
232448" on an H100). This probe runs every registered policy on a 2-layer Llama of head size 128 (8 query / 2
KV heads) in fp32, fp16 and bf16: a batch of 2 unequal prompts (left-padded), prefill, compression and
``--steps`` decode steps, and records per (policy, dtype) ``ok`` or the error and the kvpass kernel file its
traceback ends in. In fp32 it also checks ``full`` against transformers' greedy tokens.

    python benchmarks/probes/dtype_policies_gpu.py --out $OUT/dtype-policies.json [--prompt 2048 --steps 70]
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import re
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.bench.models import build_model  # noqa: E402
from benchmarks.bench.timing import gpu_name  # noqa: E402
from benchmarks.ragged_decode_gpu import SMALL_LLAMA, unequal_prompts  # noqa: E402

HEAD_128_LLAMA = dict(SMALL_LLAMA, hidden_size=1024, intermediate_size=2816, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2)


def kernel_of(tb: str) -> str | None:
    """The last kvpass/kernels file a traceback passes through (the op that failed), else None."""
    found = re.findall(r"kvpass/kernels/(\w+)\.py", tb)
    return found[-1] if found else None


def run_policy(kvpass, model, captured, policy: str, ids, mask, steps: int) -> list[torch.Tensor]:
    kv = kvpass.apply(model, policy, 0.2, captured=captured, compile=False)
    session = kv.start(ids, mask, max_new_tokens=steps + 1)
    tok = session.logits.argmax(-1)
    tokens = [tok]
    for _ in range(steps):
        tok = session.step(tok).argmax(-1)
        tokens.append(tok)
    if ids.is_cuda:
        torch.cuda.synchronize()
    return tokens


def main() -> int:
    import kvpass
    from kvpass.rewrites import capture_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=70)
    ap.add_argument("--dtypes", default="float32,float16,bfloat16")
    ap.add_argument("--policies", default=None, help="comma-separated (default: every registered policy)")
    ap.add_argument("--time-box", type=float, default=400.0)
    ap.add_argument("--device", default="cuda", help="cuda (default), or cpu to try the script")
    ap.add_argument("--debug-captures", action="store_true", help="log each failed capture's traceback")
    args = ap.parse_args()
    device = torch.device(args.device)
    if args.debug_captures:
        logging.basicConfig(level=logging.WARNING)
        logging.getLogger("kvpass.decode_step").setLevel(logging.DEBUG)
    policies = args.policies.split(",") if args.policies else sorted(kvpass.POLICIES)
    ids, mask = unequal_prompts(2, args.prompt, args.prompt // 4, HEAD_128_LLAMA["vocab_size"], seed=0)
    ids, mask = ids.to(device), mask.to(device)
    started, rows = time.monotonic(), []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        model = build_model(HEAD_128_LLAMA, device, dtype)
        captured = capture_model(model)
        for policy in policies:
            row = {"policy": policy, "dtype": dtype_name}
            if time.monotonic() - started > args.time_box:
                row["skipped"] = "time box"
                rows.append(row)
                continue
            t0 = time.monotonic()
            try:
                tokens = run_policy(kvpass, model, captured, policy, ids, mask, args.steps)
                row["ok"] = True
                if policy == "full" and dtype == torch.float32:
                    ref = model.generate(ids, attention_mask=mask, max_new_tokens=args.steps + 1, do_sample=False)
                    ours = torch.stack(tokens, dim=1)
                    row["full_equals_transformers"] = bool(torch.equal(ref[:, ids.shape[1]:], ours))
            except Exception as exc:  # noqa: BLE001  (recorded: the others still run)
                tb = traceback.format_exc()
                row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:400], kernel=kernel_of(tb),
                           traceback_tail=tb[-1500:])
            row["seconds"] = round(time.monotonic() - t0, 2)
            if args.debug_captures and device.type == "cuda":     # which graph pools hold segments now
                row["pools"] = sorted({str(tuple(seg.get("segment_pool_id", ())))
                                       for seg in torch.cuda.memory_snapshot()})
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "traceback_tail"}), flush=True)
        del model, captured
        if device.type == "cuda":
            gc.collect()
            try:                     # torch 2.11 asserted here after a failed capture (fixed in kvpass)
                torch.cuda.empty_cache()
            except RuntimeError as exc:
                rows.append({"dtype": dtype_name, "empty_cache_error": str(exc)[:400]})
                print(json.dumps(rows[-1]), flush=True)
    failed = [f"{r['policy']}/{r['dtype']}: {r.get('kernel')}" for r in rows if r.get("ok") is False]
    result = {"device": gpu_name(device) if device.type == "cuda" else "cpu", "torch": torch.__version__,
              "config": HEAD_128_LLAMA, "prompt": args.prompt, "steps": args.steps, "command": " ".join(sys.argv), "rows": rows, "failed": failed,
              "seconds": time.monotonic() - started}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print("failed:", failed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
