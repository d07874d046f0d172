"""The rewrite must not leave the original attention running: SDPA is tagged random (dropout), so FX's
dead-code elimination alone keeps it, and prefill would compute attention twice."""

from __future__ import annotations

import torch

import kvpass
from benchmarks.bench.models import TINY_LLAMA, build_model


def test_no_original_attention_left_and_full_still_matches_transformers():
    torch.manual_seed(0)
    model = build_model(TINY_LLAMA, torch.device("cpu"), torch.float32)
    ids = torch.randint(1, TINY_LLAMA["vocab_size"], (2, 24))
    want = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    kv = kvpass.apply(model, policy="full")
    for graph in (kv.graphs.prefill.graph, kv.graphs.decode.graph):
        targets = {n.target for n in graph.nodes if n.op == "call_function"}
        assert torch.ops.aten.scaled_dot_product_attention.default not in targets
    assert torch.equal(kv.generate(ids, max_new_tokens=6, do_sample=False), want)
