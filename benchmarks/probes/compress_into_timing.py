"""What one layer's decode-time compression costs on a GPU: ``compress_into`` (the runtime's in-place call)
against the general path (``load_into(cache, compress(cache, keep))``), at a Llama-3.1-8B layer's shape after a
32k prompt at budget 0.2 (batch 1, 8 KV heads, D 128, bf16, keep 6554, capacity keep + interval, every slot
live), and the selection alone: torch's top-k and sort of the rows against ``lowest_slots``.

    PYTHONUNBUFFERED=1 python3 benchmarks/probes/compress_into_timing.py --out $OUT/compress-into-<gpu>.json

Each call restores the full layer first (a copy into the same buffers; its own time is measured and
subtracted) and runs captured in a CUDA graph, as the decode step replays it (``time_fn``: median).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import kvpass
from benchmarks.bench.timing import time_fn
from kvpass.cache import LayerCache, load_into
from kvpass.kernels.lowest_slots import lowest_slots


def full_layer(b: int, hkv: int, c: int, d: int, device: torch.device, names: tuple[str, ...]) -> LayerCache:
    """Every slot live, positions 0..C-1, random K, V and positive random slot scores."""
    gen = torch.Generator(device=device).manual_seed(0)
    meta = {n: torch.rand(b, hkv, c, generator=gen, device=device) for n in names}
    return LayerCache(k=torch.randn(b, hkv, c, d, generator=gen, device=device).bfloat16(),
                      v=torch.randn(b, hkv, c, d, generator=gen, device=device).bfloat16(),
                      log_weight=torch.zeros(b, hkv, c, device=device),
                      length=torch.full((b, hkv), c, dtype=torch.long, device=device),
                      position=torch.arange(c, device=device).expand(b, hkv, c).contiguous(), slot_meta=meta)


def restore(dst: LayerCache, src: LayerCache) -> None:
    for a, z in zip(dst.tensors(), src.tensors(), strict=True):
        a.copy_(z)


def time_policy(spec: str, keep: int, dev: torch.device) -> dict:
    """One layer's ``compress_into`` and general path, each after a restore (subtracted), in microseconds."""
    policy = kvpass.get_policy(spec)
    c = keep + max(getattr(policy, "interval", 16), 16)
    saved = full_layer(1, 8, c, 128, dev, tuple(s.value for s in policy.stats))
    cache = LayerCache(**{f: getattr(saved, f).clone() for f in ("k", "v", "log_weight", "length", "position")},
                       slot_meta={n: t.clone() for n, t in saved.slot_meta.items()})
    row: dict = {"capacity": c, "restore_us": time_fn(lambda: restore(cache, saved), dev) * 1e6}
    paths = {"compress_into": lambda: policy.compress_into(cache, keep),
             "general": lambda: load_into(cache, policy.compress(cache, keep))}
    for name, fn in paths.items():
        def call(fn=fn) -> None:
            restore(cache, saved)
            fn()
        try:
            us = time_fn(call, dev) * 1e6
            row[f"{name}_graphed"] = True
        except Exception as exc:       # noqa: BLE001  (a path that syncs cannot be captured: time it eagerly)
            row[f"{name}_capture_error"] = repr(exc)[:200]
            us = time_fn(call, dev, graph=False) * 1e6
            row[f"{name}_graphed"] = False
        row[f"{name}_us"] = us - row["restore_us"]
    restore(cache, saved)
    policy.compress_into(cache, keep)
    row["length_after"] = int(cache.length.max())
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--keep", type=int, default=6554)
    ap.add_argument("--policies", default="streamingllm,snapkv[kernel=31],h2o")
    a = ap.parse_args()
    dev = torch.device("cuda")
    result: dict = {"gpu": torch.cuda.get_device_name(), "keep": a.keep, "policies": {}}
    for spec in a.policies.split(","):
        result["policies"][spec] = row = time_policy(spec, a.keep, dev)
        print(spec, row, flush=True)
    age = torch.randperm(a.keep + 16, device=dev).expand(8, -1).contiguous()[None]
    result["selection"] = {
        "topk_20_smallest_us": time_fn(lambda: age.topk(20, dim=-1, largest=False), dev) * 1e6,
        "sort_us": time_fn(lambda: age.sort(dim=-1), dev) * 1e6,
        "sort_stable_float64_us": time_fn(lambda: age.double().sort(dim=-1, stable=True), dev) * 1e6,
        "topk_keep_float64_us": time_fn(lambda: age.double().topk(a.keep, dim=-1), dev) * 1e6,
        "lowest_slots_20_us": time_fn(lambda: lowest_slots(age, 20), dev) * 1e6,
        "lowest_slots_16_float32_us": time_fn(lambda: lowest_slots(age.float(), 16), dev) * 1e6,
    }
    result["selection"]["lowest_slots_matches_sort"] = bool(torch.equal(lowest_slots(age, 20), age.sort(-1).indices[..., :20]))
    print("selection", result["selection"], flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
