"""Why does KVMerger's free generation collapse at small budgets? (issue 26, docs/quality.md, "Degeneration at small budgets")

On the degeneration check's essay prompts (``benchmarks/degeneration_check.py``: prefix tokens of essay
segment i), prefill + compress with one KVMerger configuration, then decode ``--gen-tokens`` greedy
tokens. Every call of ``KVMerger.compress`` is logged (the class method is wrapped; nothing else changes),
summed over layers and KV heads per compression event (the prompt's, then each decode one):

* sets: merge sets of >= 2 entries made this round, their mean / max size, and the largest log|S| held;
* k_norm / v_norm: mean L2 norm of this round's merged entries (pivots after the merge, as stored: |S| x the
  weighted mean value for value_scale='set_size') vs the unmerged live entries; v_mean_norm: the weighted
  mean value's norm (stored / |S|);
* kept_newest: whether the newest entry (the last prompt token at the prompt's compression) survives, and
  how many of the protected recent entries survive (recent_kept / recent), and the newest position kept.

Then where the output starts repeating (``loop_start``: the first token from which the rest of the output is
periodic with a period <= 8, or None). One prompt at a time (batch 1). CPU, ~1 min per configuration:

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/kvmerger_collapse.py --budget 0.1 \\
        --policies 'kvmerger[value_scale=none]' 'kvmerger[value_scale=none,overflow=tiered]' \\
        --json benchmarks/results/degeneration-kvmerger-collapse-smollm2-cpu.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):                      # run as a script from a plain checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from kvpass.cache import LayerCache
from kvpass.policies.kvmerger import SIZE, KVMerger


def loop_start(ids: Sequence[int], max_period: int = 8, min_tail: int = 8) -> int | None:
    """The first index from which ``ids`` repeats with a period <= max_period to its end (a tail of at least
    ``min_tail`` tokens), or None."""
    n = len(ids)
    best = None
    for p in range(1, max_period + 1):
        s = n - p                                  # walk back while ids[s - 1] == ids[s - 1 + p]
        while s - 1 >= 0 and ids[s - 1] == ids[s - 1 + p]:
            s -= 1
        if n - s >= max(min_tail, 2 * p) and (best is None or s < best):
            best = s
    return best


def compression_record(pol: KVMerger, before: LayerCache, keep: int, after: LayerCache) -> dict:
    """One ``compress`` call summed over its rows and KV heads (fp64 sums, plain Python numbers)."""
    plan = pol.plan(before, keep)
    c = before.capacity
    slot = torch.arange(c, device=before.k.device)
    live = before.live
    is_pivot = live & (plan.size > 1) & (plan.pivot == slot)
    n_r = torch.floor(torch.ceil(pol.recent_ratio * before.length.double()) * torch.clamp(
        keep / (torch.ceil(pol.recent_ratio * before.length.double())
                + torch.ceil(pol.heavy_ratio * before.length.double())).clamp(min=1), max=1.0)).long()
    recent = live & (slot >= (before.length - n_r)[..., None])
    kept_pos = after.position.masked_fill(~after.live, -1)                       # [B, Hkv, C']
    newest = before.position.masked_fill(~live, -1).amax(-1)                     # [B, Hkv]
    recent_pos = before.position.masked_fill(~recent, -2)
    recent_kept = (recent_pos[..., :, None] == kept_pos[..., None, :]).any(-1) & recent
    size_after = after.slot_meta.get(SIZE, torch.zeros_like(after.log_weight)).double()
    merged_after = after.live & (size_after > 1)
    # this round's pivots in the output: their position was a pivot's and their size changed to > 1
    pivot_pos = before.position.masked_fill(~is_pivot, -2)
    new_pivot_after = (kept_pos[..., :, None] == pivot_pos[..., None, :]).any(-1) & after.live
    plain_after = after.live & ~merged_after
    k_norm, v_norm = after.k.double().norm(dim=-1), after.v.double().norm(dim=-1)

    def mean(x: torch.Tensor, m: torch.Tensor) -> float | None:
        return round(float(x[m].mean()), 4) if bool(m.any()) else None

    # stored v of a set_size pivot is |S| x its weighted mean: per_token = stored / |S|
    v_mean = v_norm / (size_after.clamp(min=1) if pol.value_scale == "set_size" else 1.0)
    sizes = plan.size[is_pivot]
    return {
        "length": int(before.length.max()), "keep": keep, "protected": int(plan.protected.sum()),
        "sets": int(is_pivot.sum()), "mean_set": round(float(sizes.mean()), 2) if sizes.numel() else 0.0,
        "max_set": int(sizes.max()) if sizes.numel() else 0,
        "pivots_kept": int(new_pivot_after.sum()),
        "max_log_size_held": round(float(after.log_weight.masked_fill(~after.live, 0).max()), 3),
        "k_norm_merged": mean(k_norm, new_pivot_after), "k_norm_plain": mean(k_norm, plain_after),
        "v_norm_merged": mean(v_norm, new_pivot_after), "v_norm_plain": mean(v_norm, plain_after),
        "v_mean_norm_merged": mean(v_mean, new_pivot_after),
        "newest_kept": int((newest[..., None] == kept_pos).any(-1).sum()), "rows_heads": int(newest.numel()),
        "recent": int(recent.sum()), "recent_kept": int(recent_kept.sum()),
        "newest_pos": int(newest.max()), "newest_pos_kept": int(kept_pos.max()),
    }


def summarize_events(calls: list[dict], layers: int) -> list[dict]:
    """Calls in order -> one event per ``layers`` consecutive calls (a compression of every layer), summed
    (counts) or averaged over layers (norms, ratios)."""
    events = []
    for i in range(0, len(calls), layers):
        group = calls[i:i + layers]
        ev = {"event": len(events), "length": group[0]["length"], "keep": group[0]["keep"], "layers": len(group)}
        for key in ("protected", "sets", "pivots_kept", "newest_kept", "rows_heads", "recent", "recent_kept"):
            ev[key] = sum(g[key] for g in group)
        ev["mean_set"] = round(sum(g["mean_set"] for g in group) / len(group), 2)
        ev["max_set"] = max(g["max_set"] for g in group)
        ev["max_log_size_held"] = max(g["max_log_size_held"] for g in group)
        for key in ("k_norm_merged", "k_norm_plain", "v_norm_merged", "v_norm_plain", "v_mean_norm_merged"):
            xs = [g[key] for g in group if g[key] is not None]
            ev[key] = round(sum(xs) / len(xs), 3) if xs else None
        ev["newest_pos"], ev["newest_pos_kept"] = group[0]["newest_pos"], min(g["newest_pos_kept"] for g in group)
        events.append(ev)
    return events


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--prefix", type=int, default=1536)
    p.add_argument("--steps", type=int, default=48, help="the degeneration check's ppl steps (segment offsets)")
    p.add_argument("--gen-tokens", type=int, default=48)
    p.add_argument("--budget", type=float, default=0.1)
    p.add_argument("--policies", nargs="+", default=["kvmerger[value_scale=none]"])
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    import kvpass
    from kvpass.eval.common import eos_pad, load, set_threads
    from kvpass.rewrites import capture_model
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from degeneration_check import essay_prompts, repetition_metrics

    set_threads(1)
    loaded = load(args.model, "cpu")
    ids = essay_prompts(loaded.tokenizer, args.prompts, args.prefix, args.steps)[:, :args.prefix]
    eos_ids, pad = eos_pad(loaded.model)
    captured = capture_model(loaded.model)
    calls: list[dict] = []
    original = KVMerger.compress

    def logged(self, cache, keep):
        out = original(self, cache, keep)
        if bool((cache.length > keep).any()):
            calls.append(compression_record(self, cache, keep, out))
        return out

    KVMerger.compress = logged
    results = []
    try:
        for spec in args.policies:
            kv = kvpass.apply(loaded.model, spec, args.budget, captured=captured, compile=False)
            layers = sum(1 for lay in getattr(kv, "layers", []) if getattr(lay, "compressible", True)) or None
            for i in range(args.prompts):
                calls.clear()
                session = kv.start(ids[i:i + 1], max_new_tokens=args.gen_tokens)
                tokens, _ = session.sample(args.gen_tokens, eos_ids, pad, do_sample=False)
                out = tokens[0].tolist()
                out = out[:next((j for j, t in enumerate(out) if t in set(eos_ids.tolist())), len(out))]
                text = loaded.tokenizer.decode(out, skip_special_tokens=True)
                n_layers = layers or loaded.model.config.num_hidden_layers
                events = summarize_events(calls, n_layers)
                start = loop_start(out)
                rec = {"policy": spec, "budget": args.budget, "prompt": i, "text": text,
                       "metrics": repetition_metrics(out, text), "loop_start": start,
                       "loop_text": loaded.tokenizer.decode(out[start:start + 8]) if start is not None else None,
                       "events": events}
                results.append(rec)
                print(f"== {spec} @ {args.budget}, prompt {i}: loop_start {start}, {rec['metrics']}\n   {text!r}")
                for ev in events:
                    print("   ", {k: v for k, v in ev.items() if k != "layers"})
    finally:
        KVMerger.compress = original
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
