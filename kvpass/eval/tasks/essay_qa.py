"""Extractive question over one essay sentence: the question quotes the first words of a sentence
of the haystack (at a seeded depth) and asks for the word that follows; the answer is that word of
the essay's own text. No synthetic needle: the policy must have kept an ordinary sentence, not a
salient outlier, which is where eviction hurts most; scoring is exact (the word, case-insensitive).
A cloze over real text is extractive QA whose answer is unambiguous and checkable by containment."""

from __future__ import annotations

import random
import re

from kvpass.eval.tasks import SuiteCase
from kvpass.eval.tasks.context import build, chat_parts

NAME = "essay_qa"
MAX_NEW_TOKENS = 10
ABOUT = "the word after a quoted phrase of one essay sentence"
QUOTED = 7            # words of the sentence quoted in the question
TEMPLATE = 'In the text above, which word comes right after "{quote}"? Answer with that word only.'
_STOP = {"that", "this", "with", "have", "from", "they", "what", "which", "there", "their", "would", "about",
         "been", "were", "when", "will", "more", "than", "then", "them", "some", "into", "your", "also", "just"}


def generate(tokenizer, length: int, seed: int) -> SuiteCase:
    rng = random.Random(f"{NAME}/{seed}")
    ctx = build(tokenizer, length, TEMPLATE.format(quote=""), [], rng)
    ids = ctx.context_ids
    text_of = tokenizer.decode
    whole = text_of(ids[ctx.body[0]:])
    last = len(ids) - 12 * QUOTED - 16
    sentences = [s for s in ctx.starts if s < last]
    words = [i for i in range(ctx.body[0] + 1, last) if text_of(ids[i - 1:i])[-1:].isspace()
             or text_of(ids[i:i + 1])[:1].isspace()]
    for attempt in range(200):                 # a sentence (after 50 tries: any word) near a seeded depth
        depth = rng.random()                   # whose quote is unique and is followed by an ordinary word
        target = ctx.body[0] + depth * (ctx.body[1] - ctx.body[0])
        starts = sentences if attempt < 50 and sentences else words
        if not starts:
            break
        s = min((s for s in starts if s >= target), default=starts[-1])
        head = text_of(ids[s:s + 12 * QUOTED + 16])
        m = re.match(r"\s*((?:[^\s]+\s+){%d})([A-Za-z]+)\b" % QUOTED, head)
        if not m:
            continue
        quote, word = " ".join(m.group(1).split()), m.group(2)
        if len(word) < 4 or word.lower() in _STOP or whole.count(m.group(1).rstrip()) != 1:
            continue
        end = next(e for e in range(s + 1, min(s + 12 * QUOTED + 17, len(ids) + 1)) if word in text_of(ids[s:e])[len(m.group(1)):])
        question = TEMPLATE.format(quote=quote)
        _, question_ids = chat_parts(tokenizer, question)
        span = (s, end)
        real = (s - ctx.body[0]) / max(ctx.body[1] - ctx.body[0], 1)
        return SuiteCase(NAME, length, seed, round(real, 4), ids, question_ids, (word,), "all", MAX_NEW_TOKENS,
                         (span,))
    raise ValueError(f"{NAME}: no usable sentence for length {length}, seed {seed}")
