"""The long-context quality suite's task families (RULER-style), each a generator seeded per case.

``FAMILIES[name].generate(tokenizer, length, seed) -> SuiteCase``: a case of exactly ``length``
context tokens (chat prefix included) in the model's chat template, its question, the answers and
how they are scored (``kvpass.eval.scoring``). Families:

| family            | asks for                                                   | scoring |
|-------------------|------------------------------------------------------------|---------|
| single_needle     | the one passphrase / number in an essay haystack           | all     |
| multi_key         | the value of one key among several key-value needles       | all     |
| multi_value       | both values stated for one key                              | all     |
| variable_tracking | every variable bound, through a chain of copies, to a value | all     |
| common_words      | the most frequent words of a word list                     | all     |
| essay_qa          | the word that follows a quoted phrase of the essay text    | all     |
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvpass.eval.tasks.case import SuiteCase


@dataclass(frozen=True)
class Family:
    """A task family: its generator, the answer length it needs and one line on what it tests."""

    name: str
    generate: Callable[..., SuiteCase]
    max_new_tokens: int
    about: str


def _registry() -> dict[str, Family]:
    from kvpass.eval.tasks import (
        common_words,
        essay_qa,
        multi_key,
        multi_value,
        single_needle,
        variable_tracking,
    )

    mods = (single_needle, multi_key, multi_value, variable_tracking, common_words, essay_qa)
    return {m.NAME: Family(m.NAME, m.generate, m.MAX_NEW_TOKENS, m.ABOUT) for m in mods}


FAMILIES: dict[str, Family] = _registry()


def get_family(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"unknown family {name!r}; available: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def generate(tokenizer, family: str, length: int, seed: int) -> SuiteCase:
    """``FAMILIES[family].generate(tokenizer, length, seed)``."""
    return get_family(family).generate(tokenizer, length, seed)
