"""Common-word extraction: a comma-separated list of essay words in which three words appear many
times and every other word once; the question asks for the three most frequent (scoring "all")."""

from __future__ import annotations

import random
import re
from functools import lru_cache

from kvpass.eval.tasks.case import SuiteCase
from kvpass.eval.tasks.context import build, chat_parts, ids_of

NAME = "common_words"
MAX_NEW_TOKENS = 24
ABOUT = "the 3 most frequent words of a word list"
COMMON = 3
SHARE = 0.06            # each common word is this fraction of the list's entries
PREAMBLE = "Below is a list of words. Some words appear many times in the list, the others only once.\n"
QUESTION = "What are the three most common words in the list above? Answer with the three words only."
ANSWER_PREFIX = "The three most common words in the list are"


@lru_cache(maxsize=1)
def essay_words() -> tuple[str, ...]:
    """Distinct lower-case words of 4 to 9 letters of the essays, sorted."""
    from kvpass.prompts import essays

    return tuple(sorted(set(re.findall(r"\b[a-z]{4,9}\b", essays()))))


def generate(tokenizer, length: int, seed: int) -> SuiteCase:
    rng = random.Random(f"{NAME}/{seed}")
    pool = list(essay_words())
    rng.shuffle(pool)
    common, rare = pool[:COMMON], iter(pool[COMMON:])
    prefix, _ = chat_parts(tokenizer, QUESTION)
    room = length - len(prefix) - len(ids_of(tokenizer, PREAMBLE))
    per_entry = sum(len(ids_of(tokenizer, f" {w},")) for w in pool[:50]) / 50
    entries = max(int(room / per_entry), COMMON)
    repeats = max(2, round(SHARE * entries))
    words = [w for w in common for _ in range(repeats)]
    words += [next(rare) for _ in range(max(entries - len(words), 0))]
    rng.shuffle(words)
    ids: list[int] = []
    for i, w in enumerate(words):
        ids += ids_of(tokenizer, (" " if i else "") + w + ",")
    while len(ids) < room:                      # top up with rare words; the cut falls in one of them
        ids += ids_of(tokenizer, f" {next(rare)},")
    ctx = build(tokenizer, length, QUESTION, [], rng, preamble=PREAMBLE, filler=ids, filler_starts=[0],
                answer_prefix=ANSWER_PREFIX)
    return SuiteCase(NAME, length, seed, None, ctx.context_ids, ctx.question_ids, tuple(common), "all",
                     MAX_NEW_TOKENS)
