"""Needle cases in the task-suite JSONL format (HELPERS.md), for checking the peers runner before
``kvpass eval suite export`` exists; optionally the plain-transformers answers of kvpass's venv.

Run in kvpass's venv (it needs kvpass's tokenizer loading and prompts):

    /work/main/.venv/bin/python benchmarks/peers/make_needle_cases.py out/peers/needle.jsonl \\
        --model smollm2 --length 2048 --depths 0.1 0.5 0.9 [--reference out/peers/reference.json]

Every case of one length has the same context and question token counts (the haystack is cut to
the first case's count, the question is the same), so the runners batch them without padding.
``--reference STORE`` also stores plain ``model.generate`` greedy answers of this venv
(transformers 5.x of kvpass) as policy "transformers", mode "reference", for the agreement check
with the peers venv's ``transformers-peer-env`` and ``kvpress:none``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def make_cases(tokenizer, model: str, lengths: list[int], depths: list[float], seeds: list[int],
               max_new_tokens: int) -> list[dict]:
    """One case per (length, depth, seed), context ids of one length cut to a common count."""
    from kvpass.eval.common import split_chat
    from kvpass.prompts import needle_prompt

    out = []
    for length in lengths:
        built = []
        for seed in seeds:
            for j, depth in enumerate(depths):
                prompt = needle_prompt(tokenizer, length, depth, seed=seed * 1000 + length + j)
                ctx, q = split_chat(tokenizer, prompt.context, prompt.question)
                built.append((seed, depth, prompt, ctx, q))
        common = min(len(b[3]) for b in built)
        for seed, depth, prompt, ctx, q in built:
            ids = ctx[:common]           # drops a few tokens of the haystack's end (the chat prefix stays)
            if prompt.answer not in tokenizer.decode(ids):
                continue                 # the needle sat in the dropped tail
            out.append({"key": f"needle|model={model}|length={length}|depth={depth}|seed={seed}", "model": model,
                        "family": "needle", "length": length, "seed": seed, "depth": depth,
                        "context_ids": ids, "question_ids": q, "answers": [prompt.answer], "scoring": "all",
                        "max_new_tokens": max_new_tokens})
    return out


def reference(model_name: str, cases: list[dict], path: str, batch: int) -> None:
    """Plain transformers greedy answers in this venv, stored as policy 'transformers'."""
    import time

    import cases as C
    import torch
    import transformers

    from kvpass.eval.common import eos_pad, load

    loaded = load(model_name)
    eos_ids, pad = eos_pad(loaded.model)
    eos = eos_ids.tolist()
    store = C.store_module().Store(path, meta={"transformers": transformers.__version__, "torch": torch.__version__})
    for group in C.batches(cases, batch):
        rows = [c for c in group if C.record_key(c, "transformers", None, C.REFERENCE) not in store]
        if not rows:
            continue
        ids = torch.tensor([c["context_ids"] + c["question_ids"] for c in rows])
        start = time.perf_counter()
        with torch.no_grad():
            out = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=pad,
                                        max_new_tokens=rows[0]["max_new_tokens"])
        seconds = (time.perf_counter() - start) / len(rows)
        records = []
        for case, row in zip(rows, out, strict=True):
            tokens = row[ids.shape[1]:].tolist()
            tokens = next((tokens[:i] for i, t in enumerate(tokens) if t in eos), tokens)
            records.append(C.make_record(case, policy="transformers", budget=None, mode=C.REFERENCE,
                                         output=loaded.tokenizer.decode(tokens, skip_special_tokens=True).strip(),
                                         output_ids=tokens, seconds=seconds, device="cpu"))
        store.add_many(records)
        print(f"reference: {len(rows)} cases of {ids.shape[1]} tokens, {seconds:.1f} s/case", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="cases JSONL to write")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--lengths", nargs="+", type=int, default=[2048])
    p.add_argument("--depths", nargs="+", type=float, default=[0.1, 0.5, 0.9])
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--reference", help="also store plain transformers answers of this venv in this Store JSON")
    p.add_argument("--batch", type=int, default=8)
    args = p.parse_args(argv)

    from kvpass.eval.common import load

    tokenizer = load(args.model).tokenizer
    cases = make_cases(tokenizer, args.model, args.lengths, args.depths, args.seeds, args.max_new_tokens)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        for case in cases:
            f.write(json.dumps(case) + "\n")
    shapes = sorted({(len(c["context_ids"]), len(c["question_ids"])) for c in cases})
    print(f"{len(cases)} cases -> {args.out}; (context, question) tokens: {shapes}", file=sys.stderr)
    if args.reference:
        reference(args.model, cases, args.reference, args.batch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
