"""Matching: one site per layer with the right heads, windows, scale and softcap; the model is left
untouched and shares its weights with the rewritten graphs."""

from __future__ import annotations

import pytest
import torch

import kvpass
from kvpass.errors import UnsupportedModel
from kvpass.rewrites import capture_causal_lm, find_attention_sites, match_attention
from tests.conftest import tiny_model

# arch -> (form, KV heads, windows per layer, softcap)
EXPECTED = {
    "llama": ("sdpa", 2, [None, None], None),
    "mistral": ("sdpa", 2, [8, 8], None),
    "qwen3": ("sdpa", 2, [None, None], None),
    "gemma3": ("sdpa", 1, [8, None], None),
    "gpt2": ("sdpa", 4, [None, None], None),
    "gemma2": ("eager", 2, [8, None], 50.0),
}


@pytest.mark.parametrize("arch", list(EXPECTED))
def test_sites(arch):
    model = tiny_model(arch)
    sites = match_attention(capture_causal_lm(model), model.config)
    form, n_kv, windows, softcap = EXPECTED[arch]
    assert [s.layer for s in sites] == [0, 1]
    assert {s.form for s in sites} == {form}
    assert [s.n_kv_heads for s in sites] == [n_kv, n_kv]
    assert [s.window for s in sites] == windows
    assert {s.softcap for s in sites} == {softcap}
    for s in sites:                       # k, v walked back through repeat_kv to [B, Hkv, T, D]
        assert s.k.meta["val"].shape[1] == n_kv and s.v.meta["val"].shape[1] == n_kv
        assert s.q.meta["val"].shape[1] == s.n_heads == 4


def test_scale_is_read_from_the_graph():
    model = tiny_model("gemma3")          # query_pre_attn_scalar differs from head_dim ** -0.5 in general
    sites = match_attention(capture_causal_lm(model), model.config)
    assert sites[0].scale == pytest.approx(model.config.query_pre_attn_scalar ** -0.5)


def test_eager_attention_is_matched_too():
    model = tiny_model("llama")
    model.set_attn_implementation("eager")
    try:
        sites = match_attention(capture_causal_lm(model, prefer_sdpa=False), model.config)
        with_sdpa = match_attention(capture_causal_lm(model), model.config)
        assert model.config._attn_implementation == "eager"         # restored after tracing with SDPA
    finally:
        model.set_attn_implementation("sdpa")
    assert [s.form for s in with_sdpa] == ["sdpa", "sdpa"]
    assert [s.form for s in sites] == ["eager", "eager"]
    assert sites[0].scale == pytest.approx(16 ** -0.5)


class _SoftmaxGate(torch.nn.Module):
    """A counter-example: matmul -> softmax -> matmul over a weight, not over values (no attention)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(2, 8, 8))

    def forward(self, input_ids, position_ids):
        x = torch.nn.functional.one_hot(input_ids, 8).float()[:, None].expand(-1, 2, -1, -1)
        g = torch.softmax(torch.matmul(x, self.w), dim=-1)                 # [B, 2, T, 8]
        return torch.matmul(g, self.w.transpose(-1, -2)).sum(1)


def test_a_softmax_that_is_not_attention_is_left_alone():
    gm = torch.export.export(_SoftmaxGate(), (torch.zeros(1, 5, dtype=torch.long), torch.zeros(1, 5, dtype=torch.long)),
                             strict=False).module()
    with pytest.raises(UnsupportedModel, match="no attention found"):
        find_attention_sites(gm, "gate", None)


def test_apply_leaves_the_model_untouched_and_shares_weights():
    model = tiny_model("gemma2")
    impl = model.config._attn_implementation
    kv = kvpass.apply(model, policy="full")
    assert model.config._attn_implementation == impl
    shared = {p.data_ptr() for p in model.parameters()}
    graph_params = {p.data_ptr() for p in kv.graphs.decode.parameters()}
    assert graph_params and graph_params <= shared
    ids = torch.randint(1, 128, (1, 9))
    assert torch.equal(model(ids).logits, model(ids).logits)        # still an ordinary, working model
