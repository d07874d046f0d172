"""Multi-key needle: several passphrases, each for a different key, at seeded depths; the
question asks for one key's passphrase (the others are distractors)."""

from __future__ import annotations

import random

from kvpass.eval.tasks.case import SuiteCase
from kvpass.eval.tasks.context import NOUNS, Insert, build, digits, same_length

NAME = "multi_key"
MAX_NEW_TOKENS = 12
ABOUT = "one key's passphrase among 4 key-passphrase needles"
KEYS = 4


def generate(tokenizer, length: int, seed: int) -> SuiteCase:
    rng = random.Random(f"{NAME}/{seed}")
    keys = rng.sample(same_length(tokenizer, NOUNS), KEYS)          # equal question token counts
    values = [digits(rng, 6) for _ in keys]
    depths = [rng.random() for _ in keys]
    asked = rng.randrange(KEYS)
    inserts = [Insert(d, f"The passphrase for the {k} is {v}.") for k, v, d in zip(keys, values, depths, strict=True)]
    order = [asked] + [i for i in range(KEYS) if i != asked]          # the asked needle's span first
    question = f"What is the passphrase for the {keys[asked]}? Give a brief answer."
    ctx = build(tokenizer, length, question, [inserts[i] for i in order], rng,
                answer_prefix=f"The passphrase for the {keys[asked]} is")
    return SuiteCase(NAME, length, seed, ctx.depth_of(0), ctx.context_ids, ctx.question_ids, (values[asked],),
                     "all", MAX_NEW_TOKENS, ctx.spans)
