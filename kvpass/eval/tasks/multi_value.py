"""Multi-value needle (RULER's niah_multivalue wording): one key with several special magic
numbers stated at seeded depths; the question asks for all of them (scoring "all")."""

from __future__ import annotations

import random

from kvpass.eval.tasks.case import SuiteCase
from kvpass.eval.tasks.context import NOUNS, Insert, build, digits, same_length

NAME = "multi_value"
MAX_NEW_TOKENS = 24
ABOUT = "both magic numbers stated for one key"
VALUES = 2
PREAMBLE = ("Some special magic numbers are hidden within the following text. Make sure to memorize them. "
            "I will quiz you about the numbers afterwards.\n\n")


def generate(tokenizer, length: int, seed: int) -> SuiteCase:
    rng = random.Random(f"{NAME}/{seed}")
    key = rng.choice(same_length(tokenizer, NOUNS))
    values = [digits(rng, 7) for _ in range(VALUES)]
    depths = sorted(rng.random() for _ in values)
    question = f"What are all the special magic numbers for {key} mentioned in the provided text?"
    ctx = build(tokenizer, length, question,
                [Insert(d, f"One of the special magic numbers for {key} is: {v}.") for v, d in zip(values, depths, strict=True)],
                rng, preamble=PREAMBLE,
                answer_prefix=f"The special magic numbers for {key} mentioned in the provided text are")
    return SuiteCase(NAME, length, seed, ctx.depth_of(0), ctx.context_ids, ctx.question_ids, tuple(values), "all",
                     MAX_NEW_TOKENS, ctx.spans)
