"""Tiny random-config models of every foundation architecture, shared by the tests of the Chelsea,
KVMerger, EMS, ClusterKV and Quest policies (issue 5)."""

from __future__ import annotations

import functools

import torch
import transformers

import kvpass

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1)

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "phi3", "gpt2", "gemma2")


def _config(arch: str):
    if arch == "llama":
        return transformers.LlamaConfig(**COMMON)
    if arch == "mistral":
        return transformers.MistralConfig(**COMMON, sliding_window=32)
    if arch == "qwen2":
        return transformers.Qwen2Config(**COMMON)
    if arch == "qwen3":
        return transformers.Qwen3Config(**COMMON, head_dim=16)
    if arch == "gemma3_text":
        cfg = dict(COMMON, num_key_value_heads=1, num_hidden_layers=2)
        return transformers.Gemma3TextConfig(**cfg, head_dim=16, sliding_window=16,
                                             layer_types=["sliding_attention", "full_attention"])
    if arch == "phi3":
        return transformers.Phi3Config(**COMMON, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if arch == "gpt2":
        return transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=256, bos_token_id=1, eos_token_id=2,
                                       initializer_range=0.1)
    if arch == "gemma2":
        cfg = transformers.Gemma2Config(**COMMON, head_dim=16, sliding_window=16, attn_logit_softcapping=50.0)
        cfg._attn_implementation = "eager"
        return cfg
    raise ValueError(arch)


@functools.cache
def tiny_model(arch: str) -> torch.nn.Module:
    """A deterministic tiny causal LM of ``arch`` (seeded), eval mode, fp32."""
    torch.manual_seed(0)
    cfg = _config(arch)
    kwargs = {"attn_implementation": "eager"} if arch == "gemma2" else {}
    return transformers.AutoModelForCausalLM.from_config(cfg, **kwargs).eval()


def prompt(batch: int = 1, tokens: int = 96, seed: int = 0) -> torch.Tensor:
    """Random token ids [batch, tokens] in the tiny vocabulary."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 128, (batch, tokens), generator=g)


@functools.cache
def full_output(arch: str, batch: int, tokens: int, new_tokens: int) -> torch.Tensor:
    """Greedy sequences of the full-cache policy for ``prompt(batch, tokens)`` (shared by the tests)."""
    model = kvpass.apply(tiny_model(arch), policy="full")
    return model.generate(prompt(batch, tokens), max_new_tokens=new_tokens, eos_token_id=[])
