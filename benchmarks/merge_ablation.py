"""What costs D2O (and EMS) with window scores against SnapKV[kernel=31] on the quality suite's single needle:
one factor at a time (issue 26; docs/quality.md, "Merging against the eviction it builds on").

A fixed probe of the suite's own cases (``kvpass.eval.tasks.single_needle``, the generator the leaderboard
uses): the first ``--numbers`` seeds whose needle is a 7-digit number and the first ``--words`` seeds whose
needle is a quoted one-word passphrase, at each ``--lengths``; query-aware, greedy, the suite's 12 answer
tokens. Every variant is a policy spec (``VARIANTS``: label -> spec) scored by ``kvpass.eval.suite.run``, so a
record is exactly the leaderboard's (one prefill per batch shared by the variants whose statistics agree).

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/merge_ablation.py --numbers 16 --words 8 --budgets 0.2 \\
        --store /tmp/merge-ablation-cases.json --json benchmarks/results/merge-ablation-cpu.json

``--variants`` picks labels (default: all); the store is resumable, so variants and budgets can be added by
re-running with the same ``--store``. The JSON holds per (variant, budget): correct / cases overall and per
format, and every case's output (the wrong ones say where the tokens went: truncated, repeated or wrong digits).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

import kvpass.policies.d2o.in_place as d2o_in_place
import kvpass.policies.d2o.reference as d2o_reference
from kvpass.cache import LayerCache, gather_slots, keep_slots
from kvpass.eval import suite
from kvpass.eval.common import load, set_threads
from kvpass.eval.store import Store
from kvpass.eval.tasks import single_needle
from kvpass.kernels.cosine_match import cosine_match_reference
from kvpass.policies import POLICIES
from kvpass.policies.d2o import D2O, TAU, TAU_SET
from kvpass.policies.d2o.merge import averaged, threshold_and_merge, unprotected
from kvpass.policies.d2o.reference import sums_into
from kvpass.policies.selection import kept_slots, ordered_slots, select_kept


@dataclass(frozen=True)
class D2OAblation(D2O):
    """Ablation-only D2O (registered by this script alone, as ``d2o_ablation``): which part of a prefill merge
    garbles the needle. ``merge_kv``: "both" (D2O), "keys" (values stay the kept entry's own) or "values" (keys
    stay); ``recent_absorbs=False``: the recent window (the newest ``recent`` positions of the
    row) is no merge target. Which tokens merge where (nearest kept key, EMA threshold, guards) is D2O's. Only
    the general (prefill) path changes, so run these with ``interval`` >= the answer length (no decode-time
    compression). The reference (``kvpass.policies.d2o.reference.compress_reference``) restated with those two
    changes."""

    name: ClassVar[str] = "d2o_ablation"
    merge_kv: str = "both"
    recent_absorbs: bool = True

    def compress(self, cache: LayerCache, keep: int) -> LayerCache:
        sinks, recent, target_from = self._protected(keep)
        score = self._score_name(cache)
        kept = select_kept(cache.slot_meta[score], cache.length, keep, sinks, recent)
        out = keep_slots(cache, kept_slots(kept, keep))
        n_evicted = cache.capacity - out.capacity
        if n_evicted <= 0:
            return out
        evicted = cache.live & ~kept
        e_idx = ordered_slots(evicted, n_evicted)                                  # [B, Hkv, E]
        valid = torch.gather(evicted, 2, e_idx)
        k_e, v_e = gather_slots(cache.k, e_idx), gather_slots(cache.v, e_idx)
        targets = out.live & (torch.arange(out.capacity) >= target_from)
        opts = self.step_options()
        if opts.protect > 0:
            targets = targets & unprotected(out.slot_meta[score], out.live, int(opts.protect * keep))
        if not self.recent_absorbs:
            newest = out.position.max(-1, keepdim=True).values
            targets = targets & (out.position <= newest - recent)
        nearest, u_star = cosine_match_reference(k_e, out.k, targets)
        valid = valid & (nearest >= 0)
        nearest, u_star = nearest.clamp(min=0), torch.where(valid, u_star, 0.0)
        b = cache.k.shape[0]
        tau = cache.state[TAU].clone() if TAU in cache.state else torch.zeros(b)
        tau_set = cache.state[TAU_SET].clone() if TAU_SET in cache.state else torch.zeros(b, dtype=torch.bool)
        out.state[TAU], out.state[TAU_SET] = tau, tau_set
        merged, w_e = d2o_reference.threshold_and_merge(self.heads, u_star, valid, tau, tau_set, opts)
        w_self = opts.w_self
        count, w_sum, (k_acc, v_acc) = sums_into(nearest, merged.float(), w_e, (k_e, v_e),
                                                 (w_self * out.k.float(), w_self * out.v.float()))
        for name, acc in (("k", k_acc), ("v", v_acc)):
            if (name, self.merge_kv) in (("k", "values"), ("v", "keys")):
                continue
            setattr(out, name, averaged(getattr(out, name), acc, w_self, w_sum[..., None], count[..., None], opts))
        return out


POLICIES.setdefault(D2OAblation.name, D2OAblation)

W31 = "scores=window,window_kernel=31"
# label -> policy spec. One factor changed at a time from ``d2o-w31`` (the leaderboard's best D2O row).
VARIANTS: dict[str, str] = {
    "full": "full",
    "snapkv-k31": "snapkv[kernel=31]",
    "h2o": "h2o",
    "d2o": "d2o",
    "d2o-w31": f"d2o[{W31}]",
    "d2o-w31-uniform": f"d2o[{W31},allocation=uniform]",                     # (a) layer allocation
    "d2o-w31-nm7:1": f"d2o[{W31},n_m_ratio=7:1]",                            # (b) N:M split
    "d2o-w31-nm31:1": f"d2o[{W31},n_m_ratio=31:1]",
    "d2o-w31-interval16": f"d2o[{W31},interval=16]",                         # (c) decode eviction
    "d2o-w31-nomerge": f"d2o[{W31},merge=false]",                            # (d) the merge
    "d2o-w31-guard-bias": f"d2o[{W31},merge_floor=0.5,merge_into_sinks=false,merge_bias=true]",
    "d2o-w31-protect25": f"d2o[{W31},merge_protect=0.25]",                    # the guard this ablation led to
    "d2o-w31-protect50": f"d2o[{W31},merge_protect=0.5]",
    "d2o-w31-protect75": f"d2o[{W31},merge_protect=0.75]",
    "d2o-w31-protect90": f"d2o[{W31},merge_protect=0.9]",
    "d2o-w31-protect50-floor80": f"d2o[{W31},merge_protect=0.5,merge_floor=0.8]",
    "d2o-w31-protect50-floor90": f"d2o[{W31},merge_protect=0.5,merge_floor=0.9]",
    "d2o-w31-protect50-uniform": f"d2o[{W31},merge_protect=0.5,allocation=uniform]",
    "d2o-w31-score": f"d2o[{W31},merge_weighting=score]",
    "d2o-w31-score-protect50": f"d2o[{W31},merge_weighting=score,merge_protect=0.5]",
    "d2o-nomerge": "d2o[merge=false]",
    "d2o-score": "d2o[merge_weighting=score]",
    "d2o-protect50": "d2o[merge_protect=0.5]",
    # ablation-only (D2OAblation above; no decode-time compression within the 12 answer tokens)
    "abl-interval16": f"d2o_ablation[{W31},interval=16]",
    "abl-keys-only": f"d2o_ablation[{W31},interval=16,merge_kv=keys]",
    "abl-values-only": f"d2o_ablation[{W31},interval=16,merge_kv=values]",
    "abl-norecent": f"d2o_ablation[{W31},interval=16,recent_absorbs=false]",
    "abl-norecent-protect50": f"d2o_ablation[{W31},interval=16,recent_absorbs=false,merge_protect=0.5]",
    "ems": "ems",
    "ems-window": "ems[scores=window]",                                      # (e) EMS
    "ems-window-k31": "ems[scores=window,pool_kernel=31]",
}


def is_number(case) -> bool:
    return case.answers[0].isdigit()


def probe_cases(tokenizer, lengths: list[int], numbers: int, words: int) -> list:
    """The first ``numbers`` number-format and ``words`` word-format single-needle seeds per length."""
    out = []
    for length in lengths:
        got = {True: [], False: []}
        seed = 0
        while len(got[True]) < numbers or len(got[False]) < words:
            case = single_needle.generate(tokenizer, length, seed)
            want = numbers if is_number(case) else words
            if len(got[is_number(case)]) < want:
                got[is_number(case)].append(case)
            seed += 1
        out += got[True] + got[False]
    return out


def summarise(records: list[dict], labels: dict[str, str], budgets: list[float]) -> list[dict]:
    rows = []
    for label, spec in labels.items():
        for budget in ([None] if spec == "full" else budgets):
            mine = sorted((r for r in records if r["policy"] == spec and r["budget"] == budget),
                          key=lambda r: (r["length"], r["seed"]))
            if not mine:
                continue
            num = [r for r in mine if r["answers"][0].isdigit()]
            word = [r for r in mine if not r["answers"][0].isdigit()]
            rows.append({
                "variant": label, "spec": spec, "budget": budget, "cases": len(mine),
                "correct": sum(r["correct"] for r in mine), "accuracy": round(sum(r["correct"] for r in mine) / len(mine), 4),
                "numbers": [sum(r["correct"] for r in num), len(num)],
                "words": [sum(r["correct"] for r in word), len(word)],
                "outputs": [{"length": r["length"], "seed": r["seed"], "answer": r["answers"][0], "output": r["output"],
                             "correct": r["correct"]} for r in mine],
            })
    return rows


def count_merges(loaded, items: list, specs: list[str], budgets: list[float], batch: int) -> list[dict]:
    """Per (D2O spec, budget): evicted and merged (KV head, token) pairs, counted by wrapping D2O's
    ``threshold_and_merge`` (the reference's and the plain-torch step's) on a fresh run of that spec alone (a
    throwaway store, so every case runs). That counts the prefill compression and the decode steps of the
    plain-torch step (on the CPU every step; on CUDA the options the Triton ops lack)."""
    import tempfile

    count = [0, 0]

    def counting(heads, u, valid, tau, tau_set, opts):
        merged, w_e = threshold_and_merge(heads, u, valid, tau, tau_set, opts)
        count[0] += int(valid.sum())
        count[1] += int(merged.sum())
        return merged, w_e

    from kvpass.policies import policy_from_spec

    d2o_specs = [s for s in specs if isinstance(policy_from_spec(s), D2O)]
    rows = []
    d2o_reference.threshold_and_merge = d2o_in_place.threshold_and_merge = counting
    try:
        for budget in budgets:
            for spec in d2o_specs:
                count[:] = [0, 0]
                with tempfile.TemporaryDirectory() as tmp:
                    suite.run(loaded, items, suite.cells([spec], [budget], ["query_aware"], reference=False),
                              Store(Path(tmp) / "counts.json"), batch=batch, desc=f"merge counts {spec} @{budget}")
                evicted, merged = count
                rows.append({"spec": spec, "budget": budget, "evicted": evicted, "merged": merged,
                             "merged_fraction": round(merged / max(evicted, 1), 4)})
    finally:
        d2o_reference.threshold_and_merge = d2o_in_place.threshold_and_merge = threshold_and_merge
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024])
    p.add_argument("--numbers", type=int, default=16, help="number-format cases per length")
    p.add_argument("--words", type=int, default=8, help="word-format cases per length")
    p.add_argument("--budgets", type=float, nargs="+", default=[0.2])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), help=f"labels of {list(VARIANTS)}")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--store", required=True, help="the resumable per-case JSON (kvpass.eval.store)")
    p.add_argument("--json", help="the summary JSON")
    p.add_argument("--report-only", action="store_true", help="run nothing: summarise what the store holds")
    p.add_argument("--count-merges", action="store_true",
                   help="also run the D2O variants once more on the first --count-cases number cases of the first "
                        "length, counting evicted and merged (KV head, token) pairs per layer, prefill and decode")
    p.add_argument("--count-cases", type=int, default=4)
    args = p.parse_args()
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    set_threads(1)
    loaded = load(args.model, args.device)
    items = probe_cases(loaded.tokenizer, args.lengths, args.numbers, args.words)
    specs = [VARIANTS[v] for v in args.variants]
    store = Store(args.store)
    t0 = time.monotonic()
    if not args.report_only:
        suite.run(loaded, items, suite.cells(specs, args.budgets, ["query_aware"], reference=False), store,
                  batch=args.batch, desc="merge-ablation")
    seconds = time.monotonic() - t0
    idents = {c.ident for c in items}
    records = [r for r in store.cases.values() if r.get("kind") == suite.KIND and r["mode"] == "query_aware"
               and (r["family"], r["length"], r["seed"]) in idents]
    rows = summarise(records, {v: VARIANTS[v] for v in args.variants}, args.budgets)
    for r in rows:
        print(f"{r['variant']:24s} {str(r['budget']):5s} {r['correct']:3d}/{r['cases']:<3d} "
              f"numbers {r['numbers'][0]}/{r['numbers'][1]}  words {r['words'][0]}/{r['words'][1]}")
    counted = [c for c in items if c.length == args.lengths[0] and is_number(c)][:args.count_cases]
    merges = count_merges(loaded, counted, specs, args.budgets, args.batch) if args.count_merges else []
    for m in merges:
        print(f"{m['spec']} @{m['budget']}: merged {m['merged']} of {m['evicted']} evicted ({m['merged_fraction']:.1%})")
    if args.json:
        flags = [f"--{k.replace('_', '-')}" + ("" if v is True else f" {' '.join(map(str, v)) if isinstance(v, list) else v}")
                 for k, v in vars(args).items() if k not in ("json", "store", "report_only") and v is not False]
        out = {"command": "python benchmarks/merge_ablation.py " + " ".join(flags),
               "model": args.model, "device": args.device, "host": platform.machine(), "torch": torch.__version__,
               "date": time.strftime("%Y-%m-%d"), "mode": "query_aware", "family": "single_needle",
               "seeds": {str(n): sorted(c.seed for c in items if c.length == n) for n in args.lengths},
               "run_seconds": round(seconds, 1), "results": rows,
               "merge_counts": {"seeds": [c.seed for c in counted] if merges else [], "rows": merges}}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1), encoding="utf-8")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
