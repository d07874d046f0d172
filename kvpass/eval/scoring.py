"""Scoring of the quality suite's answers: case-insensitive containment after normalising
whitespace and punctuation. Pure Python (no torch import), so the kvpress runner's venv can import
it with the repository root on ``sys.path``.

    score("The code is Raven-4821.", ["raven 4821"], "all") -> True
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence

SCORINGS = ("all", "any")
_NOT_WORD = re.compile(r"[\W_]+", re.UNICODE)


def normalise(text: str) -> str:
    """Lower case, punctuation and underscores become spaces, runs of whitespace one space, padded
    with one space each side so containment matches whole tokens ('12' is not in ' 123 ')."""
    text = unicodedata.normalize("NFKC", text).casefold()
    return " " + " ".join(_NOT_WORD.sub(" ", text).split()) + " "


def contains(output: str, answer: str) -> bool:
    """True if ``answer``'s normalised words occur, in order and contiguous, in ``output``'s."""
    needle = normalise(answer)
    if needle.strip() == "":
        raise ValueError(f"answer {answer!r} is empty after normalising")
    return needle in normalise(output)


def score(output: str, answers: Sequence[str], scoring: str) -> bool:
    """``all``: every answer occurs in the output; ``any``: at least one does."""
    if isinstance(answers, str):
        raise TypeError(f"answers must be a list of strings, got the string {answers!r}")
    if not answers:
        raise ValueError("answers is empty")
    if scoring == "all":
        return all(contains(output, a) for a in answers)
    if scoring == "any":
        return any(contains(output, a) for a in answers)
    raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")
