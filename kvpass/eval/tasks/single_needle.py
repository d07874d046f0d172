"""Single needle: one passphrase (or number, or code) stated once as a plain sentence at a seeded
depth of an essay haystack; the question, in the same user message, asks for it briefly."""

from __future__ import annotations

import random

from kvpass.eval.tasks.case import SuiteCase
from kvpass.eval.tasks.context import NOUNS, Insert, build, digits

NAME = "single_needle"
MAX_NEW_TOKENS = 12
ABOUT = "the one passphrase stated in an essay haystack"

# (what the needle names, a value generator), and the needle's phrasings: the seed picks one of each.
# Short values stated once (a two-part passphrase like 'pocket-4632' came back as '4632', 'mirror
# basket' not at all, from SmolLM2 at 1k tokens).
FORMATS = (
    ("magic number", lambda rng: digits(rng, 6)),
    ("passphrase", lambda rng: rng.choice(NOUNS)),
    ("access code", lambda rng: digits(rng, 4)),
)
PHRASINGS = ("The secret {noun} is {value}.", "Note that the secret {noun} is {value}.")


def generate(tokenizer, length: int, seed: int) -> SuiteCase:
    rng = random.Random(f"{NAME}/{seed}")
    noun, make = rng.choice(FORMATS)
    value = make(rng)
    depth = rng.random()
    question = f"What is the secret {noun} mentioned in the text above? Give a brief answer."
    ctx = build(tokenizer, length, question, [Insert(depth, rng.choice(PHRASINGS).format(noun=noun, value=value))], rng,
                answer_prefix=f"The secret {noun} is")
    return SuiteCase(NAME, length, seed, ctx.depth_of(0), ctx.context_ids, ctx.question_ids, (value,), "all",
                     MAX_NEW_TOKENS, ctx.spans)
