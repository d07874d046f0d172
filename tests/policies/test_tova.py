"""TOVA (docs/policies.md §6.10): the kept entries against a loop reference, the last-query statistic
against transformers' own attention (prefill and after a decode step), and generating on a tiny model."""

from __future__ import annotations

import copy

import pytest
import torch

import kvpass
from kvpass.cache import entries_from_prompt
from kvpass.policies import get_policy
from kvpass.policies.base import Stat
from kvpass.policies.tova import TOVA
from tests.conftest import tiny_model
from tests.policies.policy_helpers import (
    check_budget_8_generation,
    live_positions,
    random_cache,
)


def reference_tova(score: list[float], s: int, keep: int, sinks: int) -> list[int]:
    if s <= keep:
        return list(range(s))
    sinks = min(sinks, keep)
    rest = sorted(range(sinks, s), key=lambda j: -score[j])[: keep - sinks]
    return sorted(set(range(sinks)) | set(rest))


@pytest.mark.parametrize("keep, sinks", [(10, 0), (7, 2), (1, 0), (30, 1)])
def test_kept_indices_match_reference_layer_mean(keep: int, sinks: int) -> None:
    """Default ("layer"): every head of a row keeps the top entries of the mean over the layer's heads."""
    cache = random_cache([[24, 24, 24], [19, 19, 19]], c=24, seed=7, extra_meta=("last_attn", "col_sum"))
    got = TOVA(sinks=sinks).compress(cache, keep)
    for b in range(2):
        s = int(cache.length[b, 0])
        mean = cache.slot_meta["last_attn"][b].double().mean(0).tolist()
        want = reference_tova(mean, s, keep, sinks)
        for g in range(3):
            assert live_positions(got, b, g) == want
            torch.testing.assert_close(got.k[b, g, : len(want)], cache.k[b, g, want])
        heads = [reference_tova(cache.slot_meta["last_attn"][b, g].tolist(), s, keep, sinks) for g in range(3)]
        if keep < s:
            assert any(h != want for h in heads)          # the per-head choices differ: the test can tell them apart


@pytest.mark.parametrize("keep, sinks", [(10, 0), (7, 2), (1, 0), (30, 1)])
def test_kept_indices_match_reference_per_group(keep: int, sinks: int) -> None:
    cache = random_cache([[24, 19], [24, 24]], c=24, seed=7, extra_meta=("last_attn", "col_sum"))
    got = TOVA(sinks=sinks, score_heads="group").compress(cache, keep)
    for b in range(2):
        for g in range(2):
            s = int(cache.length[b, g])
            want = reference_tova(cache.slot_meta["last_attn"][b, g].tolist(), s, keep, sinks)
            assert live_positions(got, b, g) == want
            torch.testing.assert_close(got.k[b, g, : len(want)], cache.k[b, g, want])


def reference_prefill_selection(q: torch.Tensor, k: torch.Tensor, keep: int, sinks: int = 0) -> list[int]:
    """TOVA's prefill choice from the paper, in float64: the last query's softmax attention over every
    key of the prompt (itself included), in each query head, averaged over all heads of the layer; keep
    the ``keep`` highest (and the first ``sinks``). q: [Hq, n, D], k: [Hkv, n, D] (query head h reads KV
    head h // G) -> kept positions, ascending."""
    hq, n, d = q.shape
    group = hq // k.shape[0]
    keys = k.double().repeat_interleave(group, dim=0)                  # [Hq, n, D]
    logits = (keys @ q[:, -1].double()[:, :, None])[..., 0] / d ** 0.5  # [Hq, n]
    attention = torch.softmax(logits, dim=-1).mean(0)                    # [n]
    return reference_tova(attention.tolist(), n, keep, sinks)


@pytest.mark.parametrize("seed", range(4))
def test_prefill_selection_matches_float64_reference(seed: int) -> None:
    """The statistic op the prefill graph runs for TOVA, then ``compress``, on random q, k (two rows, the
    second left-padded) against the float64 reference."""
    gen = torch.Generator().manual_seed(seed)
    b, hq, hkv, t, d, keep = 2, 6, 2, 40, 16, 9
    q = torch.randn(b, hq, t, d, generator=gen) * 2
    k = torch.randn(b, hkv, t, d, generator=gen)
    pad = torch.tensor([0, 7])
    policy = TOVA(sinks=seed % 2)
    scores = torch.ops.kvpass.attention_window_scores(q, k, pad, d ** -0.5, **policy.stat_options(Stat.LAST_ATTENTION))
    cache = entries_from_prompt(k, k.clone(), pad, {Stat.LAST_ATTENTION.value: scores})
    got = policy.compress(cache, keep)
    for row in range(b):
        real = slice(int(pad[row]), t)
        want = reference_prefill_selection(q[row, :, real], k[row, :, real], keep, policy.sinks)
        for g in range(hkv):
            assert live_positions(got, row, g) == want


def test_the_last_query_decides_not_the_accumulated_attention() -> None:
    cache = random_cache([[30]], c=30, seed=8, extra_meta=("last_attn", "col_sum"))
    cache.slot_meta["last_attn"][0, 0, 5] = 10.0
    cache.slot_meta["last_attn"][0, 0, 6] = 0.0
    cache.slot_meta["col_sum"][0, 0, 6] = 100.0          # ignored: TOVA does not accumulate
    for policy in (TOVA(), TOVA(score_heads="group")):
        pos = live_positions(policy.compress(cache, 8), 0, 0)
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


def test_the_token_the_last_query_attends_most_is_kept_in_every_head() -> None:
    """A tiny random Llama (Hq 4, Hkv 2): in each layer, the prompt token (other than the last) with the
    highest last-query attention averaged over all query heads, the needle's role, is among the 3
    entries every KV head keeps. The prompt is chosen so that one KV group alone ranks that token
    below its own top 3: the per-group rule (``score_heads="group"``) drops it from that head."""
    model = tiny_model("llama")
    eager = copy.deepcopy(model)
    eager.config._attn_implementation = "eager"
    ids = torch.randint(1, 128, (1, 16), generator=torch.Generator().manual_seed(6))
    keep = 3
    with torch.no_grad():
        attentions = eager(ids, output_attentions=True).attentions
    kept = {}
    for score_heads in ("layer", "group"):
        kv = kvpass.apply(model, policy="tova", budget=keep, score_heads=score_heads)
        session = kv.start(ids, max_new_tokens=1)
        kept[score_heads] = [session.layers[layer].cache.position[0] for layer in (0, 1)]
    for layer in (0, 1):
        last_row = attentions[layer][0, :, -1, :].double()             # [Hq, n]
        needle = int(last_row[:, :-1].mean(0).argmax())
        per_group = last_row.reshape(2, 2, -1).mean(1)                   # [Hkv, n]
        assert max(int((row > row[needle]).sum()) for row in per_group) >= keep   # some group ranks it low
        assert all(needle in head.tolist() for head in kept["layer"][layer])
        assert not all(needle in head.tolist() for head in kept["group"][layer])


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError, match="sinks"):
        get_policy("tova", sinks=1.5)
    with pytest.raises(ValueError, match="score_heads"):
        get_policy("tova", score_heads="head")


def test_generates_within_budget_and_differs_from_full(prompt_ids: torch.Tensor) -> None:
    check_budget_8_generation("tova", prompt_ids, 1)
