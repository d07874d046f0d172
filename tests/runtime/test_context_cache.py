"""Compress once, ask many (kvpass/runtime/context_cache.py): a context cache answers questions as the whole prompt
would where nothing is evicted, every question of a batch as if alone, the cache unchanged by asking, the
question and answer appended and never compressed, and clear refusals."""

from __future__ import annotations

import pytest
import torch

import kvpass
from kvpass.errors import KVPassError
from tests.conftest import tiny_model


def _ids(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 128, (1, n), generator=g)


def _questions(lengths: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Questions of these lengths, left-padded with 0: (ids, mask) [B, max]."""
    t = max(lengths)
    ids = torch.zeros(len(lengths), t, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, t - n:] = _ids(n, seed + row)[0]
        mask[row, t - n:] = 1
    return ids, mask


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma3", "qwen2"])
def test_full_context_answers_as_the_whole_prompt(arch):
    """With nothing evicted, a question asked of the context cache gets the tokens of plain transformers on context +
    question, for a batch of questions of different lengths (left-padded), each row as alone. The sliding-window
    layers (mistral, gemma3: window 8) append into their rings."""
    model = tiny_model(arch)
    kv = kvpass.apply(model, policy="full")
    context = _ids(21, seed=1)
    cache = kv.compress_context(context)
    q, mask = _questions([5, 3, 7], seed=10)
    got = kv.generate(q, attention_mask=mask, context=cache, max_new_tokens=6, do_sample=False, eos_token_id=None)
    for row in range(3):
        n = int(mask[row].sum())
        whole = torch.cat([context, q[row:row + 1, -n:]], dim=1)
        want = model.generate(whole, attention_mask=torch.ones_like(whole), max_new_tokens=6, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        assert torch.equal(got[row, q.shape[1]:], want[0, whole.shape[1]:]), (arch, row)


@pytest.mark.parametrize("policy", ["streamingllm", "snapkv", "h2o", "d2o"])
def test_questions_are_answered_as_alone_and_the_cache_is_left_as_it_was(policy):
    model = tiny_model("llama")
    kv = kvpass.apply(model, policy=policy, budget=0.3)
    cache = kv.compress_context(_ids(60, seed=2))
    before = [t.clone() for lay in cache.session.layers for t in lay.cache.tensors()]
    q, mask = _questions([4, 9], seed=20)
    both = kv.generate(q, attention_mask=mask, context=cache, max_new_tokens=8, do_sample=False, eos_token_id=None)
    report = kv.last_report
    for row in range(2):
        n = int(mask[row].sum())
        alone = kv.generate(q[row:row + 1, -n:], context=cache, max_new_tokens=8, do_sample=False, eos_token_id=None)
        assert torch.equal(both[row, q.shape[1]:], alone[0, n:]), row
    after = [t for lay in cache.session.layers for t in lay.cache.tensors()]
    for a, b in zip(before, after, strict=True):                  # NaN: D2O's not yet known key norms
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    # the budget rule: the context's budget (0.3 of its 60 tokens), then the question and answer appended whole
    budgets = cache.session.report().layer_budgets
    assert report.compressions == 0 and report.layer_budgets == {}           # nothing compressed while answering
    assert max(report.entries.values()) <= max(budgets.values()) + getattr(kv.policy, "interval", 1) + q.shape[1] + 8
    if policy != "d2o":                                                     # d2o: budgets of its own per layer
        assert set(budgets.values()) == {kvpass.budget_tokens(0.3, 60)}


def test_a_compressed_context_differs_from_the_full_one():
    """The check above can fail: a small budget does change the answers (the tokens of the full cache differ)."""
    model = tiny_model("llama")
    context, (q, _) = _ids(80, seed=3), _questions([6], seed=30)
    full = kvpass.apply(model, policy="full")
    small = kvpass.apply(model, policy="streamingllm", budget=0.1)
    a = full.generate(q, context=full.compress_context(context), max_new_tokens=12, do_sample=False, eos_token_id=None)
    b = small.generate(q, context=small.compress_context(context), max_new_tokens=12, do_sample=False,
                       eos_token_id=None)
    assert not torch.equal(a, b)


def test_one_context_row_per_question_row():
    model = tiny_model("llama")
    kv = kvpass.apply(model, policy="snapkv", budget=0.5)
    contexts = torch.cat([_ids(30, seed=4), _ids(30, seed=5)])
    cache = kv.compress_context(contexts)
    q, mask = _questions([5, 5], seed=40)
    both = kv.generate(q, context=cache, max_new_tokens=5, do_sample=False, eos_token_id=None)
    for row in range(2):
        alone = kv.generate(q[row:row + 1], context=kv.compress_context(contexts[row:row + 1]), max_new_tokens=5,
                            do_sample=False, eos_token_id=None)
        assert torch.equal(both[row], alone[0]), row
    with pytest.raises(KVPassError, match="3 question rows for a context cache of 2 rows"):
        kv.generate(torch.cat([q, q[:1]]), context=cache, max_new_tokens=2)


def test_refusals():
    model = tiny_model("llama")
    kv = kvpass.apply(model, policy="snapkv", budget=0.5)
    other = kvpass.apply(model, policy="snapkv", budget=0.25)
    cache = other.compress_context(_ids(30, seed=6))
    with pytest.raises(KVPassError, match="another KVPassModel"):
        kv.generate(_ids(3, seed=7), context=cache, max_new_tokens=2)
    with pytest.raises(KVPassError, match="compress_context"):
        kv.generate(_ids(3, seed=7), context="not a cache", max_new_tokens=2)
