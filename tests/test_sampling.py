"""kvpass.sampling's processors and warpers against transformers' own classes (the reference) on random inputs."""

from __future__ import annotations

import pytest
import torch
import transformers.generation.logits_process as lp

from kvpass.sampling import logits_processors, no_eos_before, no_repeat_ngram, repetition_penalty, warp

V = 50


def _case(seed: int, batch: int = 3, t: int = 17) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 8, (batch, t), generator=g)          # a small alphabet: n-grams repeat
    return ids, torch.randn(batch, V, generator=g) * 3


@pytest.mark.parametrize("penalty", [0.7, 1.3, 2.0])
def test_repetition_penalty_matches_transformers(penalty):
    for seed in range(4):
        ids, scores = _case(seed)
        want = lp.RepetitionPenaltyLogitsProcessor(penalty)(ids, scores.clone())
        torch.testing.assert_close(repetition_penalty(penalty)(ids, scores), want)
        pads = torch.tensor([0, 5, 16])                        # left padding: not counted (transformers' mask)
        want = lp.RepetitionPenaltyLogitsProcessor(penalty, prompt_ignore_length=pads)(ids, scores.clone())
        torch.testing.assert_close(repetition_penalty(penalty, pads)(ids, scores), want)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_no_repeat_ngram_matches_transformers(n):
    for seed in range(4):
        ids, scores = _case(seed, t=3 + seed * 4)
        want = lp.NoRepeatNGramLogitsProcessor(n)(ids, scores.clone())
        got = no_repeat_ngram(n)(ids, scores)
        assert torch.equal(torch.isinf(got), torch.isinf(want))
        torch.testing.assert_close(got, want)
    ids, scores = _case(9)
    assert torch.isinf(no_repeat_ngram(2)(ids, scores)).any()            # something is banned: not vacuous


def test_minimum_lengths_match_transformers():
    ids, scores = _case(1, t=10)
    eos = [3, 7]
    for length in (5, 10, 11, 14):
        want = lp.MinLengthLogitsProcessor(length, torch.tensor(eos))(ids, scores.clone())
        torch.testing.assert_close(no_eos_before(length, eos)(ids, scores), want)
        want = lp.MinNewTokensLengthLogitsProcessor(6, length, torch.tensor(eos))(ids, scores.clone())
        torch.testing.assert_close(no_eos_before(length, eos, skip=6)(ids, scores), want)
    assert torch.isinf(no_eos_before(11, eos)(ids, scores)[:, eos]).all()


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.7, None, None), (1.0, 5, None), (1.0, None, 0.8),
                                                      (1.3, 10, 0.9), (0.5, 50, 1.0)])
def test_warpers_match_transformers(temperature, top_k, top_p):
    _, scores = _case(2)
    want = scores.clone()
    if temperature != 1.0:
        want = lp.TemperatureLogitsWarper(temperature)(None, want)
    if top_k:
        want = lp.TopKLogitsWarper(top_k)(None, want)
    if top_p is not None and top_p < 1.0:
        want = lp.TopPLogitsWarper(top_p)(None, want)
    torch.testing.assert_close(warp(scores, temperature, top_k, top_p), want)


def test_processor_order_is_transformers():
    """Repetition penalty, no-repeat n-gram, min length, min new tokens, then the caller's; the minimum lengths
    only with an eos id."""
    ids, scores = _case(3)
    extra = lambda i, s: s * 2                                                  # noqa: E731
    procs = logits_processors(1.2, 2, 20, 4, prompt_length=15, eos_ids=[1], extra=[extra])
    want = scores.clone()
    for p in (lp.RepetitionPenaltyLogitsProcessor(1.2), lp.NoRepeatNGramLogitsProcessor(2),
              lp.MinLengthLogitsProcessor(20, torch.tensor([1])),
              lp.MinNewTokensLengthLogitsProcessor(15, 4, torch.tensor([1])), extra):
        want = p(ids, want)
    got = scores
    for p in procs:
        got = p(ids, got)
    torch.testing.assert_close(got, want)
    assert len(logits_processors(1.0, 0, 20, 4, eos_ids=[])) == 0
