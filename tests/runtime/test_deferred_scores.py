"""Deferred scores (``FusedDecodeStatistics.deferred_scores``, kvpass/runtime/recent_queries.py): D2O with
``interval`` > 1 keeps each decode step's query and adds the rows at the next compression. Same tokens, logits and
accumulated scores as every step returning its row (the capability turned off): equal and padded rows, rows that wait longer than the
ring (a prompt under its budget), per-query-head caches; the graph keeps queries instead of returning scores,
and the exporters still get a graph that returns them."""

from __future__ import annotations

import pytest
import torch

import kvpass.runtime.session as session_module
from kvpass.export.onnx_export import per_step_graphs
from kvpass.policies.base import Stat
from kvpass.policies.d2o import D2O
from kvpass.runtime.recent_queries import RECENT_POSITION, add_recent_rows
from tests.conftest import padded_batch
from tests.policies.policy_helpers import apply_cached
from tests.runtime.test_rows_independent import _greedy

COL = Stat.COLUMN_SUM.value


def _pair(budget, monkeypatch, **options):
    deferred = apply_cached("llama", "d2o", budget, interval=3, **options)
    with monkeypatch.context() as m:                 # every step returns its row
        m.setattr(D2O, "deferred_scores", lambda self: 0)
        per_step = apply_cached("llama", "d2o", budget, interval=3, **options)
    return deferred, per_step


def _count_row_additions(monkeypatch) -> list[int]:
    calls: list[int] = []

    def counted(cache, site):
        calls.append(site.layer)
        return add_recent_rows(cache, site)

    monkeypatch.setattr(session_module, "add_recent_rows", counted)
    return calls


@pytest.mark.parametrize("lengths, budget, options", [([40, 40, 40], 0.4, {}), ([40, 23, 31], 0.4, {}),
                                                      ([40, 23, 31], 0.4, {"expand_kv_heads": True}),
                                                      ([30, 17], 28, {}),
                                                      ([40, 23, 31], 0.4, {"first_compression": "decode"})],
                         ids=["equal", "padded", "expanded", "under-budget", "prompt-at-first-step"])
def test_same_tokens_and_logits_as_per_step_scores(monkeypatch, lengths, budget, options):
    """``under-budget``: a budget of 28 tokens keeps the 17-token row's prompt whole, so it waits 14 steps (more
    than the ring's 3) before its first compression: its rows are added when the ring is full."""
    deferred, per_step = _pair(budget, monkeypatch, **options)
    sites = [s.layer for s in deferred.graphs.sites]
    assert deferred.graphs.deferred_scores == tuple(sites) and deferred.graphs.decode_scores == ()
    assert per_step.graphs.deferred_scores == () and per_step.graphs.decode_scores == tuple(sites)
    ids, mask = padded_batch(lengths, seed=3)
    added = _count_row_additions(monkeypatch)
    tokens, logits = _greedy(deferred, ids, mask)
    assert len(added) >= len(sites) * 3                        # 12 steps, a compression every 3
    want_tokens, want_logits = _greedy(per_step, ids, mask)
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lengths, budget", [([40, 40], 0.4), ([40, 23], 0.4), ([17, 12], 28)],
                         ids=["equal", "padded", "never-due"])
def test_same_accumulated_scores_as_per_step(monkeypatch, lengths, budget):
    """After any number of steps, the deferred ``col_sum`` plus the waiting queries' rows equals the per-step
    one (every compression in between chose the same entries). ``never-due``: prompts under a 28-token budget,
    no compression in 10 steps: the rows are added when the ring is full (every 3 steps)."""
    deferred, per_step = _pair(budget, monkeypatch)
    added = _count_row_additions(monkeypatch)
    ids, mask = padded_batch(lengths, seed=5)
    a = deferred.start(ids, mask, max_new_tokens=16)
    b = per_step.start(ids, mask, max_new_tokens=16)
    tokens = torch.randint(0, 100, (10, len(lengths)), generator=torch.Generator().manual_seed(0))
    for t in tokens:
        a.step(t)
        b.step(t)
    waiting = []
    for site, lay in zip(deferred.graphs.sites, a.layers, strict=True):
        waiting.append(int((lay.cache.state[RECENT_POSITION] >= 0).sum()))
        add_recent_rows(lay.cache, site)
    assert any(waiting)                                        # 10 steps, rows added every 3: one waits
    assert len(added) == 3 * len(a.layers)
    assert (a.compressions == 0) == (budget == 28)
    for lay_a, lay_b in zip(a.layers, b.layers, strict=True):
        assert torch.equal(lay_a.cache.position, lay_b.cache.position)
        torch.testing.assert_close(lay_a.cache.slot_meta[COL], lay_b.cache.slot_meta[COL], rtol=1e-5, atol=1e-5)


def test_the_decode_graph_keeps_queries_and_the_exporters_get_scores(monkeypatch):
    deferred, _ = _pair(0.4, monkeypatch)
    targets = [n.target for n in deferred.graphs.decode.graph.nodes if n.op == "call_function"]
    n_layers = len(deferred.graphs.sites)
    assert targets.count(torch.ops.kvpass.write_query.default) == n_layers
    attend = [n for n in deferred.graphs.decode.graph.nodes if n.target == torch.ops.kvpass.decode_attention.default]
    assert len(attend) == n_layers and not any(n.kwargs["want_scores"] for n in attend)
    graphs = per_step_graphs(deferred)
    assert graphs.deferred_scores == () and graphs.decode_scores == tuple(s.layer for s in graphs.sites)
    assert torch.ops.kvpass.write_query.default not in [n.target for n in graphs.decode.graph.nodes]


def test_interval_one_and_other_policies_do_not_defer():
    assert apply_cached("llama", "d2o", 0.4, interval=16).graphs.deferred_scores == (0, 1)
    assert apply_cached("llama", "d2o", 0.4).graphs.deferred_scores == ()          # the default, interval 1
    assert apply_cached("llama", "h2o", 0.4).graphs.deferred_scores == ()
