"""Does any policy degenerate? Perplexity and free-generation repetition at budgets in (0.05, 1] (issue 26).

For every compressing policy configuration (``configs()``: each registered policy that uses a budget, with
its defaults, plus the documented option configurations: the default ``snapkv[kernel=31]``, D2O and EMS
with window scores, KVMerger without value scaling and with the old ``overflow=slot_order``, Knorm with a recent window) at each budget, on ``--prompts`` segments of real essay
text (the Paul Graham essays of ``kvpass.prompts.essays``, cut as ``kvpass eval ppl`` cuts them:
``kvpass.eval.lm.Segment`` / ``segment_ids``; segment i starts at essay token i * (prefix + steps)):

(a) **Perplexity of a held-out continuation.** The segment's first ``--prefix`` tokens are prefilled and
    compressed (to the budget of prefix + steps), then its next ``--steps`` tokens are teacher-forced
    through kvpass decode steps, so decode-time compressions happen. This is ``kvpass.eval.lm.kvpass_pass``'s
    NLL, batched over the prompts (``teacher_forced_nll``; ``tests/test_degeneration_check.py`` checks that
    both give the same numbers). ``ppl_ratio`` = exp(mean NLL) of the policy over that of ``full`` on the same
    tokens (all prompts pooled).
(b) **Free greedy generation.** From the same compressed prefix (the same shared prefill), ``--gen-tokens``
    greedy tokens, stopped at the end-of-text token. On each output (token ids): ``repetition_metrics``.

**Degenerate** (``degenerate_generation`` / ``degenerate_cell``, thresholds in ``THRESHOLDS``):

* a generation is degenerate when it *loops*: ``rep4`` (the fraction of its token 4-grams that already
  occurred earlier in it) >= 0.5 **and** >= full's rep4 on the same prompt + 0.25; or it *stutters*: its
  longest run of one repeated token or word (``max_run``) >= 8 **and** >= 2 x full's on the same prompt.
  Why: a loop of period p that starts at token s of an n-token output repeats about (n - s - p) / n of its
  4-grams, so rep4 >= 0.5 means at least half the output is a loop; ordinary prose (and full's outputs on
  these prompts) stays well below. "Beyond full" (+0.25, 2x) keeps a greedy small model's own loops (which
  full has too) from being blamed on the compression. 8 repeats of one token/word ('TheTheThe...',
  '1111111111', 'the the the ...') do not occur in ordinary text.
* a (policy, budget) cell is degenerate when its ``ppl_ratio`` >= 10 (the issue's "perplexity x10") or at
  least half of its prompts' generations are degenerate. A cell with some but fewer degenerate generations
  is reported (``degenerate_generations``) but not flagged.

Run (CPU, ~30 min on one core for the default grid; JSON + a Markdown table next to it):

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/degeneration_check.py \\
        --json benchmarks/results/degeneration-smollm2-cpu.json
    # GPU (the lead): more prompts, one batch
    PYTHONPATH=. python benchmarks/degeneration_check.py --device cuda --prompts 16 --prefix 2048 --steps 128 \\
        --gen-tokens 128 --json benchmarks/results/degeneration-smollm2-cuda.json

Results are resumable: cells already in ``--json`` (same model, prompts, prefix, steps, gen tokens) are kept.
A configuration that refuses a budget (its minimum budget: sinks + windows) is recorded as ``refused``.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import re
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):                      # run as a script from a plain checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

BUDGETS = (0.06, 0.1, 0.2, 0.5, 1.0)
# option configurations documented in docs/quality.md and docs/d2o.md
OPTION_CONFIGS = (
    "d2o[scores=window,window_kernel=31]",
    "d2o[scores=window,window_kernel=31,merge_protect=0.5]",
    "d2o[scores=window,window_kernel=31,merge_weighting=score]",
    "d2o[scores=window,window_kernel=31,merge=false]",
    "ems[scores=window,pool_kernel=31]",
    "kvmerger[value_scale=none]",                   # overflow="tiered", the default since 2026-11-25
    "kvmerger[overflow=slot_order]",                # the old default: docs/quality.md, "Degeneration at small budgets"
    "knorm[recent=0]",                              # kvpress's rule (knorm's default keeps 32 recent since 2026-11-25)
)
THRESHOLDS = {
    "ppl_ratio": 10.0,          # cell: ppl / full's ppl at or above this
    "rep4": 0.5,                # generation: fraction of repeated token 4-grams at or above this ...
    "rep4_over_full": 0.25,     # ... and at least this much above full's on the same prompt
    "max_run": 8,               # generation: a token or word repeated this many times in a row ...
    "max_run_over_full": 2.0,   # ... and at least this many times full's longest run on the same prompt
    "prompt_share": 0.5,        # cell: at least this share of its prompts' generations degenerate
}
_WORD = re.compile(r"\w+")


# ---------------------------------------------------------------- the metric (pure Python, no torch needed)

def repeated_ngram_fraction(ids: Sequence, n: int = 4) -> float:
    """The share of the n-grams of ``ids`` that already occurred earlier in ``ids`` (0 when there are none)."""
    grams = [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]
    if not grams:
        return 0.0
    seen: set[tuple] = set()
    repeats = 0
    for g in grams:
        repeats += g in seen
        seen.add(g)
    return repeats / len(grams)


def longest_run(items: Sequence) -> int:
    """The longest run of one item repeated back to back (0 for an empty sequence)."""
    best = run = 0
    prev = object()
    for x in items:
        run = run + 1 if x == prev else 1
        prev = x
        best = max(best, run)
    return best


def distinct_n(ids: Sequence, n: int = 2) -> float:
    """Distinct n-grams over n-grams (1 = no n-gram repeats; 1.0 when there are none)."""
    grams = [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


def repetition_metrics(ids: Sequence[int], text: str | None = None) -> dict[str, float | int]:
    """ids: the generated token ids; text: their decoded text (for the word run). ->
    rep4, distinct2, token_run, word_run, max_run (the larger run), tokens."""
    words = [w.lower() for w in _WORD.findall(text)] if text is not None else []
    token_run, word_run = longest_run(list(ids)), longest_run(words)
    return {"tokens": len(ids), "rep4": round(repeated_ngram_fraction(list(ids), 4), 4),
            "distinct2": round(distinct_n(list(ids), 2), 4), "token_run": token_run, "word_run": word_run,
            "max_run": max(token_run, word_run)}


def degenerate_generation(m: dict, full: dict, t: dict = THRESHOLDS) -> str | None:
    """Why the generation with metrics ``m`` is degenerate against full's ``full`` on the same prompt
    ('loop ...' or 'stutter ...'), or None when it is not."""
    if m["rep4"] >= t["rep4"] and m["rep4"] >= full["rep4"] + t["rep4_over_full"]:
        return f"loop: rep4 {m['rep4']:.2f} (full {full['rep4']:.2f})"
    if m["max_run"] >= t["max_run"] and m["max_run"] >= t["max_run_over_full"] * full["max_run"]:
        return f"stutter: run of {m['max_run']} (full {full['max_run']})"
    return None


def degenerate_cell(ppl_ratio: float | None, reasons: Sequence[str | None], t: dict = THRESHOLDS) -> bool:
    """A cell: its ppl ratio to full and the degeneracy reason (or None) of each prompt's generation."""
    if ppl_ratio is not None and (math.isnan(ppl_ratio) or ppl_ratio >= t["ppl_ratio"]):
        return True
    return bool(reasons) and sum(r is not None for r in reasons) >= t["prompt_share"] * len(reasons)


# ---------------------------------------------------------------- the runs

def configs() -> list[str]:
    """Every registered policy that uses a budget (defaults), then the option configurations."""
    from kvpass.eval.common import uses_budget
    from kvpass.policies import DEFAULT_POLICY, POLICIES

    names = [n for n in sorted(POLICIES) if n != "full" and uses_budget(n)]
    return list(dict.fromkeys([*names, DEFAULT_POLICY, *OPTION_CONFIGS]))


@torch.no_grad()
def teacher_forced_nll(session, ids: torch.Tensor, prefix: int) -> torch.Tensor:
    """session: started on ids[:, :prefix]; ids: [B, prefix + steps]. -> NLL [B, steps] of each continuation
    token, every token fed through a decode step (the loop of ``kvpass.eval.lm.kvpass_pass``, batched)."""
    steps = ids.shape[1] - prefix
    out = []
    for i in range(steps):
        p = prefix + i
        out.append(F.cross_entropy(session.logits.float(), ids[:, p], reduction="none"))
        if i < steps - 1:
            session.step(ids[:, p])
    return torch.stack(out, dim=1)


@torch.no_grad()
def greedy(session, new_tokens: int, eos_ids: torch.Tensor) -> list[list[int]]:
    """Greedy tokens per row, each cut after its first end-of-text token (kept out)."""
    tokens, _ = session.sample(new_tokens, eos_ids.to(session.logits.device), 0, do_sample=False)
    eos, rows = set(eos_ids.tolist()), []
    for row in tokens.tolist():
        cut = next((i for i, t in enumerate(row) if t in eos), len(row))
        rows.append(row[:cut])
    return rows


def run_cells(model, ids: torch.Tensor, prefix: int, cells: Sequence[tuple[str, float]], gen_tokens: int,
              eos_ids: torch.Tensor, log=print, decode=None, saved=None, kv_dtype: str | None = None) -> list[dict]:
    """ids: [B, prefix + steps] on the model's device. For every (spec, budget) of ``cells`` (``full`` first,
    budget-less): NLL [B, steps] and greedy outputs. One prefill per group of policies whose statistics
    agree (``kvpass.eval.shared``; every budget of a group shares it), shared by (a) and (b). ``saved``:
    called with the records so far after each cell; ``kv_dtype``: every cell's cache entries (``kvpass.apply``'s,
    ``full``'s too: its ratios are then to the quantized full cache). -> raw records (no ratios yet)."""
    from kvpass.errors import KVPassError
    from kvpass.eval.shared import Models, stat_groups

    steps = ids.shape[1] - prefix
    models = Models(model, kv_dtype=kv_dtype)
    built: dict[tuple[str, float | None], object] = {}
    records = []
    for spec, budget in cells:
        try:
            built[(spec, budget)] = models.get(spec, budget)
        except KVPassError as err:
            records.append({"policy": spec, "budget": budget, "refused": str(err).splitlines()[0]})
    chosen = {c: kv.policy for c, kv in built.items()}
    for union, members in stat_groups(list(dict.fromkeys(chosen.values()))):
        here = [c for c in built if chosen[c] in members]
        start = time.perf_counter()
        # every cell's budget is its fraction of prefix + max(steps, gen_tokens): (a) and (b) share it
        shared = models.shared_prefill(union, ids[:, :prefix], max_new_tokens=max(steps, gen_tokens))
        share = (time.perf_counter() - start) / len(here)
        for spec, budget in here:
            kv = built[(spec, budget)]
            t0 = time.perf_counter()
            try:
                nll = teacher_forced_nll(kv.start_from(shared), ids, prefix)
                session = kv.start_from(shared)
                outputs = greedy(session, gen_tokens, eos_ids)
                report = session.report()
            except KVPassError as err:
                records.append({"policy": spec, "budget": budget, "refused": str(err).splitlines()[0]})
                log(f"{spec}@{budget}: refused: {str(err).splitlines()[0]}")
                continue
            except Exception as err:          # a crash is a finding: record it, go on with the others
                records.append({"policy": spec, "budget": budget, "error": f"{type(err).__name__}: {err}",
                                "traceback": traceback.format_exc()[-2000:]})
                log(f"{spec}@{budget}: ERROR {type(err).__name__}: {err}")
                continue
            seconds = time.perf_counter() - t0 + share
            texts = [decode(o) if decode else None for o in outputs]
            records.append({"policy": spec, "budget": budget, "nll": [[round(x, 5) for x in row] for row in nll.tolist()],
                            "outputs": outputs,
                            "texts": texts, "cache_bytes": report.cache_bytes,
                            "full_cache_bytes": report.full_cache_bytes, "seconds": round(seconds, 2)})
            log(f"{spec}@{budget}: ppl {math.exp(float(nll.mean())):.2f} ({seconds:.1f} s)")
            if saved is not None:
                saved(records)
        del shared
    return records


def summarize(records: Sequence[dict]) -> list[dict]:
    """Raw records -> one row per cell: ppl, ppl_ratio to full, per-prompt repetition metrics against
    full's, the degenerate generations and the verdict."""
    full = next(r for r in records if r["policy"] == "full" and "nll" in r)
    full_nll = torch.tensor(full["nll"], dtype=torch.float64)
    full_ppl = math.exp(float(full_nll.mean()))
    full_m = [repetition_metrics(o, t) for o, t in zip(full["outputs"], full["texts"], strict=True)]
    rows = []
    for r in records:
        row = {k: r[k] for k in ("policy", "budget") if k in r}
        if "nll" not in r:
            row.update({k: r[k] for k in ("refused", "error") if k in r})
            row["degenerate"] = None
            rows.append(row)
            continue
        nll = torch.tensor(r["nll"], dtype=torch.float64)
        value = math.exp(float(nll.mean())) if torch.isfinite(nll).all() else float("inf")
        ratio = value / full_ppl
        per_prompt_ratio = (nll.mean(1).exp() / full_nll.mean(1).exp()).tolist()
        mets = [repetition_metrics(o, t) for o, t in zip(r["outputs"], r["texts"], strict=True)]
        reasons = [degenerate_generation(m, f) for m, f in zip(mets, full_m, strict=True)]
        row.update({
            "ppl": round(value, 3), "full_ppl": round(full_ppl, 3), "ppl_ratio": round(ratio, 3),
            "ppl_ratio_per_prompt": [round(x, 3) for x in per_prompt_ratio],
            "rep4": [m["rep4"] for m in mets], "full_rep4": [m["rep4"] for m in full_m],
            "max_run": [m["max_run"] for m in mets], "full_max_run": [m["max_run"] for m in full_m],
            "distinct2": [m["distinct2"] for m in mets], "full_distinct2": [m["distinct2"] for m in full_m],
            "gen_tokens": [m["tokens"] for m in mets],
            "degenerate_generations": [x for x in reasons],
            "degenerate": degenerate_cell(ratio, reasons),
            "cache_bytes": r["cache_bytes"], "full_cache_bytes": r["full_cache_bytes"], "seconds": r["seconds"],
            "texts": r["texts"],
        })
        rows.append(row)
    return rows


def markdown(result: dict) -> str:
    """The table: policy x budget -> ppl ratio, mean rep4 (full's), longest run (full's), degenerate."""
    rows = result["rows"]
    m = result["meta"]
    full = next(r for r in rows if r["policy"] == "full")
    head = (f"# Degeneration check: {m['model']} on {m['device']}\n\n"
            f"{m['prompts']} essay segments: {m['prefix']} prompt tokens, ppl over the next {m['steps']} "
            f"(teacher-forced through decode steps), then {m['gen_tokens']} greedy tokens from the same prompt. "
            f"full: ppl {full.get('ppl')}, rep4 {_mean(full.get('rep4'))}, longest run "
            f"{max(full.get('max_run') or [0])}.\n"
            f"Degenerate: ppl ratio >= {THRESHOLDS['ppl_ratio']:g}, or on >= half the prompts a loop "
            f"(rep4 >= {THRESHOLDS['rep4']} and >= full's + {THRESHOLDS['rep4_over_full']}) or a stutter "
            f"(a run >= {THRESHOLDS['max_run']} and >= {THRESHOLDS['max_run_over_full']:g}x full's). "
            "Cells: ppl ratio / mean rep4 / longest run / degenerate generations of prompts "
            "(**bold**: degenerate).\n\n"
            f"Command: `{m['command']}`\n\n")
    budgets = sorted({r["budget"] for r in rows if r["budget"] is not None})
    policies = list(dict.fromkeys(r["policy"] for r in rows if r["policy"] != "full"))
    lines = ["| policy | " + " | ".join(f"{b:g}" for b in budgets) + " | degenerate at |",
             "|---|" + "---|" * (len(budgets) + 1)]
    by = {(r["policy"], r["budget"]): r for r in rows}
    for p in policies:
        cells, bad = [], []
        for b in budgets:
            r = by.get((p, b))
            if r is None:
                cells.append("")
            elif "ppl_ratio" not in r:
                cells.append("refused" if "refused" in r else "error")
            else:
                n_bad = sum(x is not None for x in r["degenerate_generations"])
                text = f"{r['ppl_ratio']:.2f} / {_mean(r['rep4'])} / {max(r['max_run'])} / {n_bad}of{len(r['rep4'])}"
                cells.append(f"**{text}**" if r["degenerate"] else text)
                if r["degenerate"]:
                    bad.append(f"{b:g}")
        lines.append(f"| {p} | " + " | ".join(cells) + f" | {', '.join(bad) or 'none'} |")
    return head + "\n".join(lines) + "\n"


def _mean(xs) -> str:
    return f"{sum(xs) / len(xs):.2f}" if xs else "-"


def essay_prompts(tokenizer, prompts: int, prefix: int, steps: int) -> torch.Tensor:
    """[prompts, prefix + steps] essay tokens, segment i at essay offset i * (prefix + steps) (``eval ppl``'s)."""
    from kvpass.eval.lm import Segment, segment_ids

    return torch.tensor([segment_ids(tokenizer, Segment(i * (prefix + steps), prefix, steps)) for i in range(prompts)])


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--prompts", type=int, default=2, help="essay segments (one batch)")
    p.add_argument("--prefix", type=int, default=1536, help="prompt tokens per segment")
    p.add_argument("--steps", type=int, default=48, help="teacher-forced continuation tokens (the ppl)")
    p.add_argument("--gen-tokens", type=int, default=48, help="greedy tokens generated after the prompt")
    p.add_argument("--budgets", type=float, nargs="+", default=list(BUDGETS))
    p.add_argument("--policies", nargs="+", help="specs (default: configs())")
    p.add_argument("--json", default="benchmarks/results/degeneration-smollm2-cpu.json")
    p.add_argument("--kv-dtype", choices=["int8", "fp8_e4m3"], default=None,
                   help="every cell's cache entries, full's too (default: the model's dtype); use its own --json")
    p.add_argument("--markdown-only", action="store_true", help="rewrite the .md from the JSON, run nothing")
    args = p.parse_args(argv)
    out = Path(args.json)
    if args.markdown_only:
        out.with_suffix(".md").write_text(markdown(json.loads(out.read_text())))
        return 0
    for b in args.budgets:
        if not 0.05 < b <= 1.0:
            raise SystemExit(f"--budgets: {b} is outside (0.05, 1]")
    from kvpass.eval.common import eos_pad, load, set_threads

    set_threads(1)
    loaded = load(args.model, args.device)
    ids = essay_prompts(loaded.tokenizer, args.prompts, args.prefix, args.steps).to(loaded.device)
    meta = {"model": args.model, "device": (torch.cuda.get_device_name(loaded.device)
                                            if loaded.device.type == "cuda" else "cpu"),
            "prompts": args.prompts, "prefix": args.prefix, "steps": args.steps, "gen_tokens": args.gen_tokens,
            "kv_dtype": args.kv_dtype,
            "torch": torch.__version__, "python": platform.python_version(),
            "thresholds": THRESHOLDS, "command": "python benchmarks/degeneration_check.py " + " ".join(
                sys.argv[1:] if argv is None else argv)}
    old = json.loads(out.read_text()) if out.exists() else None
    same = old is not None and all(old["meta"].get(k) == meta[k] for k in ("model", "prompts", "prefix", "steps",
                                                                           "gen_tokens", "device", "kv_dtype"))
    raw = old["raw"] if same else []
    done = {(r["policy"], r["budget"]) for r in raw}
    specs = args.policies or configs()
    cells = [("full", None)] if ("full", None) not in done else []
    cells += [(s, b) for b in args.budgets for s in specs if (s, b) not in done]
    eos_ids, _ = eos_pad(loaded.model)
    started = time.perf_counter()
    print(f"{len(cells)} cells to run, {len(done)} kept from {out}", flush=True)
    # one prefill per group of configurations (every budget); the JSON is rewritten after each cell

    def save(new: list[dict]) -> None:
        meta["seconds"] = round(time.perf_counter() - started + (old["meta"].get("seconds", 0) if same else 0), 1)
        everything = raw + new
        result = {"meta": meta, "rows": summarize(everything) if any(r["policy"] == "full" for r in everything)
                  else [], "raw": everything}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
        if result["rows"]:
            out.with_suffix(".md").write_text(markdown(result))

    if cells:
        run_cells(loaded.model, ids, args.prefix, cells, args.gen_tokens, eos_ids,
                  log=lambda s: print(s, flush=True),
                  decode=lambda t: loaded.tokenizer.decode(t, skip_special_tokens=True), saved=save,
                  kv_dtype=args.kv_dtype)
    bad = [(r["policy"], r["budget"]) for r in json.loads(out.read_text())["rows"] if r.get("degenerate")]
    print("degenerate cells:", bad or "none", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
