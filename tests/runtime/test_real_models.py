"""The real models shipped in PyPI packages: SmolLM2-135M-Instruct (Llama, GQA 9/3) and
Gemma-3-270M (sliding + global layers, MQA, QK-norm). ``full`` equals transformers token for token;
streamingllm answers a 2k needle question only when the needle is inside its recent window."""

from __future__ import annotations

import pytest
import torch

import kvpass
from kvpass.prompts import chat_ids, needle_prompt
from tests.runtime.test_full_matches_transformers import assert_same_generation

pytestmark = pytest.mark.real_model

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
             "List three prime numbers and explain why they are prime."]


def _chat_batch(tokenizer, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [chat_ids(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS[:n]]
    t = max(len(r) for r in rows)
    ids = torch.zeros(n, t, dtype=torch.long)
    mask = torch.zeros(n, t, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, t - len(r):] = torch.tensor(r)
        mask[i, t - len(r):] = 1
    return ids, mask


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("which", ["smollm2", "gemma3_270m"])
def test_full_matches_transformers_on_real_models(which, batch, request, capture_once):
    model, tokenizer = request.getfixturevalue(which)
    ids, mask = _chat_batch(tokenizer, batch)
    assert_same_generation(model, kvpass.apply(model, policy="full", captured=capture_once(model)), ids, mask)


def _answer(kv_model, tokenizer, depth: float) -> tuple[str, str]:
    prompt = needle_prompt(tokenizer, 2000, depth, seed=1)
    ids = torch.tensor([chat_ids(tokenizer, prompt.messages())])
    out = kv_model.generate(ids, max_new_tokens=24, do_sample=False)     # the answer ends by the 20th token
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True), prompt.answer


def test_streamingllm_needle_inside_and_outside_the_window(smollm2, capture_once):
    model, tokenizer = smollm2
    kv = kvpass.apply(model, policy="streamingllm", budget=0.3, captured=capture_once(model))
    text, answer = _answer(kv, tokenizer, depth=1.0)            # the needle is among the newest tokens
    assert answer in text, text
    text, answer = _answer(kv, tokenizer, depth=0.5)            # ~1000 tokens back, the window ~600: evicted
    assert answer not in text, text
    text, answer = _answer(kvpass.apply(model, policy="full", captured=capture_once(model)), tokenizer, depth=0.5)
    assert answer in text, f"the full cache should find it: {text}"   # so the miss above is the eviction's
