"""AdaKV head-adaptive budgets: the joint selection against a plain loop, the wrapper on random caches,
and generation on a tiny model."""

from __future__ import annotations

import pytest
import torch

from kvpass.cli import parse_policy_args
from kvpass.policies import get_policy
from kvpass.policies.adakv import AdaKV
from kvpass.policies.h2o import H2O
from kvpass.policies.head_budgets import head_cap, select_kept_across_heads
from kvpass.policies.snapkv import SnapKV
from tests.policies.policy_helpers import apply_cached, live_positions, random_cache


def reference_kept(priority: torch.Tensor, keep: int, floor: int, cap: int) -> set[tuple[int, int, int]]:
    """(b, g, slot) kept: per row, each head's top `floor` live slots, then a greedy pick over all the row's
    live slots by descending priority (ties: head, then slot, lower first... but no ties in the tests),
    skipping heads that already hold `cap`, until the row holds H * keep."""
    out = set()
    b_rows, hkv, c = priority.shape
    for b in range(b_rows):
        held = {g: [] for g in range(hkv)}
        for g in range(hkv):
            live = [(float(priority[b, g, j]), j) for j in range(c) if priority[b, g, j] > float("-inf")]
            held[g] = [j for _, j in sorted(live, key=lambda x: (-x[0], x[1]))[:floor]]
        rest = sorted(((float(priority[b, g, j]), g, j) for g in range(hkv) for j in range(c)
                       if priority[b, g, j] > float("-inf") and j not in held[g]), key=lambda x: (-x[0], x[1], x[2]))
        total = sum(map(len, held.values()))
        for _, g, j in rest:
            if total == hkv * keep:
                break
            if len(held[g]) < cap:
                held[g].append(j)
                total += 1
        out |= {(b, g, j) for g in held for j in held[g]}
    return out


def random_priority(lengths: list[list[int]], c: int, protected: int, seed: int) -> torch.Tensor:
    """[B, H, C] fp64: distinct random scores with heads on different scales (so budgets move between heads),
    +inf on each row's newest `protected` slots, -inf past its length."""
    gen = torch.Generator().manual_seed(seed)
    b, h = len(lengths), len(lengths[0])
    scale = torch.logspace(0, 1, h, dtype=torch.float64)[None, :, None]
    p = torch.rand(b, h, c, generator=gen, dtype=torch.float64) ** 3 * scale
    j = torch.arange(c)
    n = torch.tensor(lengths)[..., None]
    p = torch.where(j >= n - protected, float("inf"), p)
    return torch.where(j < n, p, float("-inf"))


@pytest.mark.parametrize("lengths, c, keep, floor, cap, protected", [
    ([[40, 40, 40]], 40, 8, 1, 22, 2),          # AdaKV's cap: H * keep - (H - 1) * floor
    ([[40, 33, 40], [40, 40, 12]], 40, 8, 2, 12, 0),   # a binding cap, ragged rows, a short head
    ([[30, 30]], 32, 10, 0, 20, 3),             # no floor
    ([[5, 6]], 8, 10, 2, 18, 1),                # the row holds fewer than H * keep: everything stays
])
def test_joint_selection_matches_the_loop(lengths, c, keep, floor, cap, protected) -> None:
    prio = random_priority(lengths, c, protected, seed=len(lengths) * c + keep)
    kept = select_kept_across_heads(prio, keep, floor, cap)
    got = {tuple(i) for i in kept.nonzero().tolist()}
    assert got == reference_kept(prio, keep, floor, cap)
    per_head = kept.sum(-1)
    live = (prio > float("-inf")).sum(-1)
    want_total = torch.minimum(torch.tensor(len(lengths[0]) * keep), torch.minimum(live, torch.tensor(cap)).sum(-1))
    assert torch.equal(per_head.sum(-1), want_total)                                   # the layer's budget
    assert bool((per_head >= torch.minimum(live, torch.tensor(floor))).all())          # the floor
    assert bool((per_head <= cap).all())                                               # the cap
    assert bool(kept[prio == float("inf")].all())                                      # protected slots stay


def test_budgets_move_between_heads() -> None:
    prio = random_priority([[64, 64, 64]], 64, 0, seed=5)
    per_head = select_kept_across_heads(prio, 10, 2, head_cap(10, 3, 2, None)).sum(-1)[0].tolist()
    assert sum(per_head) == 30 and len(set(per_head)) > 1 and min(per_head) >= 2


@pytest.mark.parametrize("inner", [SnapKV(window=4), H2O()])
def test_wrapper_keeps_the_reference_set(inner) -> None:
    cache = random_cache([[50, 50, 50], [50, 41, 50]], c=50, seed=3)
    policy = AdaKV(inner=inner, alpha=0.25)
    keep = 12
    out = policy.compress(cache, keep)
    want = reference_kept(inner.priority(cache, keep), keep, 3, head_cap(keep, 3, 3, None))
    for b in range(2):
        for g in range(3):
            assert live_positions(out, b, g) == sorted(j for (bb, gg, j) in want if (bb, gg) == (b, g))
            n = int(out.length[b, g])
            torch.testing.assert_close(out.k[b, g, :n], cache.k[b, g, live_positions(out, b, g)])
    assert out.length.sum(-1).tolist() == [36, 36]
    assert len(set(out.length[0].tolist())) > 1                       # not the uniform split


def test_max_share_caps_a_head() -> None:
    cache = random_cache([[60, 60, 60]], c=60, seed=8)
    cache.slot_meta["window_scores"][0, 0] *= 100.0                     # head 0 would take nearly everything
    free = AdaKV(inner=SnapKV(window=2)).compress(cache, 10)
    capped = AdaKV(inner=SnapKV(window=2), max_share=1.5).compress(cache, 10)
    assert int(free.length[0, 0]) > 15 and int(capped.length[0, 0]) == 15
    assert int(capped.length.sum()) == 30


def test_registry_and_cli_arguments_reach_it() -> None:
    policy = get_policy("adakv", **parse_policy_args(["inner=h2o", "alpha=0.5", "max_share=2"]))
    assert isinstance(policy.inner, H2O) and policy.alpha == 0.5 and policy.max_share == 2
    assert policy.stats == H2O.stats and policy.interval == H2O().interval
    assert policy.head_capacity(100, 4) == 200
    for bad in (dict(inner="d2o"), dict(alpha=1.5), dict(max_share=0.5)):
        with pytest.raises(ValueError):
            get_policy("adakv", **bad)


@pytest.mark.parametrize("inner", ["snapkv", "h2o", "pyramidkv"])
def test_generate_on_a_tiny_model(inner: str, prompt_ids: torch.Tensor) -> None:
    kw = {"window": 4} if inner != "h2o" else {}
    plain = apply_cached("llama", inner, 10, **kw)
    want = plain.generate(prompt_ids, max_new_tokens=12, do_sample=False)
    # alpha = 1: every head's floor is the whole budget, so AdaKV is the inner policy, token for token
    uniform = apply_cached("llama", "adakv", 10, inner=get_policy(inner, **kw), alpha=1.0)
    assert torch.equal(uniform.generate(prompt_ids, max_new_tokens=12, do_sample=False), want)
    ada = apply_cached("llama", "adakv", 10, inner=get_policy(inner, **kw))
    assert ada.generate(prompt_ids, max_new_tokens=12, do_sample=False).shape == want.shape
    session, ref = ada.start(prompt_ids, max_new_tokens=12), plain.start(prompt_ids, max_new_tokens=12)
    # after the prompt's compression the heads hold different counts, the inner policy's the same
    assert any(bool((lay.cache.length != lay.cache.length[:, :1]).any()) for lay in session.layers)
    assert all(bool((lay.cache.length == lay.cache.length[:, :1]).all()) for lay in ref.layers)
    interval = ada.policy.interval
    for _ in range(11):                        # decode-time compressions under the layer's shared budget
        session.step(session.logits.argmax(-1))
        for lay in session.layers:
            n = lay.cache.length
            assert bool((n.sum(-1) <= 2 * (10 + interval)).all())                       # the layer's budget
            assert int(n.max()) <= lay.cache.capacity == min(ada.policy.head_capacity(lay.budget, n.shape[1]) + interval, 36)
