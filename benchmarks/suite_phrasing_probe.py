"""Which phrasings give the quality suite a full-cache ceiling: plain transformers (greedy, fp32)
on candidate phrasings of each task family, per context length, on one GPU.

Each candidate is a generator like those of ``kvpass/eval/tasks`` (same haystack builder, same
chat template, same scoring) that differs in the needle's wording, the question, the answer prefix,
the value format or the needle's layout (``para``: the needle as a paragraph of its own, ``Insert.paragraph``).
The winners become the families' phrasings; this file keeps the evidence of what was tried.

    python benchmarks/suite_phrasing_probe.py --model smollm2 --device cuda --cases 40 \
        --lengths 1024 2048 4096 8000 --out probe.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvpass.eval.common import load, set_threads  # noqa: E402
from kvpass.eval.niah import answer_transformers  # noqa: E402
from kvpass.eval.scoring import score  # noqa: E402
from kvpass.eval.tasks import FAMILIES  # noqa: E402
from kvpass.eval.tasks import context as C  # noqa: E402
from kvpass.eval.tasks.case import SuiteCase  # noqa: E402


def needle_case(tok, length, seed, *, needle, question, prefix, value, para=False, new=12, preamble=""):
    rng = random.Random(f"probe/{seed}")
    noun, v = value(rng)
    depth = rng.random()
    text = needle.format(noun=noun, value=v)
    ctx = C.build(tok, length, question.format(noun=noun), [C.Insert(depth, text, paragraph=para)], rng,
                  answer_prefix=prefix.format(noun=noun), preamble=preamble)
    return SuiteCase("probe", length, seed, ctx.depth_of(0), ctx.context_ids, ctx.question_ids, (v,), "all", new, ctx.spans)


def multi_case(tok, length, seed, *, keys=4, para=False, word="passphrase", digits_n=6, values_per_key=1):
    rng = random.Random(f"probe-mk/{seed}")
    names = rng.sample(C.same_length(tok, C.NOUNS), keys)
    vals = [[C.digits(rng, digits_n) for _ in range(values_per_key)] for _ in names]
    inserts = []
    for k, vs in zip(names, vals, strict=True):
        for v in vs:
            t = (f"One of the special numbers for {k} is {v}." if values_per_key > 1 else f"The {word} for the {k} is {v}.")
            inserts.append(C.Insert(rng.random(), t, paragraph=para))
    asked = rng.randrange(keys)
    mine = [i for i in range(len(inserts)) if i // values_per_key == asked]
    order = mine + [i for i in range(len(inserts)) if i not in mine]
    if values_per_key > 1:
        q = f"What are the special numbers for {names[asked]} mentioned in the text above? List them briefly."
        pre = f"The special numbers for {names[asked]} are"
        new = 24
    else:
        q = f"What is the {word} for the {names[asked]}? Give a brief answer."
        pre = f"The {word} for the {names[asked]} is"
        new = 12
    ctx = C.build(tok, length, q, [inserts[i] for i in order], rng, answer_prefix=pre)
    return SuiteCase("probe", length, seed, ctx.depth_of(0), ctx.context_ids, ctx.question_ids, tuple(vals[asked]),
                     "all", new, ctx.spans)


def num(n, noun="magic number"):
    return lambda rng: (noun, C.digits(rng, n))


def word(noun="passphrase"):
    return lambda rng: (noun, rng.choice(C.NOUNS))


SN_Q = "What is the {noun} mentioned in the text above? Give a brief answer."
VARIANTS = {
    # the family generators as they are
    **{f"{f}:current": FAMILIES[f].generate for f in FAMILIES},
    # single needle: value formats, wording, layout
    "sn:magic6": lambda t, n, s: needle_case(t, n, s, needle="The magic number is {value}.", question=SN_Q,
                                             prefix="The {noun} mentioned in the text above is", value=num(6)),
    "sn:magic6-para": lambda t, n, s: needle_case(t, n, s, needle="The magic number is {value}.", question=SN_Q,
                                                  prefix="The {noun} mentioned in the text above is", value=num(6), para=True),
    "sn:magic6-short": lambda t, n, s: needle_case(t, n, s, needle="The magic number is {value}.",
                                                   question="What is the magic number?", prefix="The magic number is",
                                                   value=num(6)),
    "sn:magic7-para": lambda t, n, s: needle_case(t, n, s, needle="The magic number is {value}.", question=SN_Q,
                                                  prefix="The {noun} mentioned in the text above is", value=num(7), para=True),
    "sn:special4-para": lambda t, n, s: needle_case(t, n, s, needle="The special number is {value}.", question=SN_Q,
                                                    prefix="The {noun} mentioned in the text above is",
                                                    value=num(4, "special number"), para=True),
    "sn:pass6-para": lambda t, n, s: needle_case(t, n, s, needle="The passphrase is {value}.", question=SN_Q,
                                                 prefix="The {noun} mentioned in the text above is",
                                                 value=num(6, "passphrase"), para=True),
    "sn:word-para": lambda t, n, s: needle_case(t, n, s, needle="The passphrase is {value}.", question=SN_Q,
                                                prefix="The {noun} mentioned in the text above is", value=word(), para=True),
    "sn:word-quoted-para": lambda t, n, s: needle_case(t, n, s, needle="The passphrase is \"{value}\".", question=SN_Q,
                                                       prefix="The {noun} mentioned in the text above is",
                                                       value=word(), para=True),
    "sn:colon-para": lambda t, n, s: needle_case(t, n, s, needle="Magic number: {value}.", question=SN_Q,
                                                 prefix="The {noun} mentioned in the text above is", value=num(6), para=True),
    "sn:ruler-pre": lambda t, n, s: needle_case(
        t, n, s, needle="One of the special magic numbers is: {value}.", question="What is the special magic number "
        "mentioned in the provided text?", prefix="The special magic number mentioned in the provided text is",
        value=num(7, "special magic number"),
        preamble="A special magic number is hidden within the following text. Make sure to memorize it. I will quiz "
                 "you about the number afterwards.\n\n"),
    # multi-key / multi-value
    "mk:para": lambda t, n, s: multi_case(t, n, s, para=True),
    "mk:keys2-para": lambda t, n, s: multi_case(t, n, s, keys=2, para=True),
    "mk:magic-para": lambda t, n, s: multi_case(t, n, s, para=True, word="magic number"),
    "mv:para": lambda t, n, s: multi_case(t, n, s, keys=1, para=True, values_per_key=2),
    "mv:keys2-para": lambda t, n, s: multi_case(t, n, s, keys=2, para=True, values_per_key=2),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--cases", type=int, default=40)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8000])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--batch", type=int, default=10)
    ap.add_argument("--time-limit", type=float, default=480)
    ap.add_argument("--out", default="probe.json")
    args = ap.parse_args()
    set_threads(1)
    loaded = load(args.model, args.device)
    tok, model = loaded.tokenizer, loaded.model
    start = time.monotonic()
    results = []
    for length in args.lengths:
        for name in args.variants:
            if time.monotonic() - start > args.time_limit:
                break
            try:
                cases = [VARIANTS[name](tok, length, s) for s in range(args.cases)]
            except ValueError as e:
                results.append({"variant": name, "length": length, "error": str(e)})
                continue
            correct, fails = 0, []
            shapes = {}
            for c in cases:              # a batch needs equal question token counts (no padding)
                shapes.setdefault(len(c.question_ids), []).append(c)
            for rows in [g[i:i + args.batch] for g in shapes.values() for i in range(0, len(g), args.batch)]:
                for case, out in zip(rows, answer_transformers(model, rows, rows[0].max_new_tokens), strict=True):
                    text = tok.decode(out, skip_special_tokens=True).strip()
                    ok = score(text, case.answers, case.scoring)
                    correct += ok
                    if not ok and len(fails) < 6:
                        fails.append({"seed": case.seed, "depth": case.depth, "answers": case.answers, "output": text})
            results.append({"variant": name, "length": length, "cases": len(cases), "correct": correct,
                            "accuracy": correct / len(cases), "failures": fails})
            print(f"{length:>5} {name:<28} {correct}/{len(cases)}", flush=True)
            Path(args.out).write_text(json.dumps({"model": args.model, "device": str(args.device), "results": results},
                                                 indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
