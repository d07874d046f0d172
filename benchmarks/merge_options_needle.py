"""Needle accuracy of D2O's options (and EMS's window scores) beside H2O and SnapKV, SmolLM2-135M-Instruct
on the CPU: a short passphrase stated once as a plain sentence in an essay haystack, the question in the
same user message (query-aware), greedy decoding. One prefill per prompt serves every policy of a stats
group (``kvpass.eval.shared.stat_groups``), so each extra policy costs only its compression and decode.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/merge_options_needle.py --prompts 10 --tokens 2000 --budgets 0.2 \
        --json benchmarks/results/merge-options-needle-cpu.json

Policies (``--policies`` picks a subset by label): see VARIANTS. A case is correct when the output holds
the passphrase (case-insensitive). The JSON has one record per (policy label, budget, prompt) and a summary.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

import kvpass
from kvpass.eval.shared import stat_groups
from kvpass.models import load_model
from kvpass.policies import get_policy
from kvpass.prompts import chat_ids, haystack
from kvpass.rewrites import capture_model, compile_model

QUESTION = "What is the passphrase? Answer briefly."
WORDS = ("amber", "cobalt", "falcon", "granite", "harbor", "indigo", "juniper", "kestrel", "lantern", "meadow",
         "orchid", "quartz", "raven", "saffron", "thistle", "velvet", "willow", "zephyr")

# label -> (policy name, keyword arguments)
VARIANTS: dict[str, tuple[str, dict]] = {
    "full": ("full", {}),
    "d2o": ("d2o", {}),
    "d2o-window": ("d2o", dict(scores="window")),
    "d2o-nomerge": ("d2o", dict(merge=False)),
    "d2o-guard": ("d2o", dict(merge_floor=0.5, merge_into_sinks=False)),
    "d2o-bias": ("d2o", dict(merge_bias=True)),
    "d2o-first-decode": ("d2o", dict(first_compression="decode")),
    "d2o-skip-extra": ("d2o", dict(skip_layers=(0, 1, -1), skip_memory="extra")),
    "d2o-code": ("d2o", dict(d2o_variant="code")),
    "d2o-window-guard-bias": ("d2o", dict(scores="window", merge_floor=0.5, merge_into_sinks=False, merge_bias=True)),
    "h2o": ("h2o", {}),
    "snapkv": ("snapkv", {}),
    "ems": ("ems", {}),
    "ems-window": ("ems", dict(scores="window")),
}


def needle_depth(index: int, count: int | None) -> float:
    """(index + 0.5) / count, or with no count (screened candidates) the golden-ratio sequence."""
    return (index + 0.5) / count if count else (0.5 + index * 0.6180339887) % 1.0


def needle_case(tok, tokens: int, index: int, count: int | None) -> tuple[list[int], str]:
    """(token ids of the chat, passphrase): the sentence at ``needle_depth`` of the haystack."""
    rng = random.Random(index)
    phrase = "-".join(rng.sample(WORDS, 2))
    text = haystack(tok, tokens)
    at = text.rfind(". ", 0, int(needle_depth(index, count) * len(text)))
    at = 0 if at < 0 else at + 1
    text = f"{text[:at]} The passphrase is {phrase}.{text[at:]}"
    return chat_ids(tok, [{"role": "user", "content": f"{text}\n\n{QUESTION}"}]), phrase


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--prompts", type=int, default=10)
    p.add_argument("--tokens", type=int, default=2000)
    p.add_argument("--budgets", type=float, nargs="+", default=[0.2])
    p.add_argument("--policies", nargs="+", default=list(VARIANTS))
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--answerable", action="store_true",
                   help="screen candidates with the full cache first (needs 'full' first in --policies) and keep "
                        "the first --prompts it answers; the others are recorded for full only")
    p.add_argument("--max-candidates", type=int, default=40)
    p.add_argument("--json")
    args = p.parse_args()
    if args.answerable and args.policies[0] != "full":
        p.error("--answerable needs 'full' as the first of --policies")
    model, tok = load_model("smollm2")
    captured = capture_model(model)
    policies = {label: get_policy(VARIANTS[label][0], **VARIANTS[label][1]) for label in args.policies}
    models = {(label, b): kvpass.apply(model, pol, b, captured=captured)
              for label, pol in policies.items() for b in args.budgets}
    groups = []
    for union, members in stat_groups(list(policies.values())):
        labels = [lab for lab, pol in policies.items() if any(pol is m for m in members)]
        groups.append((compile_model(captured, union, prefill_only=True), labels))
    eos = tok.eos_token_id
    eos_ids = torch.tensor([eos] if isinstance(eos, int) else list(eos or []))
    rows = []
    kept = 0
    for i in range(args.max_candidates if args.answerable else args.prompts):
        if kept == args.prompts:
            break
        count = None if args.answerable else args.prompts
        ids, phrase = needle_case(tok, args.tokens, i, count)
        input_ids = torch.tensor([ids])
        answered = True
        for prefill_graphs, labels in groups:
            if not answered:
                break
            t0 = time.time()
            any_model = models[(labels[0], args.budgets[0])]
            pre = any_model.prefill(input_ids, None, args.max_new_tokens, graphs=prefill_graphs)
            shared_s = time.time() - t0
            for label in labels:
                for b in args.budgets:
                    t1 = time.time()
                    session = models[(label, b)].start_from(pre)
                    new, _ = session.sample(args.max_new_tokens, eos_ids, eos if isinstance(eos, int) else 0,
                                            do_sample=False, temperature=1.0, top_k=None, top_p=None, generator=None)
                    text = tok.decode(new[0], skip_special_tokens=True).strip()
                    ok = phrase.lower() in text.lower()
                    rows.append(dict(policy=label, kwargs=VARIANTS[label][1], budget=b, prompt=i, n=len(ids),
                                     depth=round(needle_depth(i, count), 3),
                                     answer=phrase, output=text, correct=ok, seconds=round(time.time() - t1, 2),
                                     prefill_seconds=round(shared_s, 2)))
                    print(f"prompt {i} n={len(ids)} {label:22s} b={b} ok={int(ok)} {phrase} -> {text[:50]!r} "
                          f"({time.time() - t1:.1f}s)", flush=True)
                    if args.answerable and label == "full" and not ok:
                        answered = False
                        break
                if not answered:
                    break
        kept += answered
    summary = {}
    scored = {r["prompt"] for r in rows if r["policy"] != "full"} if args.answerable else {r["prompt"] for r in rows}
    for label in args.policies:
        for b in args.budgets:
            got = [r["correct"] for r in rows if r["policy"] == label and r["budget"] == b and r["prompt"] in scored]
            summary[f"{label}@{b}"] = f"{sum(got)}/{len(got)}"
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(model="smollm2", tokens=args.tokens, answerable=args.answerable, question=QUESTION, max_new_tokens=args.max_new_tokens,
                           mode="query_aware", device="cpu", torch_threads=torch.get_num_threads(),
                           variants={k: VARIANTS[k] for k in args.policies}, summary=summary, cases=rows), f, indent=1)


if __name__ == "__main__":
    main()
