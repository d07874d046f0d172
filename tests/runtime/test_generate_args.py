"""generate() takes the arguments transformers users pass: with ``full`` every one gives transformers' tokens
(and scores), and with a compressing policy they run over the compressed cache."""

from __future__ import annotations

import pytest
import torch
import transformers

import kvpass
from kvpass.errors import KVPassError
from tests.conftest import padded_batch, tiny_model


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def full(llama):
    return kvpass.apply(llama, policy="full")


def _both(model, kv, ids, mask=None, **kwargs):
    want = model.generate(ids, attention_mask=mask, do_sample=kwargs.pop("do_sample", False), **kwargs)
    got = kv.generate(ids, attention_mask=mask, **kwargs)
    return got, want


CASES = {
    "repetition_penalty": dict(max_new_tokens=24, repetition_penalty=1.6),
    "no_repeat_ngram_size": dict(max_new_tokens=24, no_repeat_ngram_size=2),
    "min_new_tokens": dict(max_new_tokens=12, min_new_tokens=10, eos_token_id=[5, 9, 17]),
    "min_length": dict(max_new_tokens=12, min_length=30, eos_token_id=[5, 9, 17]),
    "max_length": dict(max_length=33),
    "generation_config": dict(generation_config=transformers.GenerationConfig(max_new_tokens=15,
                                                                              repetition_penalty=1.3,
                                                                              no_repeat_ngram_size=3)),
    "eos list": dict(max_new_tokens=20, eos_token_id=[3, 4, 5, 6, 7], pad_token_id=1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_full_matches_transformers_with_each_argument(llama, full, case):
    ids, mask = padded_batch([21, 14])
    got, want = _both(llama, full, ids, mask, **CASES[case])
    assert torch.equal(got, want), case


def test_the_arguments_change_the_tokens(llama, full):
    """The cases above are not vacuous: each argument changes what plain greedy decoding gives."""
    ids, mask = padded_batch([21, 14])
    plain = full.generate(ids, attention_mask=mask, max_new_tokens=24)
    for kwargs in (dict(repetition_penalty=1.6), dict(no_repeat_ngram_size=2)):
        assert not torch.equal(full.generate(ids, attention_mask=mask, max_new_tokens=24, **kwargs), plain), kwargs
    eos = int(plain[0, 21])                               # the first token generated: as eos, it stops at once
    stopped = full.generate(ids[:1], max_new_tokens=8, eos_token_id=eos)
    assert stopped.shape[1] == 22
    assert full.generate(ids[:1], max_new_tokens=8, eos_token_id=eos, min_new_tokens=5).shape[1] >= 26


def test_output_scores_and_logits_match_transformers(llama, full):
    ids, mask = padded_batch([21, 14])
    kwargs = dict(max_new_tokens=10, repetition_penalty=1.4, no_repeat_ngram_size=2, output_scores=True,
                  output_logits=True, return_dict_in_generate=True)
    got, want = _both(llama, full, ids, mask, **kwargs)
    assert isinstance(got, transformers.generation.utils.GenerateDecoderOnlyOutput)
    assert torch.equal(got.sequences, want.sequences)
    assert len(got.scores) == len(want.scores) == 10
    for a, b in zip(got.scores, want.scores, strict=True):
        assert torch.equal(torch.isinf(a), torch.isinf(b))      # the banned n-grams
        torch.testing.assert_close(a.masked_fill(torch.isinf(a), 0), b.masked_fill(torch.isinf(b), 0), atol=1e-4,
                                   rtol=1e-4)
    for a, b in zip(got.logits, want.logits, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert got.report is full.last_report and got.report.policy == "full"


class StopAt:
    """A user's stopping criterion: a row is done once it has generated ``token``."""

    def __init__(self, token: int) -> None:
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def test_stopping_criteria_and_logits_processor_match_transformers(llama, full):
    ids, mask = padded_batch([21, 14])
    plain = full.generate(ids, attention_mask=mask, max_new_tokens=16)
    stop = int(plain[1, 21 + 3])
    criteria = transformers.StoppingCriteriaList([StopAt(stop)])
    processor = transformers.LogitsProcessorList([lp for lp in [lambda i, s: s.index_fill(1, torch.tensor([7]),
                                                                                       float("-inf"))]])
    for kwargs in (dict(stopping_criteria=criteria), dict(logits_processor=processor),
                   dict(stopping_criteria=criteria, eos_token_id=stop, pad_token_id=0)):
        got, want = _both(llama, full, ids, mask, max_new_tokens=16, **kwargs)
        assert torch.equal(got, want), kwargs
    got = full.generate(ids, attention_mask=mask, max_new_tokens=16, stopping_criteria=criteria)
    assert got.shape[1] < plain.shape[1]                  # the criterion stopped it


def test_sampling_matches_transformers_under_one_seed(llama, full):
    ids, mask = padded_batch([21, 14])
    kwargs = dict(max_new_tokens=12, do_sample=True, temperature=0.8, top_k=20, top_p=0.9, num_return_sequences=3)
    torch.manual_seed(11)
    want = llama.generate(ids, attention_mask=mask, **kwargs)
    torch.manual_seed(11)
    got = full.generate(ids, attention_mask=mask, **kwargs)
    assert got.shape == (6, 33) and torch.equal(got, want)
    assert len({tuple(r) for r in got[:3].tolist()}) > 1     # the three samples of a prompt differ


def test_arguments_run_over_a_compressed_cache(llama):
    """A compressing policy takes the same arguments; the penalty still changes its tokens."""
    kv = kvpass.apply(llama, policy="d2o", budget=10)
    ids, mask = padded_batch([21, 14])
    config = transformers.GenerationConfig(max_length=40, repetition_penalty=1.5)
    out = kv.generate(ids, attention_mask=mask, generation_config=config, stopping_criteria=[StopAt(-1)],
                      output_scores=True, return_dict_in_generate=True)
    assert out.sequences.shape == (2, 40) and len(out.scores) == 19
    assert kv.last_report.compressions > 0
    plain = kv.generate(ids, attention_mask=mask, max_length=40)
    assert not torch.equal(out.sequences, plain)


def test_precedence_argument_over_config_over_model(llama):
    kv = kvpass.apply(llama, policy="full")
    ids, _ = padded_batch([10])
    config = transformers.GenerationConfig(max_new_tokens=7)
    assert kv.generate(ids, generation_config=config).shape[1] == 17
    assert kv.generate(ids, generation_config=config, max_new_tokens=3).shape[1] == 13
    assert kv.generate(ids, max_length=14).shape[1] == 14
    assert kv.generate(ids).shape[1] == 30                        # kvpass's default: 20 new tokens


def test_bad_values_are_refused_before_any_work(llama, monkeypatch):
    kv = kvpass.apply(llama, policy="d2o", budget=10)
    ids, _ = padded_batch([10])

    def no_prefill(*args, **kwargs):
        raise AssertionError("prefill ran before the arguments were checked")

    monkeypatch.setattr(kv, "start", no_prefill)
    for kwargs in (dict(eos_token_id="x"), dict(eos_token_id=1.5), dict(pad_token_id="x"),
                   dict(repetition_penalty=-1), dict(max_length=5), dict(num_return_sequences=2),
                   dict(generation_config=transformers.GenerationConfig(num_beams=2)), dict(stopping_criteria=[3])):
        with pytest.raises(KVPassError) as info:
            kv.generate(ids, **kwargs)
        assert info.value.argument, kwargs


def test_empty_prompt_is_refused_as_empty(llama):
    kv = kvpass.apply(llama, policy="full")
    with pytest.raises(KVPassError, match="no tokens") as info:
        kv.generate([])
    assert info.value.argument == "input_ids"


def test_tp_without_torchrun_is_a_kvpass_error(llama):
    with pytest.raises(KVPassError, match="torchrun") as info:
        kvpass.apply(llama, policy="full", tp=3)
    assert info.value.argument == "tp"
