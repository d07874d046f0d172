"""Single needle: one passphrase (or number, or code) stated once as a plain sentence at a seeded
depth of an essay haystack; the question, in the same user message, asks for it briefly."""

from __future__ import annotations

import random

from kvpass.eval.tasks.case import SuiteCase
from kvpass.eval.tasks.context import NOUNS, Insert, build, digits

NAME = "single_needle"
MAX_NEW_TOKENS = 12
ABOUT = "the one passphrase stated in an essay haystack"

# (what the needle names, a value generator): the seed picks one per case
FORMATS = (
    ("passphrase", lambda rng: f"{rng.choice(NOUNS)}-{digits(rng, 4)}"),
    ("magic number", lambda rng: digits(rng, 6)),
    ("access code", lambda rng: f"{rng.choice(NOUNS)} {rng.choice(NOUNS)}"),
)


def generate(tokenizer, length: int, seed: int) -> SuiteCase:
    rng = random.Random(f"{NAME}/{seed}")
    noun, make = rng.choice(FORMATS)
    value = make(rng)
    depth = rng.random()
    question = f"What is the secret {noun} mentioned in the text above? Give a brief answer."
    ctx = build(tokenizer, length, question, [Insert(depth, f"The secret {noun} is {value}.")], rng,
                answer_prefix=f"The secret {noun} is")
    return SuiteCase(NAME, length, seed, ctx.depth_of(0), ctx.context_ids, ctx.question_ids, (value,), "all",
                     MAX_NEW_TOKENS, ctx.spans)
