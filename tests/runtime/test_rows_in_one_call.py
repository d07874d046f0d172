"""Decode-time compression of a layer whose batch rows have budgets of their own (D2O's per-row layer
budgets) in one call of the policy (``RaggedRows.rows_in_one_call`` / ``compress_rows_into``), in the
layer's own buffers, instead of one budget at a time in copies (``kvpass.runtime.layers.compress_rows_into``: eager,
a host sync a layer, outside the CUDA-graphed step). Same tokens as the per-row path and as each row alone."""

from __future__ import annotations

import pytest
import torch

import kvpass.runtime.session as session_steps  # where a decode step calls the per-row path
from kvpass.policies.d2o import D2O
from tests.conftest import padded_batch
from tests.policies.policy_helpers import apply_cached
from tests.runtime.test_rows_independent import NEW, _greedy


def _per_row_path(monkeypatch, kv):
    """The policy's rows-in-one-call capability turned off (every due row compressed alone); returns the method."""
    one_call = type(kv.policy).rows_in_one_call
    monkeypatch.setattr(type(kv.policy), "rows_in_one_call", lambda self, budgets, capacities: False)
    return one_call


def _count(monkeypatch, cls, name: str) -> list[int]:
    """Calls of ``cls.name`` (a method, or a module's function) from now on (it still runs)."""
    calls: list[int] = []
    original = getattr(cls, name)

    def counted(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, name, counted)
    return calls


@pytest.mark.parametrize("lengths, options", [([40, 40, 40], {}), ([40, 23, 31], {}),
                                              ([40, 23, 31], {"merge_into_sinks": False, "merge_bias": True,
                                                              "d2o_variant": "code"})],
                         ids=["equal", "padded", "padded-options"])
def test_d2o_rows_of_their_own_budgets_compress_in_one_call(monkeypatch, lengths, options):
    """Rows whose layer budgets differ (their own attention variance, their own prompt length): no decode
    step goes through the per-row path, every compression is one ``compress_rows_into`` per layer; the
    tokens and logits equal the per-row path's (the capability turned off) and each row's alone."""
    kv = apply_cached("llama", "d2o", 0.4, interval=1, **options)      # one compression per step
    ids, mask = padded_batch(lengths, seed=2)
    session = kv.start(ids, mask, max_new_tokens=NEW)
    compressed = [lay for lay in session.layers if lay.compressible]
    assert all(not lay.one_budget for lay in compressed)       # the case: the rows' budgets differ in every layer
    per_row = _count(monkeypatch, session_steps, "compress_rows_into")
    in_one = _count(monkeypatch, D2O, "compress_rows_into")
    tokens, logits = _greedy(kv, ids, mask)
    assert per_row == [] and len(in_one) >= len(compressed) * (NEW - 2)
    in_one.clear()
    one_call = _per_row_path(monkeypatch, kv)
    old_tokens, old_logits = _greedy(kv, ids, mask)
    assert in_one == [] and len(per_row) >= len(compressed) * (NEW - 2)
    assert torch.equal(tokens, old_tokens)
    torch.testing.assert_close(logits, old_logits, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(type(kv.policy), "rows_in_one_call", one_call)
    for row, n in enumerate(lengths):
        alone_tokens, alone_logits = _greedy(kv, ids[row:row + 1, ids.shape[1] - n:], None)
        assert torch.equal(tokens[row:row + 1], alone_tokens), row
        torch.testing.assert_close(logits[row:row + 1], alone_logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("lengths", [[40, 23, 31], [40, 9, 31]], ids=["padded", "short-row"])
def test_interval_above_one_compresses_in_one_call(monkeypatch, lengths):
    """D2O with interval > 1 evicts several entries at a time, each row when it holds its budget + interval
    entries (``kvpass.kernels.d2o_evict_many``; a row not due is left as it is): one call per layer, no per-row
    path, the same tokens as the per-row path and as each row alone."""
    kv = apply_cached("llama", "d2o", 0.4, interval=3)
    ids, mask = padded_batch(lengths, seed=2)
    per_row = _count(monkeypatch, session_steps, "compress_rows_into")
    in_one = _count(monkeypatch, D2O, "compress_rows_into")
    tokens, _ = _greedy(kv, ids, mask)
    assert per_row == [] and in_one
    one_call = _per_row_path(monkeypatch, kv)
    assert torch.equal(tokens, _greedy(kv, ids, mask)[0]) and per_row
    monkeypatch.setattr(type(kv.policy), "rows_in_one_call", one_call)
    for row, n in enumerate(lengths):
        assert torch.equal(tokens[row:row + 1], _greedy(kv, ids[row:row + 1, ids.shape[1] - n:], None)[0]), row


def test_rows_in_one_call_accepts_one_in_one_out_and_full_intervals():
    """The policy's host-side decision: every row's capacity at most its budget + 1, or (interval > 1) its
    budget + interval or at most its budget; one process."""
    d2o = D2O(interval=1)
    assert d2o.rows_in_one_call([20, 18, 23], [21, 19, 24])
    assert d2o.rows_in_one_call([20, 18], [21, 10])              # a short row: never due before its end
    assert not d2o.rows_in_one_call([20, 18], [21, 20])          # two entries at a time: interval 2
    assert D2O(interval=2).rows_in_one_call([20, 18], [22, 20])
    assert not D2O(interval=2).rows_in_one_call([20, 18], [21, 20])   # a row due below budget + interval
    assert D2O(interval=2, merge_protect=0.5, merge_weighting="score").rows_in_one_call([20, 18], [22, 20])
    keep = torch.tensor([20, 7, 4, 1])
    sinks, important, recent = d2o.split(keep)
    for b, k in enumerate(keep.tolist()):
        assert (int(sinks[b]), int(important[b]), int(recent[b])) == d2o.split(k)


@pytest.mark.parametrize("policy", ["streamingllm", "snapkv", "h2o"])
@pytest.mark.parametrize("lengths", [[40, 23, 31], [40, 9, 31]], ids=["padded", "short-row"])
def test_in_place_policies_compress_rows_of_their_own_budgets_in_one_call(monkeypatch, policy, lengths):
    """StreamingLLM, SnapKV and H2O with rows of different budgets (prompts of different lengths): each row evicts when it
    holds its own budget + interval entries, in one call per layer (``fill_evicted_rows``), not through the per-row
    path; the same tokens and logits as the per-row path and the same tokens as each row alone."""
    from kvpass.policies import get_policy

    kv = apply_cached("llama", policy, 0.4, interval=3)
    ids, mask = padded_batch(lengths, seed=2)
    per_row = _count(monkeypatch, session_steps, "compress_rows_into")
    in_one = _count(monkeypatch, type(get_policy(policy)), "compress_rows_into")
    tokens, logits = _greedy(kv, ids, mask)
    assert per_row == [] and in_one
    in_one.clear()
    one_call = _per_row_path(monkeypatch, kv)
    old_tokens, old_logits = _greedy(kv, ids, mask)
    assert in_one == [] and per_row
    assert torch.equal(tokens, old_tokens)
    torch.testing.assert_close(logits, old_logits, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(type(kv.policy), "rows_in_one_call", one_call)
    for row, n in enumerate(lengths):
        assert torch.equal(tokens[row:row + 1], _greedy(kv, ids[row:row + 1, ids.shape[1] - n:], None)[0]), row


def test_streamingllm_rows_in_one_call_only_where_budgets_differ():
    from kvpass.policies.streamingllm import StreamingLLM

    p = StreamingLLM(interval=4)
    assert p.rows_in_one_call([20, 18], [24, 22]) and p.rows_in_one_call([20, 18], [24, 10])
    assert not p.rows_in_one_call([20, 20], [24, 24])            # one budget: the layer's compress_into
    assert not p.rows_in_one_call([20, 18], [24, 21])            # a row due below budget + interval
