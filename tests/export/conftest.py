"""Fixtures for the export tests: a tiny random Llama and its ONNX exports (built once per module)."""

from __future__ import annotations

import pytest
import torch
import transformers

import kvpass

BUDGET, INTERVAL, SINKS, MAX_LENGTH = 10, 4, 2, 64
POLICY_KWARGS = {"full": {}, "streamingllm": {"sinks": SINKS, "interval": INTERVAL}, "d2o": {"interval": INTERVAL},
                 "tova": {"interval": INTERVAL}}


def tiny_llama() -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return transformers.LlamaForCausalLM(cfg).eval()


def apply_policy(model, policy: str) -> kvpass.KVPassModel:
    if policy not in kvpass.POLICIES:
        pytest.skip(f"policy {policy!r} is not registered on this branch (available: {sorted(kvpass.POLICIES)})")
    kwargs = {k: v for k, v in POLICY_KWARGS.get(policy, {}).items() if k in kvpass.POLICIES[policy].defaults()}
    return kvpass.apply(model, policy=policy, budget=BUDGET, **kwargs)


@pytest.fixture(scope="session")
def llama():
    return tiny_llama()


@pytest.fixture(scope="session")
def exported(llama, tmp_path_factory):
    """(policy name, budgets mode) -> (KVPassModel, export directory, metadata), exported lazily once per session
    (``budgets``: kvpass.export.onnx's, "runtime" by default)."""
    from kvpass.export import onnx

    cache: dict[tuple[str, str], tuple] = {}

    def get(policy: str, budgets: str = "runtime"):
        if (policy, budgets) not in cache:
            model = apply_policy(llama, policy)
            out = tmp_path_factory.mktemp(f"onnx_{policy}_{budgets}")
            cache[policy, budgets] = (model, out, onnx(model, out, max_length=MAX_LENGTH, budgets=budgets))
        return cache[policy, budgets]

    return get
