"""Chunked prefill on SmolLM2-135M-Instruct (Llama, GQA 9/3, 30 layers): ``full`` prefilled in chunks gives the
unchunked tokens on a 1k-token needle prompt, and the default policy prefilled in chunks holds at most its budget +
one chunk per layer (the unchunked run: the prompt). Quality is the suite's job (--prefill-chunk)."""

from __future__ import annotations

import pytest
import torch

import kvpass
from kvpass.prompts import chat_ids, needle_prompt
from kvpass.runtime.chunked_prefill import chunk_bounds

pytestmark = pytest.mark.real_model


def test_smollm2_chunked_prefill(smollm2, capture_once):
    model, tokenizer = smollm2
    prompt = needle_prompt(tokenizer, 1000, 0.3, seed=2)
    ids = torch.tensor([chat_ids(tokenizer, prompt.messages())])
    full = kvpass.apply(model, "full", captured=capture_once(model))
    want = full.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(full.generate(ids, max_new_tokens=12, do_sample=False, prefill_chunk=256), want)
    kv = kvpass.apply(model, budget=0.3, captured=capture_once(model))      # the default policy
    kv.generate(ids, max_new_tokens=4, do_sample=False)
    assert min(kv.last_report.peak_entries.values()) >= ids.shape[1]
    out = kv.generate(ids, max_new_tokens=4, do_sample=False, prefill_chunk=256)
    report = kv.last_report
    size = max(b - a for a, b in chunk_bounds(ids.shape[1], 256))
    assert all(report.peak_entries[la] <= b + size for la, b in report.layer_budgets.items())
    assert max(report.peak_entries.values()) < ids.shape[1] and out.shape == (1, ids.shape[1] + 4)
