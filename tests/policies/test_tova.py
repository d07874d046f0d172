"""TOVA (docs/policies.md §6.10): the kept entries against a loop reference, the last-query statistic
against transformers' own attention (prefill and after a decode step), and generating on a tiny model."""

from __future__ import annotations

import copy

import pytest
import torch

import kvpass
from kvpass.policies import get_policy
from kvpass.policies.base import Stat
from kvpass.policies.tova import TOVA
from tests.conftest import tiny_model
from tests.policies.policy_helpers import apply_cached, live_positions, random_cache


def reference_tova(score: list[float], s: int, keep: int, sinks: int) -> list[int]:
    if s <= keep:
        return list(range(s))
    sinks = min(sinks, keep)
    rest = sorted(range(sinks, s), key=lambda j: -score[j])[: keep - sinks]
    return sorted(set(range(sinks)) | set(rest))


@pytest.mark.parametrize("keep, sinks", [(10, 0), (7, 2), (1, 0), (30, 1)])
def test_kept_indices_match_reference(keep: int, sinks: int) -> None:
    cache = random_cache([[24, 19], [24, 24]], c=24, seed=7, extra_meta=("last_attn", "col_sum"))
    got = TOVA(sinks=sinks).compress(cache, keep)
    for b in range(2):
        for g in range(2):
            s = int(cache.length[b, g])
            want = reference_tova(cache.slot_meta["last_attn"][b, g].tolist(), s, keep, sinks)
            assert live_positions(got, b, g) == want
            torch.testing.assert_close(got.k[b, g, : len(want)], cache.k[b, g, want])


def test_the_last_query_decides_not_the_accumulated_attention() -> None:
    cache = random_cache([[30]], c=30, seed=8, extra_meta=("last_attn", "col_sum"))
    cache.slot_meta["last_attn"][0, 0, 5] = 10.0
    cache.slot_meta["last_attn"][0, 0, 6] = 0.0
    cache.slot_meta["col_sum"][0, 0, 6] = 100.0          # ignored: TOVA does not accumulate
    pos = live_positions(TOVA().compress(cache, 8), 0, 0)
    assert 5 in pos and 6 not in pos


def _group_mean_last_row(model, ids: torch.Tensor, layer: int, group: int) -> torch.Tensor:
    """transformers' eager attention of the last query of ``ids`` in ``layer``, averaged over each KV
    head's query heads: [B, Hkv, T]."""
    out = model(ids, output_attentions=True)
    a = out.attentions[layer][:, :, -1, :]                        # [B, Hq, T]
    return a.reshape(a.shape[0], -1, group, a.shape[-1]).mean(2)


def test_statistic_is_the_newest_querys_attention() -> None:
    model = tiny_model("llama")                                   # Hq 4, Hkv 2
    eager = copy.deepcopy(model)
    eager.config._attn_implementation = "eager"
    ids = torch.randint(1, 128, (2, 10), generator=torch.Generator().manual_seed(1))
    session = kvpass.apply(model, policy="tova", budget=64).start(ids, max_new_tokens=4)   # nothing evicted
    with torch.no_grad():
        for layer in (0, 1):
            got = session.layers[layer].cache.slot_meta[Stat.LAST_ATTENTION.value]
            torch.testing.assert_close(got[..., :10], _group_mean_last_row(eager, ids, layer, 2), atol=1e-6, rtol=1e-5)
        tokens = torch.tensor([5, 7])
        session.step(tokens)                                      # the step's row replaces the prompt's
        longer = torch.cat([ids, tokens[:, None]], 1)
        for layer in (0, 1):
            got = session.layers[layer].cache.slot_meta[Stat.LAST_ATTENTION.value]
            torch.testing.assert_close(got[..., :11], _group_mean_last_row(eager, longer, layer, 2), atol=1e-6,
                                       rtol=1e-5)
            assert float(got[..., 11:].abs().max()) == 0.0


def test_bad_sinks_raise() -> None:
    with pytest.raises(ValueError, match="sinks"):
        get_policy("tova", sinks=1.5)


def test_generates_within_budget_and_differs_from_full(prompt_ids: torch.Tensor) -> None:
    full = apply_cached("llama", "full", 1.0).generate(prompt_ids, max_new_tokens=6, return_dict_in_generate=True,
                                                       output_logits=True)
    out = apply_cached("llama", "tova", 8).generate(prompt_ids, max_new_tokens=6, return_dict_in_generate=True,
                                                    output_logits=True)
    assert out.sequences.shape == (2, prompt_ids.shape[1] + 6)
    logits = torch.stack(out.logits, 1)
    assert torch.isfinite(logits).all()
    report = out.report
    assert report.compressions > 0 and report.layer_budgets == {0: 8, 1: 8}
    assert all(n <= 8 + 1 for n in report.entries.values())
    assert not torch.allclose(logits, torch.stack(full.logits, 1), atol=1e-4)
    whole = apply_cached("llama", "tova", 1.0).generate(prompt_ids, max_new_tokens=6, return_dict_in_generate=True,
                                                        output_logits=True)
    torch.testing.assert_close(torch.stack(whole.logits, 1), torch.stack(full.logits, 1))     # §8.1
