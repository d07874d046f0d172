"""fuse_sibling_linears: q/k/v and gate/up become one linear each, the graphs compute the same logits,
and the model's parameters keep their identity, values and state dict while sharing one storage."""

from __future__ import annotations

import gc

import pytest
import torch
from torch.fx import Graph, GraphModule
from transformers import AutoModelForCausalLM

import kvpass
from kvpass.rewrites.fuse_sibling_linears import concat_in_place, find_sibling_linears, fuse_sibling_linears
from tests.conftest import TINY_CONFIGS

LINEAR = torch.ops.aten.linear.default


def _fresh(name: str) -> torch.nn.Module:
    """Not conftest's cached model: fusing re-lays the parameters of the model it is given."""
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(TINY_CONFIGS[name]()).eval()


def _linears(gm: GraphModule) -> int:
    return sum(n.op == "call_function" and n.target is LINEAR for n in gm.graph.nodes)


# per architecture: linears in the decode graph before -> after (2 layers + lm_head). Phi-3 ships qkv_proj and
# gate_up_proj already fused; GPT-2's Conv1D projections are addmm, not linear.
EXPECTED = {"llama": (15, 9), "mistral": (15, 9), "qwen2": (15, 9), "qwen3": (15, 9), "gemma3": (15, 9),
            "gemma2": (15, 9), "phi3": (9, 9), "gpt2": (1, 1)}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_fused_graphs_compute_the_same_logits_and_tokens(name):
    model = _fresh(name)
    g = torch.Generator().manual_seed(1)
    ids, fed = torch.randint(1, 128, (2, 20), generator=g), torch.randint(1, 128, (2, 6), generator=g)
    plain = kvpass.apply(model, "full", fuse_linears=False)
    want_logits = plain.start(ids, max_new_tokens=8).feed(fed)
    want_tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False)
    fused = kvpass.apply(model, "full", fuse_linears=True)
    assert (_linears(plain.graphs.decode), _linears(fused.graphs.decode)) == EXPECTED[name]
    assert _linears(fused.graphs.prefill) == EXPECTED[name][1]
    torch.testing.assert_close(fused.start(ids, max_new_tokens=8).feed(fed), want_logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(fused.generate(ids, max_new_tokens=10), want_tokens)


def test_parameters_keep_identity_values_and_state_dict_and_share_one_storage():
    model = _fresh("qwen2")                                       # q/k/v with biases
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    params = {n: p for n, p in model.named_parameters()}
    before = {n: p.detach().clone() for n, p in params.items()}
    nbytes = sum(p.numel() * p.element_size() for p in params.values())
    kv = kvpass.apply(model, "d2o", 0.5, fuse_linears=True)
    assert dict(model.named_parameters()) == params                        # the same Parameter objects
    assert kv.graphs.decode.get_parameter("model.model.layers.0.self_attn.q_proj.weight") is attn.q_proj.weight
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
        assert isinstance(p, torch.nn.Parameter) and p.requires_grad
    assert list(model.state_dict()) == list(before)
    for group in ((attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight),
                  (attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias),
                  (mlp.gate_proj.weight, mlp.up_proj.weight)):
        assert len({p.untyped_storage().data_ptr() for p in group}) == 1
    # no second copy: every storage the model and the graphs hold adds up to the parameters' bytes
    fused = [t for gm in (kv.graphs.decode, kv.graphs.prefill) for n, t in gm.named_buffers() if n.startswith("fused_")]
    assert len(fused) == 2 * 3 * 2                                        # 2 graphs x 3 groups x 2 layers
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in [*model.parameters(), *fused]}
    assert sum(held.values()) == nbytes
    # a second rewrite of the same model reuses the layout instead of concatenating again
    ptr = attn.q_proj.weight.untyped_storage().data_ptr()
    again = kvpass.apply(model, "streamingllm", 0.5, fuse_linears=True)
    assert attn.q_proj.weight.untyped_storage().data_ptr() == ptr
    assert _linears(again.graphs.decode) == 9


def test_prefill_outputs_do_not_keep_the_fused_projection_alive():
    """V leaves the prefill graph as a view of its projection; after fusion it is copied out, so the cache
    does not hold the whole q/k/v output (here 4x V's bytes) per layer."""
    model = _fresh("llama")
    kv = kvpass.apply(model, "full", fuse_linears=True)
    ids, pos, pad = torch.randint(1, 128, (2, 20)), torch.arange(20).expand(2, -1), torch.zeros(2, dtype=torch.long)
    outs = kv.graphs.prefill(ids, pos, pad)
    assert len(outs) == 1 + 2 * 2                                         # logits, then K, V per layer
    for out in outs:
        assert out.untyped_storage().nbytes() == out.numel() * out.element_size()
    clones = [n for n in kv.graphs.prefill.graph.nodes if n.target is torch.ops.aten.clone.default]
    assert len(clones) == 2 and not any(n.target is torch.ops.aten.clone.default for n in kv.graphs.decode.graph.nodes)


def test_default_fuses_on_cuda_only():
    model = _fresh("llama")
    kv = kvpass.apply(model, "full")
    assert kv.fused_linears is False and _linears(kv.graphs.decode) == 15


def _graph(weights: dict[str, torch.Tensor], calls: list[tuple[str, str]]) -> GraphModule:
    """x, y [N, 4] -> the outputs of the linears ``calls`` = [(input name, weight name)], in order; each
    weight a Parameter of the root module."""
    root = torch.nn.Module()
    for name, w in weights.items():
        root.register_parameter(name, torch.nn.Parameter(w))
    g = Graph()
    inputs = {"x": g.placeholder("x"), "y": g.placeholder("y")}
    outs = [g.call_function(LINEAR, (inputs[i], g.get_attr(w))) for i, w in calls]
    g.output(tuple(outs))
    return GraphModule(root, g)


def test_linears_over_one_input_group_by_layout_and_shared_weights_stay_out():
    torch.manual_seed(0)
    w = {"a": torch.randn(3, 4), "b": torch.randn(5, 4), "c": torch.randn(2, 4), "d": torch.randn(2, 4).double(),
         "tied": torch.randn(2, 4), "e": torch.randn(6, 4), "f": torch.randn(6, 4).double()}
    gm = _graph(w, [("x", "a"), ("x", "b"), ("y", "c"), ("x", "d"), ("x", "tied"), ("y", "tied"), ("y", "e"),
                    ("x", "f")])
    # x: a, b (float32) and d, f (float64) form two groups; tied is read by two linears; y: c, e
    assert sorted(g.weights for g in find_sibling_linears(gm)) == [("a", "b"), ("c", "e"), ("d", "f")]
    x, y = torch.randn(7, 4), torch.randn(7, 4)
    gm = _graph(w, [("x", "a"), ("x", "b"), ("y", "c"), ("y", "e"), ("x", "tied"), ("y", "tied")])
    want = [t.clone() for t in gm(x, y)]
    assert fuse_sibling_linears(gm) == 2 and _linears(gm) == 4          # a+b, c+e, and tied's two linears
    for got, ref in zip(gm(x, y), want, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    assert fuse_sibling_linears(gm) == 0                                  # nothing left to fuse


def test_concat_in_place_reuses_a_layout_it_made_and_only_that():
    parts = [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(2, 4))]
    values = [p.detach().clone() for p in parts]
    fused = concat_in_place(parts)
    assert fused.shape == (5, 4) and torch.equal(fused, torch.cat(values))
    assert concat_in_place(parts).data_ptr() == fused.data_ptr()          # already laid out: reused
    swapped = concat_in_place(parts[::-1])                                # another order: a new tensor
    assert swapped.data_ptr() != fused.data_ptr() and torch.equal(swapped, torch.cat(values[::-1]))
    for p, v in zip(parts, values, strict=True):
        assert torch.equal(p, v)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_fusing_is_the_default_and_adds_no_memory():
    model = _fresh("llama").cuda()
    ids = torch.randint(1, 128, (2, 20), device="cuda")
    kvpass.apply(_fresh("llama").cuda(), "full", fuse_linears=False).generate(ids, max_new_tokens=2)  # workspaces
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    kv = kvpass.apply(model, "full")
    torch.cuda.synchronize()
    gemv = sum(n.op == "call_function" and n.target is torch.ops.kvpass.gemv.default for n in kv.graphs.decode.graph.nodes)
    assert kv.fused_linears and _linears(kv.graphs.prefill) == 9 and gemv == 9      # decode: linears_to_gemv
    assert torch.cuda.memory_allocated() <= before
    want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False)
    assert torch.equal(kv.generate(ids, max_new_tokens=10), want)
