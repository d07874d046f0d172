"""Extractive question over the essay text: the question quotes a phrase of one line
of the haystack (at a seeded depth) and asks for the word that follows; the answer is that word of
the essay's own text. No synthetic needle: the policy must have kept an ordinary sentence, not a
salient outlier, which is where eviction hurts most; scoring is exact (the word, case-insensitive).
A cloze over real text is extractive QA whose answer is unambiguous and checkable by containment;
quoting a fixed number of tokens keeps the question token counts equal (large batches)."""

from __future__ import annotations

import random
import re

from kvpass.eval.tasks.case import SuiteCase
from kvpass.eval.tasks.context import build, chat_parts

NAME = "essay_qa"
MAX_NEW_TOKENS = 6
ABOUT = "the word after a quoted phrase of one essay sentence"
QUOTED = 24           # tokens of the essay quoted in the question (12: 1/4 at 1k, 24: 3/6)
TEMPLATE = 'Repeat the words of the text above that follow "{quote}".'
ANSWER_PREFIX = '{quote}'
_STOP = {"that", "this", "with", "have", "from", "they", "what", "which", "there", "their", "would", "about",
         "been", "were", "when", "will", "more", "than", "then", "them", "some", "into", "your", "also", "just"}


def generate(tokenizer, length: int, seed: int) -> SuiteCase:
    """A phrase of ``QUOTED`` tokens on one line of the haystack, starting at a word near a seeded
    depth, unique in the context and followed by an ordinary word (4+ letters, not a stop word). The
    first 300 tries also require the question's token count to be the family's (the template's plus
    twice ``QUOTED``: the question and the reply's prefix quote it), so that the family's questions
    batch together; later tries take any count, the last 100 (tiny contexts) any word."""
    rng = random.Random(f"{NAME}/{seed}")
    ctx = build(tokenizer, length, TEMPLATE.format(quote=""), [], rng)
    ids = ctx.context_ids
    text_of = tokenizer.decode
    whole = text_of(ids[ctx.body[0]:])
    want = len(chat_parts(tokenizer, TEMPLATE.format(quote=""), ANSWER_PREFIX.format(quote=""))[1]) + 2 * QUOTED
    last = len(ids) - QUOTED - 16
    words = [i for i in range(ctx.body[0] + 1, last) if text_of(ids[i:i + 1])[:1].isspace()
             or text_of(ids[i - 1:i])[-1:] == "\n"]
    if not words:
        raise ValueError(f"{NAME}: length {length} leaves no phrase to quote")
    for attempt in range(600):
        target = ctx.body[0] + rng.random() * (ctx.body[1] - ctx.body[0])
        s = min((w for w in words if w >= target), default=words[-1])
        quote = text_of(ids[s:s + QUOTED])
        m = re.match(r" ([A-Za-z]+)[^A-Za-z]", text_of(ids[s + QUOTED:s + QUOTED + 16]))
        strict = attempt < 500                 # the last tries (tiny contexts) take any word and line breaks
        if ("\n" in quote and strict) or not m or not quote.strip() or whole.count(quote.strip()) != 1:
            continue
        word = m.group(1)
        if strict and (len(word) < 4 or word.lower() in _STOP):
            continue
        _, question_ids = chat_parts(tokenizer, TEMPLATE.format(quote=quote.strip()),
                                     ANSWER_PREFIX.format(quote=quote.strip()))
        if attempt < 300 and len(question_ids) != want:
            continue
        real = (s - ctx.body[0]) / max(ctx.body[1] - ctx.body[0], 1)
        return SuiteCase(NAME, length, seed, round(real, 4), ids, question_ids, (word,), "all", MAX_NEW_TOKENS,
                         ((s, _end_of(tokenizer, ids, s + QUOTED, word)),))
    raise ValueError(f"{NAME}: no usable phrase for length {length}, seed {seed}")


def _end_of(tokenizer, ids: list[int], start: int, word: str) -> int:
    """The first token index after ``start`` by which ``word`` has been decoded."""
    return next((e for e in range(start + 1, len(ids) + 1) if word in tokenizer.decode(ids[start:e])), len(ids))

