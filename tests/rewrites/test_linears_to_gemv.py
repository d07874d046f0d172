"""linears_to_gemv: every linear of a decode graph becomes kvpass::gemv, down_proj reads the fused gate/up
output with the SiLU gate folded in, and the graph computes the same logits (off CUDA the op is F.linear
itself)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import kvpass
from kvpass.rewrites.linears_to_gemv import linears_to_gemv
from tests.conftest import TINY_CONFIGS

LINEAR, GEMV = torch.ops.aten.linear.default, torch.ops.kvpass.gemv.default


def _count(gm, target) -> int:
    return sum(n.op == "call_function" and n.target is target for n in gm.graph.nodes)


@pytest.mark.parametrize("name, folded", [("llama", 2), ("qwen2", 2), ("gemma3", 0)])   # Gemma's gate is GELU
def test_decode_linears_become_gemv_and_logits_stay(name, folded):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(TINY_CONFIGS[name]()).eval()
    g = torch.Generator().manual_seed(1)
    ids, fed = torch.randint(1, 128, (1, 20), generator=g), torch.randint(1, 128, (1, 5), generator=g)
    kv = kvpass.apply(model, "d2o", 0.5, fuse_linears=True)
    want = kv.start(ids, max_new_tokens=8).feed(fed)
    linears = _count(kv.graphs.decode, LINEAR)
    assert linears == 9                                   # 2 layers x (qkv, o, gate_up, down) + lm_head
    assert linears_to_gemv(kv.graphs.decode) == linears
    assert (_count(kv.graphs.decode, LINEAR), _count(kv.graphs.decode, GEMV)) == (0, linears)
    gated = [n for n in kv.graphs.decode.graph.nodes if n.target is GEMV and n.kwargs.get("silu_gate")]
    assert len(gated) == folded and _count(kv.graphs.decode, torch.ops.aten.silu.default) == 0   # one a layer
    assert all(a.target is GEMV for a in (n.args[0] for n in gated))          # they read gate/up's output
    assert _count(kv.graphs.prefill, GEMV) == 0
    kv.decode_step.reset()
    torch.testing.assert_close(kv.start(ids, max_new_tokens=8).feed(fed), want, rtol=0, atol=0)
