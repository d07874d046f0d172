"""Is a model's low ceiling the model or our loading of it? Greedy completions of three plain prompts
(no chat template) from a known model, as a reader would try by hand.

    python benchmarks/model_sanity_probe.py gemma3-270m

Used for Gemma-3-270M (docs/quality.md): the PyPI GGUF is the base model ("Gemma 3 270m", no
chat template); coherent completions here say the loader is sound and the needle ceiling is the model's.
"""

from __future__ import annotations

import sys

import torch

from kvpass.models import load_model

PROMPTS = ("The capital of France is", "Here is a short story about a cat:\n", "Question: What is 2 + 3?\nAnswer:")


def main(name: str) -> None:
    model, tok = load_model(name)
    print(f"{name}: chat template {'yes' if getattr(tok, 'chat_template', None) else 'none'}")
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=25, do_sample=False)
        print(repr(prompt), "->", repr(tok.decode(out[0, ids.shape[1]:])))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "gemma3-270m")
