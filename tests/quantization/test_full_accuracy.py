"""``full`` over 8-bit entries stays close to the model-dtype cache; what kvpass reports as cache bytes is at most
0.55x of the unquantized cache's at the same budget.

Tolerance: the largest relative L2 distance of a step's logits (prompt + 20 decode steps, 2 rows) from the
model-dtype cache's, on a tiny random Llama (head dim 64, as SmolLM2's): int8 5%, fp8_e4m3 15% (e4m3 keeps 3
mantissa bits: each feature within 6.25%). Measured at this commit: fp32 2.3% / 8.4%, bf16 3.1% / 10.6%. A scale
25% off on the prompt's entries (a broken scale) moves them by more than twice the fp8 tolerance
(``test_a_broken_scale_fails_the_tolerance``)."""

from __future__ import annotations

import functools

import pytest
import torch
import transformers

import kvpass
import kvpass.quantization.cache as qcache

TOLERANCE = {"int8": 0.05, "fp8_e4m3": 0.15}
STEPS = 20


@functools.cache
def _weights() -> dict:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                                      initializer_range=0.1)
    return {"config": config, "state": transformers.AutoModelForCausalLM.from_config(config).state_dict()}


def _model(dtype: torch.dtype) -> torch.nn.Module:
    w = _weights()
    model = transformers.AutoModelForCausalLM.from_config(w["config"])
    model.load_state_dict(w["state"])
    return model.eval().to(dtype)


@functools.cache
def _plain(dtype: torch.dtype, policy: str = "full", budget: float | int = 1.0):
    """The model-dtype cache's run (shared by the tests: the plain run is the costly part)."""
    return _logits(dtype, None, policy, budget)


def _logits(dtype: torch.dtype, kv_dtype: str | None, policy: str = "full", budget: float | int = 1.0):
    kv = kvpass.apply(_model(dtype), policy, budget, kv_dtype=kv_dtype)
    ids = torch.randint(1, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    feed = torch.randint(1, 128, (2, STEPS), generator=torch.Generator().manual_seed(2))
    session = kv.start(ids, max_new_tokens=STEPS)
    out = [session.logits] + [session.step(feed[:, i]) for i in range(STEPS)]
    return torch.stack(out).double(), session.report()


def _distance(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got - want).norm(dim=-1) / want.norm(dim=-1)).max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_dtype", sorted(TOLERANCE))
def test_full_over_8bit_entries_stays_close_to_the_model_dtype(kv_dtype: str, dtype: torch.dtype) -> None:
    want, _ = _plain(dtype)
    got, report = _logits(dtype, kv_dtype)
    assert report.kv_dtype == kv_dtype
    err = _distance(got, want)
    assert 0 < err < TOLERANCE[kv_dtype], err


def test_a_broken_scale_fails_the_tolerance(monkeypatch) -> None:
    """The tolerance can fail: the prompt's scales 25% too large (the codes as they are)."""
    encode = qcache.quantize_entries

    def broken(x, kv_dtype):
        codes, scale = encode(x, kv_dtype)
        return codes, scale * 1.25

    want, _ = _plain(torch.float32)
    monkeypatch.setattr(qcache, "quantize_entries", broken)
    got, _ = _logits(torch.float32, "fp8_e4m3")
    assert _distance(got, want) > 2 * TOLERANCE["fp8_e4m3"]


@pytest.mark.parametrize("policy, budget", [("full", 1.0), ("snapkv", 24), ("streamingllm", 24)])
@pytest.mark.parametrize("kv_dtype", sorted(TOLERANCE))
def test_cache_bytes_at_most_055_of_the_model_dtype_cache(policy: str, budget, kv_dtype: str) -> None:
    """bf16 model, head dim 64: every byte kvpass reports (codes, scales, log-weights, positions, the policy's
    metadata) against the bf16 cache's at the same budget."""
    _, plain = _plain(torch.bfloat16, policy, budget)
    _, quantized = _logits(torch.bfloat16, kv_dtype, policy, budget)
    assert quantized.budget_tokens == plain.budget_tokens
    assert quantized.full_cache_bytes == plain.full_cache_bytes           # the full cache in the model's dtype
    assert quantized.cache_bytes <= 0.55 * plain.cache_bytes, quantized.cache_bytes / plain.cache_bytes
