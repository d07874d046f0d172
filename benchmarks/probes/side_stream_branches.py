"""How many side streams the decode step's compression should fork over: D2O at budget 0.2 on the
Llama-3.1-8B-shaped random bf16 model, one prompt, every compressed layer evicting in every timed call.

    PYTHONUNBUFFERED=1 python3 benchmarks/probes/side_stream_branches.py --out $OUT

For each branch count: ``session.compress_layers`` over all layers, timed from a CUDA graph after the
buffers are re-armed (lengths set back to capacity), minus the re-arming alone, as ``kvpass bench``'s
decode-compression column does. Writes side-stream-branches.json under --out.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import kvpass
from benchmarks.bench.models import llama_8b_with_prompt
from benchmarks.bench.timing import time_fn


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prompt", type=int, default=32768)
    ap.add_argument("--branches", default="1,4,8,16,32")
    a = ap.parse_args()
    dev = torch.device("cuda")
    model, ids = llama_8b_with_prompt(a.prompt, dev)
    kv = kvpass.apply(model, "d2o", 0.2)
    session = kv.start(ids, max_new_tokens=16)
    tok = session.logits.argmax(-1)
    for _ in range(4):
        tok = session.step(tok).argmax(-1)
    due = [i for i, lay in enumerate(session.layers) if lay.compressible]

    def arm() -> None:
        for i in due:
            session.layers[i].cache.length.fill_(session.layers[i].cache.capacity)

    arm_ms = time_fn(arm, dev) * 1e3
    rows = []
    for n in (int(x) for x in a.branches.split(",")):
        kv.decode_step.branches = n                                      # side_streams makes n new streams

        def compress_all() -> None:
            arm()
            session.compress_layers(due)

        ms = time_fn(compress_all, dev) * 1e3 - arm_ms
        rows.append({"branches": n, "compress_ms": ms})
        print(f"branches {n}: {ms:.3f} ms for {len(due)} layers", flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "side-stream-branches.json").write_text(json.dumps(
        {"gpu": torch.cuda.get_device_name(), "prompt": a.prompt, "arm_ms": arm_ms, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
