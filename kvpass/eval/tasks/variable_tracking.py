"""Variable tracking: a chain of assignments 'VAR A = 52114.', 'VAR B = VAR A.', ... spread in
order through an essay haystack; the question asks which variables hold the number (scoring
"all": every name of the chain)."""

from __future__ import annotations

import random
import string

from kvpass.eval.tasks.case import SuiteCase
from kvpass.eval.tasks.context import Insert, build, digits

NAME = "variable_tracking"
MAX_NEW_TOKENS = 40
ABOUT = "every variable of a 3-step assignment chain"
CHAIN = 3


def generate(tokenizer, length: int, seed: int) -> SuiteCase:
    rng = random.Random(f"{NAME}/{seed}")
    names: list[str] = []
    while len(names) < CHAIN:
        name = "".join(rng.choice(string.ascii_uppercase) for _ in range(4))
        if name not in names:
            names.append(name)
    value = digits(rng, 5)
    depths = sorted(rng.random() for _ in names)
    lines = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:], strict=False)]
    question = f"Which variables are assigned the value {value} in the text above? List their names."
    ctx = build(tokenizer, length, question, [Insert(d, t) for d, t in zip(depths, lines, strict=True)], rng,
                answer_prefix=f"The variables assigned the value {value} are")
    return SuiteCase(NAME, length, seed, ctx.depth_of(0), ctx.context_ids, ctx.question_ids, tuple(names), "all",
                     MAX_NEW_TOKENS, ctx.spans)
