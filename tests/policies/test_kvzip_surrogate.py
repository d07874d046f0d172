"""KVzip's score surrogate (kvpass/policies/kvzip_surrogate.py): the features ignore RoPE, the fit recovers a planted
linear model, files round-trip, kvzip[scores=predicted] scores a prefill with it, and mismatches are refused."""

from __future__ import annotations

import math

import pytest
import torch

import kvpass
from kvpass.errors import KVPassError
from kvpass.policies import Stat
from kvpass.policies.kvzip_surrogate import KVzipSurrogate, features, model_shape
from tests.conftest import tiny_model


def _rotate(k: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:
    """RoPE's rotation of the pairs (i, i + D/2) by ``angle`` [D/2]."""
    a, b = k.chunk(2, dim=-1)
    cos, sin = torch.cos(angle), torch.sin(angle)
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


def test_features_do_not_depend_on_the_rotary_position():
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 5, 8, generator=g), torch.randn(2, 5, 8, generator=g)
    rotated = _rotate(k, torch.rand(4, generator=g) * 2 * math.pi)
    assert not torch.allclose(rotated, k)
    torch.testing.assert_close(features(rotated, v), features(k, v), rtol=1e-5, atol=1e-6)
    assert features(k, v).shape == (2, 5, 8 + 4 + 1)


def test_the_fit_recovers_a_planted_linear_model_and_files_round_trip(tmp_path):
    g = torch.Generator().manual_seed(1)
    truth = {0: torch.randn(2, 13, generator=g) * 0.3, 3: torch.randn(2, 13, generator=g) * 0.3}
    samples = {}
    for layer, w in truth.items():
        items = []
        for _ in range(3):
            k, v = torch.randn(2, 200, 8, generator=g), torch.randn(2, 200, 8, generator=g)
            items.append((k, v, torch.einsum("htf,hf->ht", features(k, v), w).exp() - 1e-6))
        samples[layer] = items
    fitted = KVzipSurrogate.fit(samples, {"model_type": "x"}, ridge=1e-6)
    for layer, w in truth.items():
        torch.testing.assert_close(fitted.weights[layer], w, rtol=1e-3, atol=1e-3)
    path = fitted.save(tmp_path / "s.json")
    loaded = KVzipSurrogate.load(path)
    k, v = torch.randn(1, 2, 9, 8, generator=g), torch.randn(1, 2, 9, 8, generator=g)
    torch.testing.assert_close(loaded.predict(3, k, v), fitted.predict(3, k, v), rtol=1e-5, atol=1e-7)
    assert bool((loaded.predict(0, k, v) > 0).all())


def _surrogate_for(model, tmp_path) -> str:
    """A surrogate of random weights fitted to nothing, with the model's shape."""
    cfg = model.config
    d = cfg.hidden_size // cfg.num_attention_heads
    g = torch.Generator().manual_seed(2)
    weights = {la: torch.randn(cfg.num_key_value_heads, 3 * d // 2 + 1, generator=g) * 0.1
               for la in range(cfg.num_hidden_layers)}
    return str(KVzipSurrogate(weights, model_shape(model)).save(tmp_path / "tiny.json"))


def test_predicted_scores_are_the_surrogate_of_the_prefills_keys_and_values(tmp_path):
    model = tiny_model("llama")
    path = _surrogate_for(model, tmp_path)
    kv = kvpass.apply(model, policy=f"kvzip[scores=predicted,surrogate={path}]", budget=0.3)
    ids = torch.randint(1, 128, (2, 60), generator=torch.Generator().manual_seed(3))
    pre = kv.prefill(ids)
    surrogate = KVzipSurrogate.load(path)
    for layer in range(model.config.num_hidden_layers):
        want = surrogate.predict(layer, pre.kv[2 * layer], pre.kv[2 * layer + 1])
        torch.testing.assert_close(pre.stats[layer][Stat.RECONSTRUCTION.value], want)
    out = kv.generate(ids, max_new_tokens=5, do_sample=False)
    assert out.shape == (2, 65) and max(kv.last_report.entries.values()) < 60
    reconstructed = kvpass.apply(model, policy="kvzip", budget=0.3).generate(ids, max_new_tokens=5, do_sample=False)
    assert out.shape == reconstructed.shape


def test_refusals(tmp_path):
    model = tiny_model("llama")
    with pytest.raises(KVPassError, match="no KVzip surrogate 'nonesuch'"):
        kvpass.apply(model, policy="kvzip[scores=predicted,surrogate=nonesuch]")
    with pytest.raises(KVPassError, match="does not fit this model"):
        kvpass.apply(model, policy="kvzip[scores=predicted]")             # no shipped surrogate of its shape
    other = _surrogate_for(tiny_model("qwen2"), tmp_path)
    with pytest.raises(KVPassError, match="does not fit this model"):
        kvpass.apply(model, policy=f"kvzip[scores=predicted,surrogate={other}]")
