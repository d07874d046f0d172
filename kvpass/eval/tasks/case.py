"""One case of the quality suite (``SuiteCase``), in a module of its own so that the task families
import it without importing the registry that imports them (``kvpass.eval.tasks``)."""

from __future__ import annotations

from dataclasses import dataclass

from kvpass.eval.scoring import SCORINGS


@dataclass(frozen=True)
class SuiteCase:
    """One case: ``context_ids`` [length] and ``question_ids`` token ids (see ``tasks.context``),
    the ``answers`` the output must contain (``scoring`` all / any), ``depth`` of the (first asked)
    needle in [0, 1] of the haystack or None, and the needles' token ``spans`` in context_ids."""

    family: str
    length: int
    seed: int
    depth: float | None
    context_ids: list[int]
    question_ids: list[int]
    answers: tuple[str, ...]
    scoring: str
    max_new_tokens: int
    spans: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        if self.scoring not in SCORINGS:
            raise ValueError(f"scoring must be one of {SCORINGS}, got {self.scoring!r}")
        if len(self.context_ids) != self.length:
            raise ValueError(f"{self.family} seed {self.seed}: {len(self.context_ids)} context tokens, want {self.length}")

    @property
    def prompt_tokens(self) -> int:
        return len(self.context_ids) + len(self.question_ids)

    @property
    def ident(self) -> tuple[str, int, int]:
        """What names the case within a model: (family, length, seed)."""
        return self.family, self.length, self.seed
