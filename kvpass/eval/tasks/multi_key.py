"""Multi-key needle (RULER's niah_multikey wording): special magic numbers for several keys at
seeded depths; the question asks for one key's number (the others are distractors)."""

from __future__ import annotations

import random

from kvpass.eval.tasks.case import SuiteCase
from kvpass.eval.tasks.context import NOUNS, Insert, build, digits, same_length

NAME = "multi_key"
MAX_NEW_TOKENS = 12
ABOUT = "one key's magic number among 4 key-number needles"
KEYS = 4
PREAMBLE = ("Some special magic numbers are hidden within the following text. Make sure to memorize them. "
            "I will quiz you about the numbers afterwards.\n\n")


def generate(tokenizer, length: int, seed: int) -> SuiteCase:
    rng = random.Random(f"{NAME}/{seed}")
    keys = rng.sample(same_length(tokenizer, NOUNS), KEYS)          # equal question token counts
    values = [digits(rng, 7) for _ in keys]
    depths = [rng.random() for _ in keys]
    asked = rng.randrange(KEYS)
    inserts = [Insert(d, f"One of the special magic numbers for {k} is: {v}.")
               for k, v, d in zip(keys, values, depths, strict=True)]
    order = [asked] + [i for i in range(KEYS) if i != asked]          # the asked needle's span first
    question = f"What is the special magic number for {keys[asked]} mentioned in the provided text?"
    ctx = build(tokenizer, length, question, [inserts[i] for i in order], rng, preamble=PREAMBLE,
                answer_prefix=f"The special magic number for {keys[asked]} mentioned in the provided text is")
    return SuiteCase(NAME, length, seed, ctx.depth_of(0), ctx.context_ids, ctx.question_ids, (values[asked],),
                     "all", MAX_NEW_TOKENS, ctx.spans)
