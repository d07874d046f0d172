"""Needle in a haystack on the Paul Graham essays.

A case is (context length, depth, seed, needles): a haystack of ``length`` tokens with the seeded
passphrase at ``depth`` (plus ``needles - 1`` decoys), the question after it, a greedy answer of up
to ``max_new_tokens`` tokens, scored by exact match (the passphrase string occurs in the output).

* ``query_aware``: the whole prompt (context + question) is prefilled and compressed, then decoded.
* ``query_agnostic``: the context alone is prefilled and compressed (``start(context_ids,
  max_new_tokens=len(question_ids) + new)``), the question is fed through decode steps
  (``session.feed``), then the answer is decoded, as kvpress's pipeline does. Both modes see the
  same tokens (``common.split_chat``), so ``full`` must give the same answers in both.
* ``transformers``: plain ``model.generate`` on the same tokens, the reference ``full`` must match.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

import torch
from torch import nn
from tqdm import tqdm

from kvpass.eval.common import KVCache, Loaded, Timer, eos_pad, split_chat
from kvpass.eval.store import Store, case_key
from kvpass.prompts import needle_prompt

MODES = ("query_aware", "query_agnostic")
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


@torch.no_grad()
def answer_kvpass(kv_model, case: NeedleCase, mode: str, max_new_tokens: int) -> tuple[list[int], object]:
    """Greedy answer tokens and the session report for one case in one mode."""
    eos_ids, pad = eos_pad(kv_model.model)
    ctx = torch.tensor([case.context_ids])
    q = torch.tensor([case.question_ids])
    if mode == "query_aware":
        session = kv_model.start(torch.cat([ctx, q], dim=1), max_new_tokens=max_new_tokens)
    elif mode == "query_agnostic":
        session = kv_model.start(ctx, max_new_tokens=q.shape[1] + max_new_tokens)
        session.feed(q)
    else:
        raise ValueError(f"unknown mode {mode!r}; modes: {', '.join(MODES)}")
    tokens, _ = session.sample(max_new_tokens, eos_ids, pad, do_sample=False)
    return _strip(tokens[0].tolist(), eos_ids, pad), session.report()


@torch.no_grad()
def answer_transformers(model: nn.Module, case: NeedleCase, max_new_tokens: int) -> list[int]:
    """Plain transformers greedy generation on the same tokens."""
    eos_ids, pad = eos_pad(model)
    ids = torch.tensor([case.context_ids + case.question_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=pad)
    return _strip(out[0, ids.shape[1]:].tolist(), eos_ids, pad)


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
    cell per mode (first, after the transformers reference)."""
    from kvpass.policies import POLICIES

    out = [Cell(REFERENCE, None, "reference")] if reference else []
    for policy in policies:
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; available: {', '.join(sorted(POLICIES))}")
    for budget in [None, *budgets]:          # budget-major: a partial run covers every policy at the first budget
        for policy in policies:
            if (budget is None) != POLICIES[policy].compresses:
                out.extend(Cell(policy, budget, mode) for mode in modes)
    return out


def key_of(model: str, cell: Cell, spec: NeedleSpec, max_new_tokens: int) -> str:
    return case_key(kind="niah", model=model, policy=cell.policy, budget=cell.budget, mode=cell.mode,
                    max_new_tokens=max_new_tokens, **asdict(spec))


def run(loaded: Loaded, specs: Sequence[NeedleSpec], cell_list: Sequence[Cell], store: Store,
        max_new_tokens: int = 32, shard: tuple[int, int] = (0, 1), desc: str = "niah") -> Store:
    """Score every (spec, cell) not yet in ``store``; specs outermost, so an interrupted run leaves
    every cell with about the same number of cases. ``shard`` (i, n): only specs with index % n == i."""
    mine = [s for k, s in enumerate(specs) if k % shard[1] == shard[0]]
    todo = [(s, c) for s in spread(mine) for c in cell_list if key_of(loaded.name, c, s, max_new_tokens) not in store]
    models = KVCache(loaded.model)
    built: dict[NeedleSpec, NeedleCase] = {}
    bar = tqdm(todo, desc=desc, unit="case", position=shard[0], dynamic_ncols=True)
    for spec, cell in bar:
        bar.set_postfix_str(f"{cell.policy}@{cell.budget} {cell.mode} L={spec.length} d={spec.depth:.2f}")
        if spec not in built:
            built.clear()
            built[spec] = build_case(loaded.tokenizer, spec)
        case = built[spec]
        with Timer() as t:
            if cell.policy == REFERENCE:
                tokens, report = answer_transformers(loaded.model, case, max_new_tokens), None
            else:
                tokens, report = answer_kvpass(models.get(cell.policy, cell.budget), case, cell.mode, max_new_tokens)
        output = loaded.tokenizer.decode(tokens, skip_special_tokens=True).strip()
        store.add({
            "key": key_of(loaded.name, cell, spec, max_new_tokens), "kind": "niah", "model": loaded.name,
            "policy": cell.policy, "budget": cell.budget, "mode": cell.mode, "max_new_tokens": max_new_tokens,
            **asdict(spec), "prompt_tokens": case.prompt_tokens, "context_tokens": len(case.context_ids),
            "answer": case.answer, "output": output, "output_ids": tokens,
            "correct": is_correct(case.answer, output),
            "cache_bytes": report.cache_bytes if report else None,
            "full_cache_bytes": report.full_cache_bytes if report else None,
            "seconds": round(t.seconds, 3),
        })
    return store
