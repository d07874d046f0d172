"""Model choice shared by the examples: a tiny random Llama (default, seconds) or SmolLM2-135M."""

from __future__ import annotations

import torch
import transformers


def load(name: str) -> tuple[torch.nn.Module, torch.Tensor]:
    """(model, prompt ids [1, T]) for "tiny" or "smollm2"."""
    if name == "smollm2":
        from kvpass.models import load_model

        model, tokenizer = load_model("smollm2")
        ids = tokenizer("The three primary colours are red, yellow and", return_tensors="pt").input_ids
        return model, ids
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return transformers.LlamaForCausalLM(cfg).eval(), torch.randint(0, 128, (1, 24))
