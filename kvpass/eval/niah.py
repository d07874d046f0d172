"""Needle in a haystack on the Paul Graham essays.

A case is (context length, depth, seed, needles): a haystack of ``length`` tokens with the seeded
passphrase at ``depth`` (plus ``needles - 1`` decoys), the question after it, a greedy answer of up
to ``max_new_tokens`` tokens, scored by exact match (the passphrase string occurs in the output).

* ``query_aware``: the whole prompt (context + question) is prefilled and compressed, then decoded.
* ``query_agnostic``: the context alone is prefilled and compressed to its budget of the context's own
  tokens (a ``KVPassModel.compress_context`` cache), then the question is prefilled over it and appended
  and the answer decoded, the question and answer never compressed (kvpass/runtime/context_cache.py), as
  kvpress's pipeline and KVzip do. Both modes see the same tokens (``common.split_chat``), so ``full`` must
  give the same answers in both.
* ``query_agnostic_bounded``: the context compressed alone with the budget of context + question + answer
  tokens, the question fed through decode steps that keep compressing (``session.feed``): the budget holds at
  every step, and the question's tokens push out context (the leaderboard's query-agnostic mode before
  2026-12-07).
* ``transformers``: plain ``model.generate`` on the same tokens, the reference ``full`` must match.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass

import torch
from torch import nn
from tqdm import tqdm

from kvpass.eval.common import Loaded, Timer, eos_pad, split_chat
from kvpass.eval.store import Store, case_key
from kvpass.prompts import needle_prompt
from kvpass.runtime.context_cache import ContextCache, ask

MODES = ("query_aware", "query_agnostic", "query_agnostic_bounded")
CONTEXT_ONLY = ("query_agnostic", "query_agnostic_bounded")     # modes that prefill the context alone
REFERENCE = "transformers"


@dataclass(frozen=True)
class NeedleSpec:
    """One haystack: ``length`` context tokens, the asked needle at ``depth`` in [0, 1]."""

    length: int
    depth: float
    seed: int = 0
    needles: int = 1


@dataclass(frozen=True)
class NeedleCase:
    """Token ids of one spec: the context (chat prefix included) and the question (chat suffix
    and generation prompt included); ``answer`` is the passphrase asked for."""

    spec: NeedleSpec
    context_ids: list[int]
    question_ids: list[int]
    answer: str
    context: str

    @property
    def prompt_tokens(self) -> int:
        return len(self.context_ids) + len(self.question_ids)


def grid(lengths: Sequence[int], depths: Sequence[float], seeds: Sequence[int] = (0,),
         needles: int = 1) -> list[NeedleSpec]:
    """Every (length, depth, seed); each spec's seed is offset by its grid cell so passphrases differ."""
    out = []
    for i, length in enumerate(lengths):
        for j, depth in enumerate(depths):
            for seed in seeds:
                out.append(NeedleSpec(int(length), float(depth), seed=seed * 1000 + i * 100 + j, needles=needles))
    return out


def spread(specs: Sequence[NeedleSpec]) -> list[NeedleSpec]:
    """The specs in a fixed pseudo-random order, so an interrupted run has covered the whole grid
    thinly rather than its first lengths fully."""
    out = list(specs)
    random.Random(0).shuffle(out)
    return out


def build_case(tokenizer, spec: NeedleSpec) -> NeedleCase:
    prompt = needle_prompt(tokenizer, spec.length, spec.depth, seed=spec.seed, passphrases=spec.needles)
    ctx, q = split_chat(tokenizer, prompt.context, prompt.question)
    return NeedleCase(spec, ctx, q, prompt.answer, prompt.context)


def is_correct(answer: str, output: str) -> bool:
    """Exact-match scoring: the passphrase occurs verbatim in the output."""
    return answer in output


@dataclass(frozen=True)
class CaseBytes:
    """Cache bytes of one batch row at the end of its answer (``GenerationReport`` fields, per row)."""

    cache_bytes: int
    full_cache_bytes: int


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; modes: {', '.join(MODES)}")


def _same_shape(cases: Sequence[NeedleCase]) -> None:
    if len({(len(c.context_ids), len(c.question_ids)) for c in cases}) != 1:
        raise ValueError("a batch of needle cases needs equal context and question token counts (no padding)")


def prompt_ids(cases: Sequence[NeedleCase], mode: str) -> torch.Tensor:
    """The tokens prefilled in ``mode``: [B, context + question] (query-aware) or [B, context]."""
    _check_mode(mode)
    _same_shape(cases)
    if mode == "query_aware":
        return torch.tensor([c.context_ids + c.question_ids for c in cases])
    return torch.tensor([c.context_ids for c in cases])


def prefill_new_tokens(case: NeedleCase, mode: str, max_new_tokens: int) -> int:
    """The tokens that follow the prefill of ``mode`` and set its budget: none for ``query_agnostic`` (the
    context's budget is its own), the question and answer for the others."""
    if mode == "query_agnostic":
        return 0
    return max_new_tokens + (len(case.question_ids) if mode == "query_agnostic_bounded" else 0)


@torch.no_grad()
def answer_kvpass(kv_model, case: NeedleCase | Sequence[NeedleCase], mode: str, max_new_tokens: int,
                  prefill=None):
    """Greedy answers in one mode.

    ``case`` a NeedleCase: -> (answer tokens, the session's GenerationReport), prefilling it alone.
    ``case`` a list of B NeedleCases with equal token counts: one batched session -> a list of B
    (answer tokens, CaseBytes); ``prefill`` (a ``runtime.Prefill`` of ``prompt_ids(case, mode)``
    with ``prefill_new_tokens``, e.g. a shared one) replaces the session's own prefill. Each row gets
    the answer it would get alone: no padding, rows never interact, finished rows are ignored."""
    _check_mode(mode)
    single = isinstance(case, NeedleCase)
    cases = [case] if single else list(case)
    eos_ids, pad = eos_pad(kv_model.model)
    eos_ids = eos_ids.to(kv_model.device)
    if prefill is None:                   # the model's own start: prefill_chunk (chunked prefill) applies
        session = kv_model.start(prompt_ids(cases, mode).to(kv_model.device),
                                 max_new_tokens=prefill_new_tokens(cases[0], mode, max_new_tokens))
    else:
        session = kv_model.start_from(prefill)
    fed = 0
    if mode in CONTEXT_ONLY:
        q = torch.tensor([c.question_ids for c in cases], device=kv_model.device)
        fed = q.shape[1]
        if mode == "query_agnostic":      # the compressed context, asked: the question appended, never compressed
            context = ContextCache(session, [len(c.context_ids) for c in cases], id(kv_model))
            session = ask(kv_model, context, q, None, max_new_tokens)
        else:
            session.feed(q)
    tokens, _ = session.sample(max_new_tokens, eos_ids, pad, do_sample=False)
    report = session.report()
    answers = [_strip(row.tolist(), eos_ids, pad) for row in tokens]
    if single:
        return answers[0], report
    # per row: cache tensors are [B, ...] of equal shapes; full-cache bytes count the row's own tokens
    b = len(cases)
    per_token = report.full_cache_bytes // (b * (report.prompt_tokens + report.new_tokens))
    # the tokens the cache stood for before the answer: prompt_tokens counts the question already where it was
    # prefilled with the context (query-aware) or appended to it (query-agnostic); fed through steps it does not
    before = report.prompt_tokens + (fed if mode == "query_agnostic_bounded" else 0)
    out = []
    for ans in answers:
        produced = min(len(ans) + 1, max_new_tokens)          # the answer and its end token, as alone
        out.append((ans, CaseBytes(report.cache_bytes // b, per_token * (before + produced))))
    return out


@torch.no_grad()
def answer_transformers(model: nn.Module, case: NeedleCase | Sequence[NeedleCase], max_new_tokens: int):
    """Plain transformers greedy generation on the same tokens: one NeedleCase -> answer tokens; a
    list of cases with equal token counts -> a list of answers (one batched ``generate``, no padding)."""
    eos_ids, pad = eos_pad(model)
    single = isinstance(case, NeedleCase)
    cases = [case] if single else list(case)
    ids = prompt_ids(cases, "query_aware").to(next(model.parameters()).device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=pad)
    answers = [_strip(row[ids.shape[1]:].tolist(), eos_ids, pad) for row in out]
    return answers[0] if single else answers


def _strip(tokens: list[int], eos_ids: torch.Tensor, pad: int) -> list[int]:
    """Cut at the first end-of-sequence token."""
    stops = set(eos_ids.tolist())
    for i, t in enumerate(tokens):
        if t in stops:
            return tokens[:i]
    return tokens


@dataclass(frozen=True)
class Cell:
    """One configuration to score: policy x budget x mode (the reference has mode 'reference')."""

    policy: str
    budget: float | int | None
    mode: str


def cells(policies: Iterable[str], budgets: Sequence[float | int], modes: Sequence[str],
          reference: bool = True) -> list[Cell]:
    """Policies x budgets x modes, budget-major; ``full`` ignores the budget so it gets one budget-less
    cell per mode (first, after the transformers reference); recall policies (Quest, ClusterKV) keep
    every token but attend a budget of them, so they get a cell per budget (``common.uses_budget``)."""
    from kvpass.eval.common import uses_budget

    out = [Cell(REFERENCE, None, "reference")] if reference else []
    from kvpass.policies import policy_from_spec

    for policy in policies:              # a name or a spec, name[key=value,...]: refused here if bad
        policy_from_spec(policy)
    for budget in [None, *budgets]:          # budget-major: a partial run covers every policy at the first budget
        for policy in policies:
            if (budget is None) != uses_budget(policy):
                out.extend(Cell(policy, budget, mode) for mode in modes)
    return out


def key_of(model: str, cell: Cell, spec: NeedleSpec, max_new_tokens: int) -> str:
    return case_key(kind="niah", model=model, policy=cell.policy, budget=cell.budget, mode=cell.mode,
                    max_new_tokens=max_new_tokens, **asdict(spec))


def batches(cases: Sequence[NeedleCase], size: int) -> list[list[NeedleCase]]:
    """The cases grouped by (context, question) token counts, in their order of first appearance,
    each group cut into batches of at most ``size``: the rows of a batch need no padding."""
    groups: dict[tuple[int, int], list[NeedleCase]] = {}
    for c in cases:
        groups.setdefault((len(c.context_ids), len(c.question_ids)), []).append(c)
    return [g[i:i + size] for g in groups.values() for i in range(0, len(g), max(size, 1))]


def run(loaded: Loaded, specs: Sequence[NeedleSpec], cell_list: Sequence[Cell], store: Store,
        max_new_tokens: int = 32, shard: tuple[int, int] = (0, 1), desc: str = "niah", batch: int = 8) -> Store:
    """Score every (spec, cell) not yet in ``store``. ``shard`` (i, n): only specs with index % n == i.

    Specs (in ``spread`` order) are batched by equal token counts (``batches``, at most ``batch`` rows),
    largest batches first, and scored by ``run_batches``. A case's ``seconds`` is its share of the batch's
    wall time: the cell's time over its rows plus the prefill's time over the (row, cell) pairs it served."""
    mine = [s for k, s in enumerate(specs) if k % shard[1] == shard[0]]
    keyed = {(s, c): key_of(loaded.name, c, s, max_new_tokens) for s in spread(mine) for c in cell_list}
    todo = {sc for sc, key in keyed.items() if key not in store}
    bar = tqdm(total=len(todo), desc=desc, unit="case", position=shard[0], dynamic_ncols=True)
    try:
        if not todo:
            return store
        needed = [s for s in spread(mine) if any((s, c) in todo for c in cell_list)]
        built = [build_case(loaded.tokenizer, s) for s in needed]
        # the largest batches first (decode steps cost about the same for 1 or 8 rows on a CPU: the weights
        # are read once per step), the transformers reference last (only the agreement check needs it)
        groups = sorted(batches(built, batch), key=len, reverse=True)
        run_batches(loaded, groups, cell_list, todo, store, bar, ident=lambda case: case.spec,
                    new_tokens=lambda group: max_new_tokens,
                    record=lambda cell, case, tokens, size, seconds: _record(loaded, cell, case, tokens, size,
                                                                             max_new_tokens, seconds))
    finally:
        bar.close()
    return store


def run_batches(loaded: Loaded, groups: Sequence[Sequence], cell_list: Sequence[Cell], todo: set, store: Store,
                bar, ident: Callable, new_tokens: Callable, record: Callable,
                deadline: float | None = None, prefill_chunk: int | None = None, kv_dtype: str | None = None) -> bool:
    """The evaluation loop of ``niah.run`` and ``suite.run``: score every (``ident(case)``, cell) pair of
    ``todo`` (removed as it is stored: ``store.add_many`` of ``record(cell, case, tokens, size, seconds)``),
    batch by batch (``groups``: cases of equal token counts) and mode, the transformers reference of every
    batch last. ``new_tokens(group)``: the tokens each case of a batch generates. Returns False where
    ``deadline`` (a ``time.monotonic()`` value) passed first (the store then holds every finished cell).

    Per batch and mode, one prefill serves every (policy, budget) cell (``kvpass.eval.shared``: the union of
    the policies' statistics; one prefill per group of policies whose statistic options conflict); each
    cell starts from it, restricted to the rows it still lacks, and decodes them in one session (every
    row as if alone: tests/runtime/test_rows_independent.py). The reference is one batched ``generate``.
    A case's ``seconds``: its cell's time over its rows plus the prefill's time over the (row, cell)
    pairs it served. ``prefill_chunk``: each kvpass cell instead prefills its own rows, in chunks of that
    many tokens (kvpass/runtime/chunked_prefill.py). ``kv_dtype``: every kvpass cell's cache entries
    (``kvpass.apply``'s; None: the model's dtype); the prefill is the model's dtype either way."""
    def late() -> bool:
        return deadline is not None and time.monotonic() > deadline

    models = None
    pending = [(g, m) for g in groups for m in MODES] + [(g, "reference") for g in groups]
    while pending:
        group, mode = pending.pop(0)
        mode_cells = [c for c in cell_list if c.mode == mode and any((ident(g), c) in todo for g in group)]
        if not mode_cells:
            continue
        if late():
            return False
        try:
            models, finished = _run_group(loaded, group, mode, mode_cells, models, todo, store, bar, ident, new_tokens,
                                record, late, prefill_chunk, kv_dtype)
        except torch.cuda.OutOfMemoryError:
            # GPU memory shared with other processes ran out: retry what is left of this batch in two halves
            # (the store keeps every finished cell; todo lists what is left), a single row re-raises
            if len(group) == 1:
                raise
            torch.cuda.empty_cache()
            half = len(group) // 2
            bar.write(f"out of GPU memory at {len(group)} rows (L={group[0].prompt_tokens}, {mode}): "
                      f"retrying as {half} + {len(group) - half}")
            pending[:0] = [(group[:half], mode), (group[half:], mode)]
            continue
        if not finished:                              # late() inside the group
            return False
    return True


def _run_group(loaded: Loaded, group: Sequence, mode: str, mode_cells: Sequence[Cell], models, todo: set,
               store: Store, bar, ident: Callable, new_tokens: Callable, record: Callable, late: Callable,
               prefill_chunk: int | None, kv_dtype: str | None = None) -> tuple[object, bool]:
    """``run_batches``' work for one batch and mode: returns (the ``Models``, made on first use, or None while
    only the reference has run; False where ``late()`` stopped it midway)."""
    from kvpass.eval.shared import Models, stat_groups

    new = new_tokens(group)
    if mode == "reference":
        rows = [g for g in group if (ident(g), mode_cells[0]) in todo]
        bar.set_postfix_str(f"transformers x{len(rows)} L={rows[0].prompt_tokens}")
        with Timer() as t:
            answers = answer_transformers(loaded.model, rows, new)
        store.add_many([record(mode_cells[0], case, tokens, None, t.seconds / len(rows))
                        for case, tokens in zip(rows, answers, strict=True)])
        todo.difference_update((ident(case), mode_cells[0]) for case in rows)
        bar.update(len(rows))
        return models, True
    models = models or Models(loaded.model, loaded.tokenizer, kv_dtype)
    chosen = {c: models.get(c.policy, c.budget).policy for c in mode_cells}   # a cell's policy: a name or a spec
    if prefill_chunk is not None:                     # each cell prefills (in chunks) on its own
        for cell in mode_cells:
            part = [g for g in group if (ident(g), cell) in todo]
            if not part:
                continue
            if late():
                return models, False
            kv = models.get(cell.policy, cell.budget)
            kv.prefill_chunk = prefill_chunk
            bar.set_postfix_str(f"{cell.policy}@{cell.budget} {mode} chunk {prefill_chunk} x{len(part)}")
            with Timer() as t:
                got = answer_kvpass(kv, part, mode, new)
            store.add_many([record(cell, case, tokens, size, t.seconds / len(part))
                            for case, (tokens, size) in zip(part, got, strict=True)])
            todo.difference_update((ident(case), cell) for case in part)
            bar.update(len(part))
        return models, True
    for union, members in stat_groups(list(dict.fromkeys(chosen.values()))):
        here = [c for c in mode_cells if chosen[c] in members]
        rows = [g for g in group if any((ident(g), c) in todo for c in here)]
        if not rows:
            continue
        served = sum((ident(g), c) in todo for g in rows for c in here)
        bar.set_postfix_str(f"prefill {mode} x{len(rows)} L={rows[0].prompt_tokens}")
        shared = models.shared_prefill(union, prompt_ids(rows, mode),
                                       max_new_tokens=prefill_new_tokens(rows[0], mode, new))
        share = shared.seconds / max(served, 1)
        for cell in here:
            mine = [j for j, g in enumerate(rows) if (ident(g), cell) in todo]
            if not mine:
                continue
            if late():
                return models, False
            part = [rows[j] for j in mine]
            bar.set_postfix_str(f"{cell.policy}@{cell.budget} {mode} x{len(part)} L={part[0].prompt_tokens}")
            with Timer() as t:
                got = answer_kvpass(models.get(cell.policy, cell.budget), part, mode, new,
                                    prefill=shared.rows(mine))
            store.add_many([record(cell, case, tokens, size, t.seconds / len(part) + share)
                            for case, (tokens, size) in zip(part, got, strict=True)])
            todo.difference_update((ident(case), cell) for case in part)
            bar.update(len(part))
        del shared
    return models, True


def _record(loaded: Loaded, cell: Cell, case: NeedleCase, tokens: list[int], size: CaseBytes | None,
            max_new_tokens: int, seconds: float) -> dict:
    """The stored form of one scored case."""
    output = loaded.tokenizer.decode(tokens, skip_special_tokens=True).strip()
    return {
        "key": key_of(loaded.name, cell, case.spec, max_new_tokens), "kind": "niah", "model": loaded.name,
        "policy": cell.policy, "budget": cell.budget, "mode": cell.mode, "max_new_tokens": max_new_tokens,
        **asdict(case.spec), "prompt_tokens": case.prompt_tokens, "context_tokens": len(case.context_ids),
        "answer": case.answer, "output": output, "output_ids": tokens,
        "correct": is_correct(case.answer, output),
        "cache_bytes": size.cache_bytes if size else None,
        "full_cache_bytes": size.full_cache_bytes if size else None,
        "seconds": round(seconds, 3), "device": _device_name(loaded.device),
    }


def _device_name(device: torch.device) -> str:
    """'cpu' or the GPU's name (cases from different devices can differ in the last bits)."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
