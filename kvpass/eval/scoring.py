"""Scoring of a generated answer against a case's expected answers (the task-suite contract).

Pure Python (no torch import): the peers runners (benchmarks/peers/) load this file from another
virtual environment. A minimal version written for the peers runner; the task suite owns it.
"""

from __future__ import annotations

from collections.abc import Sequence

SCORINGS = ("all", "any")


def score(output_text: str, answers: Sequence[str], scoring: str = "all") -> bool:
    """Whether ``output_text`` contains every answer (``scoring="all"``) or at least one
    (``scoring="any"``), verbatim."""
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")
    if isinstance(answers, str) or not answers:
        raise ValueError(f"answers must be a non-empty list of strings, got {answers!r}")
    hits = [answer in output_text for answer in answers]
    return all(hits) if scoring == "all" else any(hits)
