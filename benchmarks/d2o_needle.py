"""Needle accuracy of a few policies on SmolLM2-135M (CPU), one model load, for the D2O investigation.

    .venv/bin/python benchmarks/d2o_needle.py --tokens 2000 --depths 0.1 0.3 0.5 0.7 0.9 \
        --policies full d2o h2o snapkv streamingllm --budget 0.2

Prints one line per (policy, depth) and a summary table (Markdown)."""

from __future__ import annotations

import argparse
import json
import time

import torch

import kvpass
from kvpass.models import load_model
from kvpass.prompts import chat_ids, needle_prompt


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=2000)
    p.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7, 0.9])
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--policies", nargs="+", default=["full", "d2o", "h2o", "snapkv", "streamingllm"])
    p.add_argument("--budget", type=float, default=0.2)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--set", action="append", default=[], metavar="POLICY:NAME=VALUE")
    p.add_argument("--json")
    args = p.parse_args()
    torch.set_num_threads(2)
    model, tok = load_model("smollm2")
    extra: dict[str, dict] = {}
    for s in args.set:
        pol, kv = s.split(":", 1)
        name, value = kv.split("=", 1)
        extra.setdefault(pol, {})[name] = json.loads(value)
    cases = [(d, s) for s in args.seeds for d in args.depths]
    prompts = {}
    for d, s in cases:
        np_ = needle_prompt(tok, args.tokens, d, seed=s)
        prompts[(d, s)] = (np_, torch.tensor([chat_ids(tok, np_.messages())]))
    rows = []
    for pol in args.policies:
        name = pol.split("@")[0]
        km = kvpass.apply(model, name, budget=args.budget, **extra.get(pol, {}))
        for d, s in cases:
            np_, ids = prompts[(d, s)]
            t0 = time.time()
            out = km.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
            text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
            ok = np_.answer in text
            rows.append(dict(policy=pol, depth=d, seed=s, n=ids.shape[1], ok=ok, answer=np_.answer,
                             text=text.strip().replace("\n", " ")[:80]))
            print(f"{pol:14s} depth={d:.1f} seed={s} n={ids.shape[1]} ok={int(ok)} ({time.time() - t0:.0f}s) "
                  f"{np_.answer} -> {text.strip()[:70]!r}", flush=True)
    print()
    print("| policy | " + " | ".join(f"{d:.1f}/s{s}" for d, s in cases) + " | acc |")
    print("|---|" + "---|" * (len(cases) + 1))
    for pol in args.policies:
        r = [x for x in rows if x["policy"] == pol]
        print(f"| {pol} | " + " | ".join("✓" if x["ok"] else "✗" for x in r) + f" | {sum(x['ok'] for x in r)}/{len(r)} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
