"""Every registered policy generates on both real models shipped in PyPI packages: SmolLM2-135M-Instruct
(Llama, GQA 9/3) and Gemma-3-270M (sliding + global layers, MQA, QK-norm), at budget 0.5 (each compressing
policy compresses), with finite logits, text, and every layer within its budget + interval. (The
quality of these answers is the leaderboard's business, benchmarks/results/quality-suite-smollm2.md.)"""

from __future__ import annotations

import pytest
import torch

import kvpass
from kvpass.policies import POLICIES
from kvpass.prompts import chat_ids, needle_prompt

pytestmark = [pytest.mark.real_model, pytest.mark.slow]


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("which", ["smollm2", "gemma3_270m"])
def test_every_policy_generates_on_real_models(which, policy, request):
    model, tokenizer = request.getfixturevalue(which)
    prompt = needle_prompt(tokenizer, 400, 0.5, seed=3)          # ~430 tokens: above every policy's minimum
    ids = torch.tensor([chat_ids(tokenizer, prompt.messages())])
    kv = kvpass.apply(model, policy=policy, budget=0.5)
    out = kv.generate(ids, max_new_tokens=12, do_sample=False, return_dict_in_generate=True,
                      output_logits=True)
    report = out.report
    assert torch.isfinite(torch.stack(out.logits)).all()
    interval = getattr(kv.policy, "interval", 1)
    if kv.policy.compresses:                     # recall policies (quest, clusterkv) keep every token by design
        assert report.compressions > 0
    for layer, budget in (report.layer_budgets.items() if kv.policy.compresses else ()):
        assert report.entries[layer] <= budget + interval, (layer, report.entries[layer], budget)
    text = tokenizer.decode(out.sequences[0, ids.shape[1]:], skip_special_tokens=True)
    assert text.strip(), f"{policy} produced no text on {which}"
