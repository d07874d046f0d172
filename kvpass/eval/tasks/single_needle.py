"""Single needle: one passphrase (a quoted word, as a paragraph of its own) or one special magic
number (RULER's wording and preamble), stated once at a seeded depth of an essay haystack; the question, in
the same user message after the text, asks for it briefly."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from kvpass.eval.tasks.case import SuiteCase
from kvpass.eval.tasks.context import NOUNS, Insert, build, digits

NAME = "single_needle"
MAX_NEW_TOKENS = 12
ABOUT = "the one passphrase or magic number stated in an essay haystack"


@dataclass(frozen=True)
class Format:
    """A needle's wording: ``needle`` / ``question`` / ``answer_prefix`` templates over {value};
    ``preamble`` (RULER's) opens the context, before the haystack; ``value`` draws the answer;
    ``paragraph``: the needle is a paragraph of its own."""

    needle: str
    question: str
    answer_prefix: str
    value: Callable[[random.Random], str]
    preamble: str = ""
    paragraph: bool = False


# Chosen on SmolLM2-135M's full cache (benchmarks/suite_phrasing_probe.py, 40 cases a cell, H200):
# at 1k / 2k / 4k tokens the quoted word 39 / 40 / 40, RULER's magic number 40 / 40 / 38, where the
# unquoted word inside a running paragraph scored 24 / 22 / 13 and a 6-digit number 40 / 38 / 28.
FORMATS = (
    Format('The passphrase is "{value}".', "What is the passphrase mentioned in the text above? Give a brief answer.",
           "The passphrase mentioned in the text above is", lambda rng: rng.choice(NOUNS), paragraph=True),
    Format("One of the special magic numbers is: {value}.",
           "What is the special magic number mentioned in the provided text?",
           "The special magic number mentioned in the provided text is", lambda rng: digits(rng, 7),
           preamble="A special magic number is hidden within the following text. Make sure to memorize it. "
                    "I will quiz you about the number afterwards.\n\n"),
)


def needle_case(tokenizer, length: int, seed: int, depth: float, value: str, fmt: Format,
                rng: random.Random) -> SuiteCase:
    """The case with ``value`` in format ``fmt`` at ``depth`` of a haystack drawn from ``rng`` (also
    the built-in prompt of ``kvpass generate``)."""
    ctx = build(tokenizer, length, fmt.question, [Insert(depth, fmt.needle.format(value=value), paragraph=fmt.paragraph)],
                rng, preamble=fmt.preamble, answer_prefix=fmt.answer_prefix)
    return SuiteCase(NAME, length, seed, ctx.depth_of(0), ctx.context_ids, ctx.question_ids, (value,), "all",
                     MAX_NEW_TOKENS, ctx.spans)


def generate(tokenizer, length: int, seed: int) -> SuiteCase:
    rng = random.Random(f"{NAME}/{seed}")
    fmt = rng.choice(FORMATS)
    value = fmt.value(rng)
    return needle_case(tokenizer, length, seed, rng.random(), value, fmt, rng)


def demo_case(tokenizer, length: int, depth: float, seed: int) -> SuiteCase:
    """``kvpass generate``'s built-in prompt: a passphrase (the first format) at ``depth``."""
    rng = random.Random(f"{NAME}/demo/{seed}")
    fmt = FORMATS[0]
    return needle_case(tokenizer, length, seed, depth, fmt.value(rng), fmt, rng)
