"""One prefill shared by many policies (``kvpass.eval.shared``) and batched needle cases give the
answers of the per-policy, per-case path (``KVPassModel.start`` on one prompt)."""

from __future__ import annotations

import pytest
import torch

import kvpass
from kvpass.eval import niah
from kvpass.eval.shared import Models, StatUnion, stat_groups
from kvpass.eval.store import Store
from kvpass.policies import Stat, get_policy

POLICIES = ["full", "streamingllm", "h2o", "snapkv", "pyramidkv", "d2o", "cam", "kvmerger"]
NEW = 6


@pytest.fixture(scope="module")
def models(loaded) -> Models:
    return Models(loaded.model)


def _prompts(rows: int, tokens: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 128, (rows, tokens), generator=g)


def _greedy(session, new: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B, new], logits [B, new, V]) of greedy decoding without end tokens."""
    tokens, logits = session.sample(new, torch.tensor([], dtype=torch.long), 0, output_logits=True, do_sample=False)
    return tokens, torch.stack(logits, dim=1)


def test_one_union_serves_the_default_policies(models):
    groups = stat_groups([get_policy(p) for p in POLICIES])
    assert len(groups) == 1
    assert groups[0][0].stats == {Stat.COLUMN_SUM, Stat.WINDOW_SCORES, Stat.HEAD_VARIANCE}


def test_conflicting_options_get_their_own_prefill():
    groups = stat_groups([get_policy("snapkv"), get_policy("snapkv", window=8), get_policy("h2o"),
                          get_policy("pyramidkv")])
    assert [[p.name for p in members] for _, members in groups] == [["snapkv", "h2o", "pyramidkv"], ["snapkv"]]


@pytest.mark.parametrize("budget", [0.4])
def test_shared_prefill_equals_each_policys_own(models, loaded, budget):
    ids = _prompts(1, 80)
    union = stat_groups([get_policy(p) for p in POLICIES])[0][0]
    shared = models.shared_prefill(union, ids, max_new_tokens=NEW)
    for name in POLICIES:
        own = models.get(name, budget)           # its own prefill graph (start), not the shared one
        want_tokens, want_logits = _greedy(own.start(ids, max_new_tokens=NEW), NEW)
        got_tokens, got_logits = _greedy(models.get(name, budget).start_from(shared), NEW)
        assert torch.equal(got_tokens, want_tokens), name
        assert torch.equal(got_logits, want_logits), name
    # the prefill is left as it was: a second start from it gives the same again
    again, _ = _greedy(models.get("d2o", budget).start_from(shared), NEW)
    assert torch.equal(again, _greedy(models.get("d2o", budget).start_from(shared), NEW)[0])


def test_column_sums_and_variance_are_fused(models):
    from kvpass.policies import Stat as S

    union = stat_groups([get_policy("d2o"), get_policy("snapkv")])[0][0]
    graph = models.prefill_graphs(union).prefill.graph
    targets = [n.target for n in graph.nodes if n.op == "call_function"]
    ops = torch.ops.kvpass
    assert ops.attention_column_sums_and_head_variance.default in targets
    assert ops.attention_column_sums.default not in targets and ops.attention_head_variance.default not in targets
    assert {s for _, s in models.prefill_graphs(union).prefill_stats} == {S.COLUMN_SUM, S.HEAD_VARIANCE,
                                                                         S.WINDOW_SCORES}


def test_empty_union_is_the_plain_prefill(models, loaded):
    ids = _prompts(1, 40, seed=1)
    plain = models.shared_prefill(StatUnion(), ids, max_new_tokens=NEW)
    assert plain.stats == {}
    want = kvpass.apply(loaded.model, "full").start(ids, max_new_tokens=NEW).logits
    assert torch.equal(plain.logits, want)


def test_batched_rows_answer_as_alone(models):
    """Every registered policy gives each batch row what it gives the row alone, so the harness batches
    every policy (tests/runtime/test_rows_independent.py covers left padding)."""
    from kvpass.policies import POLICIES as REGISTERED

    ids = _prompts(2, 240, seed=2)          # 0.4 of it is above every minimum budget (chelsea: 81)
    coupled = set()
    for name in sorted(REGISTERED):
        kv = models.get(name, 0.4)
        batch_tokens, batch_logits = _greedy(kv.start(ids, max_new_tokens=NEW), NEW)
        for row in range(ids.shape[0]):
            alone_tokens, alone_logits = _greedy(kv.start(ids[row:row + 1], max_new_tokens=NEW), NEW)
            if not torch.equal(batch_tokens[row:row + 1], alone_tokens) or not torch.allclose(
                    batch_logits[row:row + 1], alone_logits, rtol=1e-4, atol=1e-4):
                coupled.add(name)
    assert coupled == set()
    # a subset of the rows of a prefill is the prefill of those rows
    kv = models.get("snapkv", 0.4)
    batch_tokens, _ = _greedy(kv.start(ids, max_new_tokens=NEW), NEW)
    union = stat_groups([kv.policy])[0][0]
    sub_tokens, _ = _greedy(kv.start_from(models.shared_prefill(union, ids, max_new_tokens=NEW).rows([1, 0])), NEW)
    assert torch.equal(sub_tokens, batch_tokens[[1, 0]])


def test_batched_needle_run_equals_per_case(loaded, models, tmp_path):
    """The harness (shared prefill, batches by token count) stores what one case at a time gives."""
    specs = niah.grid([60], [0.0, 1.0])
    cells = niah.cells(["full", "snapkv", "d2o"], [0.5], list(niah.MODES))
    store = niah.run(loaded, specs, cells, Store(tmp_path / "b.json"), max_new_tokens=NEW, batch=8)
    cases = {c["key"]: c for c in store.cases.values()}
    assert len(cases) == 2 * len(cells)
    for spec in specs:
        case = niah.build_case(loaded.tokenizer, spec)
        for cell in cells:
            got = cases[niah.key_of(loaded.name, cell, spec, NEW)]
            if cell.policy == niah.REFERENCE:
                assert got["output_ids"] == niah.answer_transformers(loaded.model, case, NEW)
                continue
            tokens, report = niah.answer_kvpass(models.get(cell.policy, cell.budget), case, cell.mode, NEW)
            assert got["output_ids"] == tokens, (cell, spec)
            assert got["full_cache_bytes"] == report.full_cache_bytes
            if cell.policy == "d2o":   # rows of their own layer budgets share buffers sized to the largest: a case's
                assert got["cache_bytes"] >= report.cache_bytes      # share of them is at least what it holds alone
            else:
                assert got["cache_bytes"] == report.cache_bytes


def test_batches_group_equal_token_counts(tokenizer):
    specs = niah.grid([50, 80], [0.0, 0.5, 1.0])
    cases = [niah.build_case(tokenizer, s) for s in specs]
    got = niah.batches(cases, 2)
    assert sorted(repr(c.spec) for b in got for c in b) == sorted(map(repr, specs))
    for b in got:
        assert 1 <= len(b) <= 2
        assert len({(len(c.context_ids), len(c.question_ids)) for c in b}) == 1
