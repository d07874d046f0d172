"""Token-level contexts for the quality suite: essay haystacks cut to an exact token count with
sentences (needles) inserted at sentence boundaries, in the model's chat template.

Every case of a (model, length) has exactly ``length`` context tokens (chat prefix included), so
cases batch with no padding and the kvpress peers (whose presses ignore attention masks) see the
very same tokens. The needles are tokenised on their own (with a leading space) and spliced in
between the haystack's tokens, so their ids are those the question's answer refers to.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from kvpass.eval.common import split_chat

_CACHE: dict[int, tuple[object, list[int], list[int]]] = {}


def ids_of(tokenizer, text: str) -> list[int]:
    """``text``'s token ids without special tokens."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def essay_tokens(tokenizer) -> tuple[list[int], list[int]]:
    """(ids of every Paul Graham essay, the indices where a sentence starts) for ``tokenizer``,
    computed once per tokenizer. A sentence starts at token i when token i-1 ends a sentence
    ('.', '?', '!', maybe followed by a quote or bracket) and token i begins with whitespace."""
    hit = _CACHE.get(id(tokenizer))
    if hit is not None and hit[0] is tokenizer:
        return hit[1], hit[2]
    from kvpass.prompts import essays

    ids = ids_of(tokenizer, essays())
    piece = {t: tokenizer.decode([t]) for t in set(ids)}
    ends = {t for t, p in piece.items() if re.search(r"[.?!][\"')\]]*\s*$", p) and p.strip()}
    space_led = {t for t, p in piece.items() if p[:1].isspace()}
    starts = [i for i in range(1, len(ids)) if ids[i - 1] in ends and ids[i] in space_led]
    _CACHE[id(tokenizer)] = (tokenizer, ids, starts)
    return ids, starts


@dataclass(frozen=True)
class Insert:
    """A sentence put into the haystack at ``depth`` in [0, 1] of it (at the sentence boundary at or
    before that point). ``text`` is tokenised with a leading space, or, with ``paragraph``, as a
    paragraph of its own (a blank line before and after it: SmolLM2 finds a needle laid out so far
    more often, benchmarks/results/suite-phrasing-probe-smollm2.json)."""

    depth: float
    text: str
    paragraph: bool = False

    @property
    def piece(self) -> str:
        """The text as spliced into the haystack."""
        return f"\n\n{self.text.strip()}\n\n" if self.paragraph else " " + self.text.strip()

    def __post_init__(self) -> None:
        if not 0.0 <= self.depth <= 1.0:
            raise ValueError(f"depth must lie in [0, 1], got {self.depth}")


@dataclass(frozen=True)
class Context:
    """context_ids: [length] chat prefix + preamble + haystack with the inserts; question_ids: the
    question + chat suffix + generation prompt; spans: (start, end) token index of each insert in
    context_ids, in the order given; body: (start, end) of the haystack region (preamble excluded);
    starts: where the haystack's own sentences start in context_ids."""

    context_ids: list[int]
    question_ids: list[int]
    spans: tuple[tuple[int, int], ...]
    body: tuple[int, int]
    starts: tuple[int, ...] = ()

    def depth_of(self, i: int) -> float:
        """Where insert ``i`` starts, as a fraction of the haystack tokens around it (0 = first)."""
        start, end = self.spans[i]
        others = (self.body[1] - self.body[0]) - (end - start)
        return round((start - self.body[0]) / max(others, 1), 4)


def chat_parts(tokenizer, question: str, answer_prefix: str = "") -> tuple[list[int], list[int]]:
    """(chat prefix ids up to the user's message, question ids after it) from ``common.split_chat``;
    ``answer_prefix`` (e.g. 'The passphrase is') follows the generation prompt, as the start of the
    model's reply (RULER's answer prefixes): the answer is then the reply's first words."""
    prefix, question_ids = split_chat(tokenizer, "", question)
    return prefix, question_ids + (ids_of(tokenizer, answer_prefix) if answer_prefix else [])


def haystack(tokenizer, n: int, rng: random.Random) -> tuple[list[int], list[int]]:
    """(``n`` essay tokens starting at a seeded sentence start, the sentence starts inside them
    relative to the first token, 0 included). Wraps around the corpus if needed."""
    ids, starts = essay_tokens(tokenizer)
    if n > len(ids):
        raise ValueError(f"a haystack of {n} tokens exceeds the essays' {len(ids)} tokens")
    usable = [s for s in starts if s + n <= len(ids)] or [0]
    first = rng.choice(usable)
    out = ids[first:first + n]
    return out, [0] + [s - first for s in starts if first < s < first + n]


def build(tokenizer, length: int, question: str, inserts: Sequence[Insert], rng: random.Random,
          preamble: str = "", answer_prefix: str = "", filler: list[int] | None = None, filler_starts: list[int] | None = None) -> Context:
    """A context of exactly ``length`` tokens: chat prefix, ``preamble``, then the haystack (essay
    text from ``rng``, or ``filler`` ids whose sentence starts are ``filler_starts``) cut so that the
    inserts fit, each insert at the boundary at or before its depth (inserts at one boundary keep
    their order)."""
    prefix, question_ids = chat_parts(tokenizer, question, answer_prefix)
    pre = ids_of(tokenizer, preamble) if preamble else []
    pieces = [ids_of(tokenizer, ins.piece) for ins in inserts]
    room = length - len(prefix) - len(pre) - sum(map(len, pieces))
    if room < 16:
        raise ValueError(f"length {length} leaves {room} haystack tokens (chat prefix {len(prefix)}, preamble "
                         f"{len(pre)}, needles {sum(map(len, pieces))}); need at least 16")
    if filler is None:
        hay, starts = haystack(tokenizer, room, rng)
    else:
        if len(filler) < room:
            raise ValueError(f"filler of {len(filler)} tokens is shorter than the {room} needed")
        hay, starts = filler[:room], [s for s in (filler_starts or [0]) if s < room]
    places = []
    for k, ins in enumerate(inserts):
        at = room if ins.depth == 1.0 else max(s for s in starts if s <= ins.depth * room)
        places.append((at, k))
    body_start = len(prefix) + len(pre)
    out = prefix + pre
    spans: list[tuple[int, int] | None] = [None] * len(inserts)
    cursor = 0
    for at, k in sorted(places):
        out += hay[cursor:at]
        cursor = at
        spans[k] = (len(out), len(out) + len(pieces[k]))
        out += pieces[k]
    out += hay[cursor:]
    assert len(out) == length, (len(out), length)
    absolute = tuple(s + body_start + sum(len(pieces[k]) for at, k in places if at < s) for s in starts if s < room)
    return Context(out, question_ids, tuple(spans), (body_start, length), absolute)


def same_length(tokenizer, words: Sequence[str], lead: str = " ") -> list[str]:
    """The words whose ``lead + word`` has the most common token count among ``words`` (so that
    questions naming one of them have equal token counts)."""
    counts = {w: len(ids_of(tokenizer, lead + w)) for w in words}
    common = Counter(counts.values()).most_common(1)[0][0]
    return [w for w in words if counts[w] == common]


def digits(rng: random.Random, n: int) -> str:
    """An ``n``-digit number without a leading zero, as text."""
    return str(rng.randint(10 ** (n - 1), 10 ** n - 1))


# Concrete nouns for keys and passphrases (synthetic; short, common, unambiguous).
NOUNS = ("amber", "anchor", "apple", "arrow", "badger", "bamboo", "basket", "beacon", "bishop", "breeze", "bridge",
         "candle", "canyon", "carpet", "castle", "cedar", "cobalt", "comet", "copper", "coral", "cotton", "crystal",
         "dagger", "delta", "desert", "dolphin", "dragon", "eagle", "ember", "falcon", "feather", "forest", "fossil",
         "garden", "ginger", "glacier", "granite", "harbor", "hammer", "helmet", "island", "ivory", "jacket",
         "jasmine", "jungle", "kettle", "kestrel", "ladder", "lantern", "lemon", "lizard", "magnet", "maple",
         "marble", "meadow", "mirror", "nebula", "needle", "oyster", "orchid", "otter", "palace", "panther",
         "pepper", "pillow", "planet", "pocket", "quartz", "rabbit", "raven", "ribbon", "rocket", "saffron",
         "salmon", "silver", "spider", "thistle", "tiger", "tomato", "tunnel", "velvet", "violin", "walnut",
         "willow", "window", "winter", "zephyr")
