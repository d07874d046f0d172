"""The pure-Python half of the peers runners: reading suite cases, batching them, the
compression-ratio <-> budget mapping, and the stored records (scored case, error).

No torch, no transformers, no kvpass runtime: it runs in the peers venv (transformers 5.2, where
kvpass's runtime cannot import) and in kvpass's venv (tests/eval/test_peers.py). kvpass's pure
modules (``kvpass/eval/store.py``, ``kvpass/eval/scoring.py``) are loaded by file path
(``load_pure``), so ``kvpass/__init__.py`` (which imports the runtime) never runs.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

QUERY_AWARE, QUERY_AGNOSTIC, REFERENCE = "query_aware", "query_agnostic", "reference"
MODES = (QUERY_AWARE, QUERY_AGNOSTIC)
REQUIRED = {"key": str, "model": str, "context_ids": list, "question_ids": list, "answers": list,
            "scoring": str, "max_new_tokens": int}
ID_FIELDS = ("context_ids", "question_ids")


def load_pure(relative: str) -> ModuleType:
    """A pure module of the repository (e.g. ``"kvpass/eval/store.py"``) loaded from its file alone,
    without importing its package, under the name ``peers_<stem>``."""
    name = "peers_" + Path(relative).stem
    if name in sys.modules:
        return sys.modules[name]
    path = ROOT / relative
    if not path.is_file():
        raise FileNotFoundError(f"{relative} is not in the repository at {ROOT}")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def store_module() -> ModuleType:
    return load_pure("kvpass/eval/store.py")


def score(output: str, answers: Sequence[str], scoring: str) -> bool:
    """``kvpass.eval.scoring.score``, loaded without kvpass's package."""
    return bool(load_pure("kvpass/eval/scoring.py").score(output, answers, scoring))


def check_case(case: dict[str, Any], where: str = "case") -> dict[str, Any]:
    """The case itself, after checking the fields the runner needs (HELPERS.md's case format)."""
    for field, kind in REQUIRED.items():
        if field not in case:
            raise ValueError(f"{where}: missing field {field!r} (a case needs {', '.join(REQUIRED)})")
        if not isinstance(case[field], kind) or isinstance(case[field], bool):
            raise TypeError(f"{where}: field {field!r} must be {kind.__name__}, got {type(case[field]).__name__}")
    for field in ID_FIELDS:
        if not case[field] or not all(isinstance(t, int) and not isinstance(t, bool) for t in case[field]):
            raise ValueError(f"{where}: {field} must be a non-empty list of token ids")
    if case["scoring"] not in ("all", "any"):
        raise ValueError(f"{where}: scoring must be 'all' or 'any', got {case['scoring']!r}")
    if case["max_new_tokens"] < 1:
        raise ValueError(f"{where}: max_new_tokens must be >= 1, got {case['max_new_tokens']}")
    return case


def read_cases(path: str | Path, models: Iterable[str] | None = None, limit: int | None = None) -> list[dict]:
    """The cases of a JSON Lines file (one case per non-empty line), checked; only ``models``
    if given; the first ``limit`` of them if given. Keys must be unique."""
    wanted = set(models) if models else None
    out, seen = [], set()
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            case = check_case(json.loads(line), where=f"{path}:{n}")
            if case["key"] in seen:
                raise ValueError(f"{path}:{n}: duplicate case key {case['key']!r}")
            seen.add(case["key"])
            if wanted is None or case["model"] in wanted:
                out.append(case)
    return out[:limit] if limit is not None else out


def budget_of_ratio(ratio: float) -> float:
    """kvpress's ``compression_ratio`` (fraction removed) -> kvpass's budget (fraction kept)."""
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"compression ratio must lie in [0, 1), got {ratio}")
    return round(1.0 - ratio, 6)


def ratio_of_budget(budget: float) -> float:
    """kvpass's budget (fraction kept, in (0, 1]) -> kvpress's ``compression_ratio``."""
    if not 0.0 < budget <= 1.0:
        raise ValueError(f"budget must lie in (0, 1], got {budget}")
    return round(1.0 - budget, 6)


def shape_of(case: dict) -> tuple[str, int, int, int]:
    """What must be equal for cases to share one unpadded batch."""
    return case["model"], len(case["context_ids"]), len(case["question_ids"]), case["max_new_tokens"]


def batches(cases: Sequence[dict], size: int) -> list[list[dict]]:
    """The cases grouped by (model, context tokens, question tokens, max_new_tokens), in their order
    of first appearance, each group cut into batches of at most ``size``: no batch needs padding."""
    if size < 1:
        raise ValueError(f"batch size must be >= 1, got {size}")
    groups: dict[tuple, list[dict]] = {}
    for case in cases:
        groups.setdefault(shape_of(case), []).append(case)
    return [g[i:i + size] for g in groups.values() for i in range(0, len(g), size)]


def interleaved(batch_list: Sequence[list[dict]]) -> list[list[dict]]:
    """The batches round-robin over their shapes (first batch of every shape, then the second...),
    so a run stopped early has covered every (model, length) thinly rather than a few fully."""
    by_shape: dict[tuple, list[list[dict]]] = {}
    for b in batch_list:
        by_shape.setdefault(shape_of(b[0]), []).append(b)
    queues = list(by_shape.values())
    return [q[i] for i in range(max(map(len, queues), default=0)) for q in queues if i < len(q)]


def record_key(case: dict, policy: str, budget: float | None, mode: str) -> str:
    return store_module().case_key(kind="peer", case=case["key"], policy=policy, budget=budget, mode=mode)


def error_key(model: str, policy: str, budget: float | None, mode: str, tokens: int) -> str:
    """The key of a press's failure at one (model, budget, mode, prompt token count)."""
    return store_module().case_key(kind="peer-error", model=model, policy=policy, budget=budget, mode=mode,
                                   tokens=tokens)


def case_fields(case: dict) -> dict[str, Any]:
    """The case's fields without the token id lists, plus their lengths."""
    out = {k: v for k, v in case.items() if k not in ID_FIELDS}
    out["case"] = case["key"]
    out["context_tokens"] = len(case["context_ids"])
    out["question_tokens"] = len(case["question_ids"])
    return out


def make_record(case: dict, *, policy: str, budget: float | None, mode: str, output: str,
                output_ids: list[int], seconds: float, device: str, cache_bytes: int | None = None,
                press: str | None = None, **extra: Any) -> dict[str, Any]:
    """The stored form of one scored case (HELPERS.md): the case's fields (minus the id lists),
    policy, budget (fraction kept), mode, output, correct, seconds, device, cache_bytes."""
    if mode not in (*MODES, REFERENCE):
        raise ValueError(f"mode must be one of {(*MODES, REFERENCE)}, got {mode!r}")
    return {
        **case_fields(case),
        "key": record_key(case, policy, budget, mode), "kind": "peer",
        "policy": policy, "budget": budget, "mode": mode, "press": press,
        "output": output, "output_ids": list(output_ids),
        "correct": score(output, case["answers"], case["scoring"]),
        "seconds": round(seconds, 4), "device": device, "cache_bytes": cache_bytes, **extra,
    }


def error_record(model: str, *, policy: str, budget: float | None, mode: str, tokens: int,
                 error: BaseException | str, press: str | None = None, device: str = "cpu",
                 cases: int = 0) -> dict[str, Any]:
    """One record saying that a press failed for a (model, policy, budget, mode) at prompts of
    ``tokens`` tokens (a failure can depend on the length: memory): ``error`` names the exception;
    ``cases`` the number of cases it left unscored in this run. A re-run skips the press there
    while this record is stored (``--retry-errors`` drops it)."""
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    return {"key": error_key(model, policy, budget, mode, tokens), "kind": "peer-error", "model": model,
            "policy": policy, "budget": budget, "mode": mode, "tokens": tokens, "press": press, "error": text[:2000],
            "device": device, "cases": cases, "correct": None, "output": None}
