"""Prefilling a batch a group of rows at a time (``KVPassModel.prefill_rows``): the same tokens as
one whole-batch prefill for policies whose budgets do not depend on other rows, and the first
group's per-layer budgets for those whose do."""

from __future__ import annotations

import weakref

import pytest
import torch

import kvpass
from benchmarks.bench.models import TINY_LLAMA, build_model
from kvpass.cache import LayerCache, concat_rows, empty_rows, put_rows
from tests.policies.policy_helpers import random_cache


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model(TINY_LLAMA, torch.device("cpu"), torch.float32)


def _ids_and_mask():
    ids = torch.randint(1, TINY_LLAMA["vocab_size"], (3, 48), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0                                                      # a left-padded row
    return ids, mask


@pytest.mark.parametrize("policy", ["full", "streamingllm", "h2o", "snapkv", "cam", "quest"])
def test_grouped_prefill_gives_the_whole_batch_tokens(model, policy):
    ids, mask = _ids_and_mask()
    kv = kvpass.apply(model, policy=policy, budget=24)
    want = kv.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    want_bytes = kv.last_report.cache_bytes
    for rows in (1, 2):
        kv.prefill_rows = rows
        got = kv.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
        assert torch.equal(got, want), rows
        assert kv.last_report.cache_bytes == want_bytes


def test_grouped_prefill_takes_the_first_groups_layer_budgets(model):
    ids, mask = _ids_and_mask()
    kv = kvpass.apply(model, policy="d2o", budget=24)
    kv.generate(ids[:1], max_new_tokens=4, do_sample=False)
    first_alone = kv.last_report.layer_budgets
    kv.prefill_rows = 1
    out = kv.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    assert out.shape == (3, 68)
    assert kv.last_report.layer_budgets == first_alone
    assert sum(kv.last_report.layer_budgets.values()) == 24 * len(first_alone)


def _cache_with_state(lengths: list[list[int]], c: int, seed: int) -> LayerCache:
    cache = random_cache(lengths, c, seed=seed, dtype=torch.float32, extra_meta=("col_sum",))
    cache.state["tau"] = torch.rand(len(lengths), generator=torch.Generator().manual_seed(seed))
    return cache


def test_rows_put_into_empty_rows_equal_the_stacked_rows():
    parts = [_cache_with_state([[10, 9], [7, 3]], 10, 1), _cache_with_state([[6, 2]], 6, 2)]   # the second padded to 10 slots
    want = concat_rows(parts)
    got = empty_rows(parts[0], 3)
    put_rows(got, parts[0], 0)
    put_rows(got, parts[1], 2)
    for name in ("k", "v", "log_weight", "length", "position"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert torch.equal(got.slot_meta["col_sum"], want.slot_meta["col_sum"])
    assert torch.equal(got.state["tau"], want.state["tau"])
    with pytest.raises(ValueError, match="cannot put a cache of 12 slots into rows of 10"):
        put_rows(got, _cache_with_state([[12, 12]], 12, 3), 0)


@pytest.mark.parametrize("policy", ["full", "d2o"])
def test_each_groups_session_is_gone_before_the_next_group_prefills(model, policy):
    """The batch's caches are filled group by group: a group's session (its caches) must not outlive the
    prefill of the next, else prefilling a row at a time would hold twice the batch's cache."""
    ids, mask = _ids_and_mask()
    kv = kvpass.apply(model, policy=policy, budget=24)
    kv.prefill_rows = 1
    made: list[weakref.ref] = []
    start_from, prefill = kv.start_from, kv.prefill

    def recording_start_from(*args, **kwargs):
        session = start_from(*args, **kwargs)
        made.append(weakref.ref(session))
        return session

    def checking_prefill(*args, **kwargs):
        alive = [i for i, ref in enumerate(made) if ref() is not None]
        assert not alive, f"sessions of groups {alive} alive while the next group prefills"
        return prefill(*args, **kwargs)

    kv.start_from, kv.prefill = recording_start_from, checking_prefill
    got = kv.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert len(made) == 3 and got.shape == (3, 56)
