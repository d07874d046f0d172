"""rope_into_write_kv: each layer's write_kv of rope(k) and its rope(q) become one rope_write_kv call whose output
the attention reads, and the decode graph computes the same logits bit for bit (off CUDA the op is the
rotation and the writes op for op)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import kvpass
from kvpass.policies.capabilities import deferred_scores
from kvpass.rewrites.rope_into_write_kv import rope_into_write_kv
from tests.conftest import TINY_CONFIGS

WRITE_KV, ROPE_WRITE_KV = torch.ops.kvpass.write_kv.default, torch.ops.kvpass.rope_write_kv.default


def _count(gm, target) -> int:
    return sum(n.op == "call_function" and n.target is target for n in gm.graph.nodes)


@pytest.mark.parametrize("name, policy, dtype", [("llama", "streamingllm", torch.float32),
                                                 ("llama", "d2o", torch.bfloat16),
                                                 ("llama", "d2o[interval=4]", torch.float32),   # the query ring
                                                 ("qwen2", "snapkv", torch.float32),
                                                 ("gemma3", "h2o", torch.float32)])
def test_rotations_fold_into_the_write_and_logits_stay(name, policy, dtype):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(TINY_CONFIGS[name]()).eval().to(dtype)
    g = torch.Generator().manual_seed(1)
    ids, fed = torch.randint(1, 128, (1, 20), generator=g), torch.randint(1, 128, (1, 5), generator=g)
    kv = kvpass.apply(model, policy, 0.5)
    want = kv.start(ids, max_new_tokens=8).feed(fed)
    decode = kv.graphs.decode
    writes, cats = _count(decode, WRITE_KV), _count(decode, torch.ops.aten.cat.default)
    assert writes == 2                                                  # one a layer
    assert rope_into_write_kv(decode) == writes
    assert (_count(decode, WRITE_KV), _count(decode, ROPE_WRITE_KV)) == (0, writes)
    assert _count(decode, torch.ops.aten.cat.default) == cats - 2 * writes     # rotate_half's cat of q and k
    fused = [n for n in decode.graph.nodes if n.target is ROPE_WRITE_KV]
    readers = {torch.ops.kvpass.decode_attention.default, torch.ops.kvpass.decode_attention_nearest.default,
               torch.ops.kvpass.write_query.default}
    assert all(u.target in readers for n in fused for u in n.users)
    assert _count(decode, torch.ops.kvpass.write_query.default) == (writes if deferred_scores(kv.policy) else 0)
    kv.decode_step.reset()
    torch.testing.assert_close(kv.start(ids, max_new_tokens=8).feed(fed), want, rtol=0, atol=0)


def test_a_graph_without_the_rotation_is_left_alone():
    """No write_kv of a rotated key (a full-cache policy's graph rotated by hand to something else): 0 fused."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(TINY_CONFIGS["llama"]()).eval()
    kv = kvpass.apply(model, "streamingllm", 0.5)
    decode = kv.graphs.decode
    for n in decode.graph.nodes:                         # break the rotation: cos -> sin in every product
        if n.target is torch.ops.aten.neg.default:
            n.target = torch.ops.aten.relu.default
    decode.recompile()
    assert rope_into_write_kv(decode) == 0 and _count(decode, WRITE_KV) == 2


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3", "phi3-partial", "gpt2",
                                  "gemma2"])
def test_every_architecture_with_the_cuda_passes_keeps_its_logits(name):
    """The decode graph after every CUDA pass (fused linears, GEMV, RoPE into the write) on a left-padded batch
    of two: the same logits bit for bit as the unrewritten graph; each rotary layer's write is fused (GPT-2 has
    no rotation; Phi-3's form rotates a leading part of the head and concatenates the rest back)."""
    from kvpass.rewrites.linears_to_gemv import linears_to_gemv
    from tests.conftest import padded_batch

    torch.manual_seed(0)
    config = TINY_CONFIGS[name.split("-")[0]]()
    if name == "phi3-partial":                          # Phi-4-mini's form: 3/4 of each head rotated
        config.partial_rotary_factor = 0.75
    model = AutoModelForCausalLM.from_config(config).eval()
    ids, mask = padded_batch([14, 9], seed=3)
    fed = torch.randint(1, 128, (2, 4), generator=torch.Generator().manual_seed(4))
    kv = kvpass.apply(model, "snapkv", 0.5, fuse_linears=True)
    want = kv.start(ids, mask, max_new_tokens=8).feed(fed)
    linears_to_gemv(kv.graphs.decode)
    assert rope_into_write_kv(kv.graphs.decode) == (0 if name == "gpt2" else 2)
    kv.decode_step.reset()
    torch.testing.assert_close(kv.start(ids, mask, max_new_tokens=8).feed(fed), want, rtol=0, atol=0)
