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


def build_model(config_kwargs: dict, device: torch.device | str, dtype: torch.dtype):
    """A LlamaForCausalLM with random weights, built directly on the device in ``dtype`` (greedy, no EOS)."""
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


def build_model_of_views(config_kwargs: dict, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """A LlamaForCausalLM that takes almost no memory until a weight is copied: every 2-D weight [R, C] is
    the Hankel view W[i, j] = s[i + j] of a random vector s of R + C - 1 values (std 0.02, ``seed``), every
    norm weight ones, the rotary buffers real. For a tensor-parallel model larger than one GPU:
    ``kvpass.apply(model, tp=N)`` copies each rank's shard of the projections (all the projection memory a
    rank then holds), and ``materialise_views`` copies what stays whole (the embedding), so what runs has
    every byte of an ordinary model. Values are random, only their layout is shared within a matrix."""
    model = build_model(config_kwargs, "meta", dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    for module in list(model.modules()):
        for name, p in list(module.named_parameters(recurse=False)):
            if p.dim() == 2:
                rows, cols = p.shape
                s = torch.randn(rows + cols - 1, device=device, dtype=dtype, generator=gen) * 0.02
                value = s.as_strided((rows, cols), (1, 1))
            else:
                value = torch.ones(p.shape, device=device, dtype=dtype)
            setattr(module, name, torch.nn.Parameter(value, requires_grad=False))
        for name, child in list(module.named_children()):
            if any(b.is_meta for b in child.buffers(recurse=False)):     # the rotary embedding's inv_freq
                with torch.device(device):
                    setattr(module, name, type(child)(model.config))
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"build_model_of_views: still on the meta device: {left}")
    return model


def materialise_views(model: torch.nn.Module) -> int:
    """Copy every parameter that is still a view of shared storage (``build_model_of_views``) into storage
    of its own, in place (``param.data``: the rewritten graphs read the same Parameter objects). Returns
    the bytes copied."""
    copied = 0
    for p in model.parameters():
        if not p.is_contiguous():
            p.data = p.data.contiguous()
            copied += p.numel() * p.element_size()
    return copied


def llama_8b_with_prompt(prompt: int, device: torch.device, seed: int = 0) -> tuple[torch.nn.Module, torch.Tensor]:
    """The GPU probes' setting: the Llama-3.1-8B-shaped model with random bf16 weights on ``device`` and
    random token ids [1, prompt] (CPU generator ``seed``)."""
    ids = torch.randint(1, LLAMA_8B["vocab_size"], (1, prompt), generator=torch.Generator().manual_seed(seed))
    return build_model(LLAMA_8B, device, torch.bfloat16), ids.to(device)


def weight_bytes_per_step(model) -> int:
    """Parameters one decode step reads: all but the input embedding table (one row of it)."""
    emb = model.get_input_embeddings().weight
    return sum(p.numel() * p.element_size() for p in model.parameters() if p is not emb)

