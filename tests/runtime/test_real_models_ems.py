"""EMS (docs/policies.md §4) on the real models shipped in PyPI packages: SmolLM2-135M-Instruct (Llama, GQA
9/3) and Gemma-3-270M (sliding + global layers, MQA, QK-norm). With a budget covering the sequence it
generates exactly what the full cache does; at 16 entries it stays within its entries and slots."""

from __future__ import annotations

import pytest
import torch

import kvpass
from tests.runtime.test_real_models import _chat_batch

pytestmark = [pytest.mark.real_model, pytest.mark.slow]


@pytest.mark.parametrize("which", ["smollm2", "gemma3_270m"])
def test_ems_generates_on_real_models(which, request):
    model, tokenizer = request.getfixturevalue(which)
    ids, mask = _chat_batch(tokenizer, 2)
    full = kvpass.apply(model, policy="full").generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    exact = kvpass.apply(model, policy="ems", budget=1.0, local_window=16)
    assert torch.equal(exact.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False), full)
    small = kvpass.apply(model, policy="ems", budget=16, local_window=8)
    out = small.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, return_dict_in_generate=True,
                         output_logits=True)
    report = out.report
    assert report.layer_budgets and report.compressions > 0
    assert all(report.entries[layer] <= b + 1 for layer, b in report.layer_budgets.items())
    assert torch.isfinite(torch.stack(out.logits)).all()
    # The slot table (gamma x budget slots of metadata) only pays off once the sequence is well past the
    # budget: Gemma's chat prompt is 9 tokens (21 with the new ones), SmolLM2's is long enough.
    if report.prompt_tokens + report.new_tokens >= 2 * report.budget_tokens:
        assert report.cache_bytes < report.full_cache_bytes
    else:
        assert which == "gemma3_270m"
    assert small.policy.rope_inv_freq                                  # "w.o. pos" un-rotates with the model's RoPE
    text = tokenizer.decode(out.sequences[0, ids.shape[1]:], skip_special_tokens=True)
    assert text.strip(), "EMS at 16 entries should still produce text"
