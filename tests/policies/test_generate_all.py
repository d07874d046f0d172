"""Every policy of issue 4 generates on every architecture of the foundation issue (tiny random
configs), within its budget, and a small budget changes what the model computes."""

from __future__ import annotations

import functools

import pytest
import torch

import kvpass
from kvpass.policies import DEFAULT_POLICY
from tests.policies.policy_helpers import ARCHS, apply_cached, captured_model

POLICIES_4 = ("d2o", "h2o", "snapkv", "pyramidkv", "cam")
SMALL_WINDOW = {"snapkv": {"window": 4}, "pyramidkv": {"window": 4}}     # the official 32 exceeds these budgets
NEW = 5


@functools.cache
def _full_logits_cached(arch: str, ids: tuple) -> torch.Tensor:
    return _full_logits_uncached(arch, torch.tensor(ids))


def _full_logits(arch: str, ids: torch.Tensor) -> torch.Tensor:
    return _full_logits_cached(arch, tuple(map(tuple, ids.tolist())))


def _full_logits_uncached(arch: str, ids: torch.Tensor) -> torch.Tensor:
    out = apply_cached(arch, "full", 1.0).generate(ids, max_new_tokens=NEW, return_dict_in_generate=True,
                                                   output_logits=True)
    return torch.stack(out.logits, 1)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("policy", POLICIES_4)
def test_policy_generates(arch: str, policy: str, prompt_ids: torch.Tensor) -> None:
    model = apply_cached(arch, policy, 0.3, **SMALL_WINDOW.get(policy, {}))
    out = model.generate(prompt_ids, max_new_tokens=NEW, return_dict_in_generate=True, output_logits=True)
    report = out.report
    assert out.sequences.shape == (2, prompt_ids.shape[1] + NEW)
    assert torch.equal(out.sequences[:, :prompt_ids.shape[1]], prompt_ids)
    logits = torch.stack(out.logits, 1)
    assert torch.isfinite(logits).all()
    budget = report.budget_tokens
    interval = model.policy.interval
    for row in report.row_layer_budgets:         # every row's layer budgets keep its total (rows: equal prompts)
        assert sum(row.values()) == len(row) * budget
    assert report.layer_budgets == {i: max(r[i] for r in report.row_layer_budgets) for i in report.layer_budgets}
    for layer, b in report.layer_budgets.items():
        assert report.entries[layer] <= b + interval
    if report.layer_budgets:          # something was compressed: the model computes something else
        assert report.compressions > 0
        assert not torch.allclose(logits, _full_logits(arch, prompt_ids), atol=1e-4)
    else:
        assert arch == "mistral"      # every layer a sliding window shorter than the sequence: a ring


def test_the_default_is_snapkv_with_a_wide_pooling_kernel(prompt_ids: torch.Tensor) -> None:
    """The default is the leaderboard's best memory-saving configuration at budget 0.2 (a spec,
    kvpass/policies/__init__.py): apply(model) builds it, and it generates."""
    assert DEFAULT_POLICY == "snapkv[kernel=31]"
    model, _, _ = captured_model("llama")
    km = kvpass.apply(model, budget=0.3)
    assert km.policy.name == "snapkv" and km.policy.kernel == 31
    seq = km.generate(prompt_ids, max_new_tokens=3)
    assert seq.shape == (2, prompt_ids.shape[1] + 3)


@pytest.mark.parametrize("policy", POLICIES_4)
def test_budget_one_does_not_compress(policy: str, prompt_ids: torch.Tensor) -> None:
    """budget 1.0 = every token kept: the policy must reproduce the full cache's logits (§8.1)."""
    out = apply_cached("llama", policy, 1.0).generate(prompt_ids, max_new_tokens=NEW, return_dict_in_generate=True,
                                                      output_logits=True)
    torch.testing.assert_close(torch.stack(out.logits, 1), _full_logits("llama", prompt_ids))
    assert out.report.compressions == 0
