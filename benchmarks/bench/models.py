"""The benchmarks' models: Llama-3.1-8B's shape (and a tiny one for ``--smoke`` and tests) with random
weights, built on the device in the dtype asked for."""

from __future__ import annotations

import torch

LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)


TINY_LLAMA = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                  rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)


def build_model(config_kwargs: dict, device: torch.device, dtype: torch.dtype):
    """A LlamaForCausalLM with random weights, built directly on the device in ``dtype``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**config_kwargs, attn_implementation="sdpa")
    config.eos_token_id = None
    config.pad_token_id = 0
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(old)
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def llama_8b_with_prompt(prompt: int, device: torch.device, seed: int = 0) -> tuple[torch.nn.Module, torch.Tensor]:
    """The GPU probes' setting: the Llama-3.1-8B-shaped model with random bf16 weights on ``device`` and
    random token ids [1, prompt] (CPU generator ``seed``)."""
    ids = torch.randint(1, LLAMA_8B["vocab_size"], (1, prompt), generator=torch.Generator().manual_seed(seed))
    return build_model(LLAMA_8B, device, torch.bfloat16), ids.to(device)


def weight_bytes_per_step(model) -> int:
    """Parameters one decode step reads: all but the input embedding table (one row of it)."""
    emb = model.get_input_embeddings().weight
    return sum(p.numel() * p.element_size() for p in model.parameters() if p is not emb)

