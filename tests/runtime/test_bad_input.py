"""Bad input gets a clear error and changes nothing."""

from __future__ import annotations

import pytest
import torch
from transformers import PretrainedConfig

import kvpass
from kvpass.errors import UnsupportedModel
from tests.conftest import padded_batch, tiny_model


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_unknown_policy_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown policy 'nope'; available: .*full.*streamingllm"):
        kvpass.apply(tiny_model("llama"), policy="nope")


def test_unknown_policy_parameter_names_the_parameters():
    with pytest.raises(ValueError, match=r"no parameter\(s\) sink.*sinks"):
        kvpass.apply(tiny_model("llama"), policy="streamingllm", sink=4)


@pytest.mark.parametrize("budget", [0.0, -0.5, 1.5, 0, -3])
def test_budget_out_of_range(budget):
    with pytest.raises(ValueError, match="budget"):
        kvpass.apply(tiny_model("llama"), policy="streamingllm", budget=budget)


@pytest.mark.parametrize("budget", ["0.2", None, True])
def test_budget_of_the_wrong_type(budget):
    with pytest.raises(TypeError, match="budget"):
        kvpass.apply(tiny_model("llama"), policy="streamingllm", budget=budget)


def test_budget_smaller_than_sinks_plus_window():
    with pytest.raises(ValueError, match="smaller than streamingllm's minimum of 5"):
        kvpass.apply(tiny_model("llama"), policy="streamingllm", budget=3, sinks=4)
    kv = kvpass.apply(tiny_model("llama"), policy="streamingllm", budget=0.05, sinks=4)
    ids, _ = padded_batch([40])
    with pytest.raises(ValueError, match=r"budget of 2 tokens .* smaller than streamingllm's minimum"):
        kv.generate(ids, max_new_tokens=8)


def test_prompt_longer_than_the_context():
    kv = kvpass.apply(tiny_model("llama"), policy="full")            # context: 256 positions
    too_long = torch.randint(1, 128, (1, 257))
    with pytest.raises(ValueError, match="longer than the model's context of 256"):
        kv.generate(too_long, max_new_tokens=1)
    with pytest.raises(ValueError, match="exceeds the model's context"):
        kv.generate(too_long[:, :250], max_new_tokens=10)


def test_right_padding_is_refused():
    kv = kvpass.apply(tiny_model("llama"), policy="full")
    ids, mask = padded_batch([10, 6])
    with pytest.raises(ValueError, match="left padding"):
        kv.generate(ids, attention_mask=mask.flip(-1), max_new_tokens=2)


def test_unsupported_generate_argument():
    kv = kvpass.apply(tiny_model("llama"), policy="full")
    with pytest.raises(TypeError, match="num_beams"):
        kv.generate(torch.tensor([[1, 2, 3]]), num_beams=4)


class _NoAttentionLM(torch.nn.Module):
    """A 'causal LM' that mixes tokens with a cumulative mean: no attention anywhere."""

    def __init__(self) -> None:
        super().__init__()
        self.config = PretrainedConfig(num_hidden_layers=1, max_position_embeddings=64)
        self.config.model_type = "toy-rnn"
        self.embed = torch.nn.Embedding(32, 16)
        self.head = torch.nn.Linear(16, 32)

    def forward(self, input_ids, position_ids=None, use_cache=False):
        h = self.embed(input_ids)
        h = h.cumsum(1) / torch.arange(1, h.shape[1] + 1)[None, :, None]
        return type("Out", (), {"logits": self.head(torch.softmax(h, -1))})()


def test_model_without_attention_names_the_model_and_what_was_sought():
    with pytest.raises(UnsupportedModel, match=r"toy-rnn: no attention found.*scaled_dot_product_attention"):
        kvpass.apply(_NoAttentionLM(), policy="full")


def test_errors_change_nothing():
    model = tiny_model("qwen2")
    before, impl = _weights(model), model.config._attn_implementation
    for bad in (dict(policy="nope"), dict(policy="streamingllm", budget=2.0)):
        with pytest.raises(ValueError):
            kvpass.apply(model, **bad)
    kv = kvpass.apply(model, policy="full")
    with pytest.raises(ValueError):
        kv.generate(torch.randint(1, 128, (1, 300)), max_new_tokens=1)
    after = _weights(model)
    assert model.config._attn_implementation == impl
    assert all(torch.equal(before[k], after[k]) for k in before)
