"""Perplexity and attention fidelity: the full policy reproduces transformers, compression shows up."""

from __future__ import annotations

import math

import pytest
import torch

from kvpass.eval import lm
from kvpass.eval.store import Store

SEG = lm.Segment(offset=0, prefix=48, steps=12)


@pytest.fixture(scope="module")
def lm_store(loaded, tmp_path_factory):
    store = Store(tmp_path_factory.mktemp("lm") / "lm.json")
    lm.run(loaded, [SEG], [("full", 0.2), ("streamingllm", 12)], store, probes=3)
    return store


def _case(store, policy):
    (case,) = store.select(policy=policy)
    return case


def test_probe_positions_cover_the_continuation():
    assert lm.probe_positions(SEG, 3) == [51, 55, 59]
    assert lm.probe_positions(SEG, 0) == []


def test_full_perplexity_equals_transformers(lm_store):
    full, ref = _case(lm_store, "full"), _case(lm_store, "transformers")
    assert len(full["nll"]) == len(ref["nll"]) == SEG.steps
    assert math.isclose(full["ppl"], ref["ppl"], rel_tol=1e-4)


def test_full_cache_has_no_attention_error(lm_store):
    full = _case(lm_store, "full")
    assert full["layers"] == [0, 1]
    assert max(full["rel_err"]) < 1e-4
    assert min(full["recall"]) == pytest.approx(1.0)
    assert min(full["mass"]) == pytest.approx(1.0, abs=1e-5)


def test_compression_is_measured(lm_store):
    small = _case(lm_store, "streamingllm")
    assert max(small["rel_err"]) > 1e-3
    assert max(small["recall"]) < 1.0 and min(small["mass"]) < 1.0
    assert small["cache_bytes"] < small["full_cache_bytes"]


def test_fidelity_of_a_hand_built_cache():
    """One KV head, two query heads: keeping every token gives zero error and full recall; keeping
    only the token the queries ignore gives recall 0 and a large error."""
    torch.manual_seed(0)
    k = torch.randn(1, 4, 8)
    v = torch.randn(1, 4, 8)
    q = torch.stack([k[0, 1] * 8, k[0, 1] * 8])          # both heads attend token 1
    pos = torch.arange(4)[None]
    every = lm.attention_fidelity(q, k, v, 1.0, 3, k, v, torch.zeros(1, 4), pos)
    assert every["rel_err"] < 1e-6 and every["recall"] == 1.0
    lw = torch.tensor([[0.0, float("-inf"), float("-inf"), float("-inf")]])
    only0 = lm.attention_fidelity(q, k, v, 1.0, 3, k, v, lw, pos)
    assert only0["recall"] == 0.0 and only0["rel_err"] > 0.1 and only0["mass"] < 0.1
