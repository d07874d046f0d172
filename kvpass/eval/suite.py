"""The long-context quality suite: task families x lengths x seeds (``kvpass.eval.tasks``) scored
for policies x budgets x modes, batched with no padding, resumable, with a time limit.

* Cases: ``cases(tokenizer, families, lengths, n)`` -> seeds 0..n-1 of every (family, length); every
  case of a length has exactly that many context tokens.
* Modes (as ``niah``): ``query_aware`` (context + question prefilled and compressed together),
  ``query_agnostic`` (the context compressed alone to its own budget, then the question prefilled over it and
  never compressed), ``query_agnostic_bounded`` (the question fed through decode steps that keep compressing), and
  the plain transformers ``reference``, which ``full`` must equal case for case.
* ``run``: per batch of cases with equal (context, question, answer) token counts and per mode, one
  prefill shared by every (policy, budget) (``shared``), one decode session per cell (every policy budgets each row as if alone, EMS
  for rows of equal length, as every suite batch is: tests/runtime/test_rows_independent.py); stops cleanly at ``deadline``.
* ``export``: the shared case format (JSON Lines) that the kvpress runner reads.
* ``calibration``: the full cache's and transformers' accuracy per (family, length), the cells at
  or above ``KEEP`` kept in ``tasks/calibration.json`` as the model's default grid.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm

from kvpass.eval.common import Loaded
from kvpass.eval.niah import (
    MODES,
    REFERENCE,
    Cell,
    _device_name,
    cells,
    run_batches,
)
from kvpass.eval.scoring import score
from kvpass.eval.store import Store, case_key
from kvpass.eval.tasks import FAMILIES, SuiteCase, generate

__all__ = ["MODES", "REFERENCE", "Cell", "cells", "cases", "batches", "run", "export", "calibration",
           "DEFAULT_LENGTHS", "CALIBRATION", "KEEP"]

KIND = "suite"
KEEP = 0.9
CALIBRATION = Path(__file__).with_name("tasks") / "calibration.json"
# the lengths each model is calibrated at (context tokens; SmolLM2's window is 8192)
DEFAULT_LENGTHS = {"smollm2": [1024, 2048, 4096], "gemma3-270m": [4096, 8192, 16384],
                   "qwen2.5-1.5b": [4096, 8192, 16384], "qwen2.5-0.5b": [4096, 8192, 16384]}


def cases(tokenizer, families: Sequence[str], lengths: Sequence[int], n: int,
          grid: Sequence[tuple[str, int]] | None = None, first: int = 0) -> list[SuiteCase]:
    """Seeds first..first+n-1 of every (family, length) (or of every cell of ``grid``), in a fixed shuffled
    order so an interrupted run has covered every cell thinly. Each seed is its own case (its own needle, value,
    depth and haystack), so seeds past the leaderboard's are cases it never saw."""
    pairs = list(grid) if grid is not None else [(f, length) for f in families for length in lengths]
    out = [generate(tokenizer, f, length, seed) for f, length in pairs for seed in range(first, first + n)]
    random.Random(0).shuffle(out)
    return out


def batches(items: Sequence[SuiteCase], size: int) -> list[list[SuiteCase]]:
    """The cases grouped by (context tokens, question tokens, max new tokens), each group cut into
    batches of at most ``size`` rows, largest first: the rows of a batch need no padding."""
    groups: dict[tuple[int, int, int], list[SuiteCase]] = {}
    for c in items:
        groups.setdefault((len(c.context_ids), len(c.question_ids), c.max_new_tokens), []).append(c)
    out = [g[i:i + size] for g in groups.values() for i in range(0, len(g), max(size, 1))]
    return sorted(out, key=len, reverse=True)


def cell_options(cell: Cell, prefill_chunk: int | None = None, kv_dtype: str | None = None) -> dict:
    """The run options a kvpass cell's record and key carry where they are not the default: ``prefill_chunk``
    (prefilled in chunks) and ``kv_dtype`` (8-bit cache entries); none for the reference, nor at the defaults, so
    the keys of stores written before either option existed are unchanged."""
    if cell.policy == REFERENCE:
        return {}
    return {name: value for name, value in (("prefill_chunk", prefill_chunk), ("kv_dtype", kv_dtype))
            if value is not None}


def key_of(model: str, cell: Cell, case: SuiteCase, prefill_chunk: int | None = None,
           kv_dtype: str | None = None) -> str:
    """The case's key; a kvpass cell prefilled in chunks (``prefill_chunk``) or over 8-bit entries (``kv_dtype``)
    has its own."""
    return case_key(kind=KIND, model=model, policy=cell.policy, budget=cell.budget, mode=cell.mode,
                    family=case.family, length=case.length, seed=case.seed, max_new_tokens=case.max_new_tokens,
                    **cell_options(cell, prefill_chunk, kv_dtype))


def case_fields(model: str, case: SuiteCase) -> dict:
    """The fields of the shared case format except the token ids and the key."""
    return {"model": model, "family": case.family, "length": case.length, "seed": case.seed, "depth": case.depth,
            "answers": list(case.answers), "scoring": case.scoring, "max_new_tokens": case.max_new_tokens}


def export(model: str, items: Sequence[SuiteCase], path: str | Path) -> Path:
    """Write ``items`` in the shared case format (JSON Lines, sorted by key) -> the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [{"key": case_key(kind=KIND, model=model, family=c.family, length=c.length, seed=c.seed),
             **case_fields(model, c), "context_ids": list(c.context_ids), "question_ids": list(c.question_ids)}
            for c in items]
    path.write_text("".join(json.dumps(r) + "\n" for r in sorted(rows, key=lambda r: r["key"])), encoding="utf-8")
    return path


def _record(loaded: Loaded, cell: Cell, case: SuiteCase, tokens: list[int], size, seconds: float,
            prefill_chunk: int | None = None, kv_dtype: str | None = None) -> dict:
    output = loaded.tokenizer.decode(tokens, skip_special_tokens=True).strip()
    return {"key": key_of(loaded.name, cell, case, prefill_chunk, kv_dtype), "kind": KIND,
            **case_fields(loaded.name, case), **cell_options(cell, prefill_chunk, kv_dtype),
            "policy": cell.policy, "budget": cell.budget, "mode": cell.mode,
            "context_tokens": len(case.context_ids), "question_tokens": len(case.question_ids),
            "output": output, "output_ids": tokens, "correct": score(output, case.answers, case.scoring),
            "cache_bytes": size.cache_bytes if size else None,
            "full_cache_bytes": size.full_cache_bytes if size else None,
            "seconds": round(seconds, 4), "device": _device_name(loaded.device), "dtype": loaded.dtype}


def run(loaded: Loaded, items: Sequence[SuiteCase], cell_list: Sequence[Cell], store: Store, batch: int = 16,
        deadline: float | None = None, desc: str = "suite", prefill_chunk: int | None = None,
        kv_dtype: str | None = None) -> bool:
    """Score every (case, cell) not yet in ``store``; True when all are stored, False when
    ``deadline`` (a ``time.monotonic()`` value) passed first (the store holds every finished batch).

    Cases are batched by equal token counts (``batches``: every policy then treats a batch's rows as if
    alone) and scored by ``niah.run_batches``, the loop the needle evaluation runs too: per batch and mode
    one prefill serves every (policy, budget) cell, the transformers reference runs last. ``prefill_chunk``:
    every kvpass cell prefills its own prompt in chunks of that many tokens, compressed between chunks
    (kvpass/runtime/chunked_prefill.py), instead of sharing one prefill; its records carry it (and their keys).
    ``kv_dtype``: every kvpass cell's cache entries ("int8", "fp8_e4m3"; ``kvpass.apply``'s), carried likewise."""
    todo = {(c.ident, cell) for c in items for cell in cell_list
            if key_of(loaded.name, cell, c, prefill_chunk, kv_dtype) not in store}
    bar = tqdm(total=len(todo), desc=desc, unit="case", dynamic_ncols=True)
    groups = batches([c for c in items if any((c.ident, cell) in todo for cell in cell_list)], batch)
    try:
        return run_batches(loaded, groups, cell_list, todo, store, bar, ident=lambda case: case.ident,
                           new_tokens=lambda group: group[0].max_new_tokens,
                           record=lambda cell, case, tokens, size, seconds: _record(loaded, cell, case, tokens,
                                                                                    size, seconds, prefill_chunk,
                                                                                    kv_dtype),
                           deadline=deadline, prefill_chunk=prefill_chunk, kv_dtype=kv_dtype)
    finally:
        bar.close()


def calibration(records: Sequence[dict], keep: float = KEEP) -> dict:
    """Per (family, length): the full cache's accuracy (worst of its modes), transformers', the case
    count; ``kept`` lists the cells whose every one of these reaches ``keep``."""
    by: dict[tuple[str, int], dict[str, list[bool]]] = {}
    devices = sorted({r.get("device", "cpu") for r in records if r["policy"] in ("full", REFERENCE)})
    for r in records:
        if r["policy"] in ("full", REFERENCE) and r.get("kind", KIND) == KIND:
            by.setdefault((r["family"], r["length"]), {}).setdefault(r["mode"], []).append(bool(r["correct"]))
    cells_out = []
    for (family, length), modes in sorted(by.items()):
        acc = {m: sum(v) / len(v) for m, v in modes.items()}
        full = [a for m, a in acc.items() if m != "reference"]
        cells_out.append({"family": family, "length": length, "full_accuracy": min(full) if full else None,
                          "transformers_accuracy": acc.get("reference"), "per_mode": acc,
                          "cases": min(len(v) for v in modes.values()),
                          "kept": all(a >= keep for a in acc.values())})
    return {"keep_at_least": keep, "devices": devices, "cells": cells_out,
            "kept": [[c["family"], c["length"]] for c in cells_out if c["kept"]]}


def calibrated_grid(model: str, path: str | Path = CALIBRATION) -> list[tuple[str, int]] | None:
    """The (family, length) cells kept for ``model`` in the calibration file, or None if it has none."""
    from kvpass.validation import refuse

    path = Path(path)
    if not path.exists():
        return None
    try:
        body = json.loads(path.read_text(encoding="utf-8"))
        data = body.get(model) if isinstance(body, dict) else None
        if body is not None and not isinstance(body, dict):
            raise ValueError(f"the top level is a {type(body).__name__}, not an object of models")
        if not data or not data.get("kept"):
            return None
        return [(f, int(length)) for f, length in data["kept"] if f in FAMILIES]
    except (ValueError, TypeError, AttributeError) as err:      # json.JSONDecodeError is a ValueError
        raise refuse("file.format", name="calibration file", got=str(path), reason=str(err)) from err


def write_calibration(model: str, summary: dict, path: str | Path = CALIBRATION, **meta) -> Path:
    """Record ``summary`` (``calibration``) for ``model`` in the calibration file (other models kept)."""
    path = Path(path)
    data = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    data[model] = {**meta, **summary}
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return path
