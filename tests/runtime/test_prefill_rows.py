"""Prefilling a batch a group of rows at a time (``KVPassModel.prefill_rows``): the same tokens as
one whole-batch prefill for policies whose budgets do not depend on other rows, and the first
group's per-layer budgets for those whose do."""

from __future__ import annotations

import pytest
import torch

import kvpass
from kvpass.bench import TINY_LLAMA, build_model


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
