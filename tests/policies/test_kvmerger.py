"""KVMerger (docs/policies.md §3): merging sets and Gaussian weights against a float64 loop reference,
budget modes, and generate on every tiny architecture."""

from __future__ import annotations

import math

import pytest
import torch

import kvpass
from kvpass.cache import LayerCache
from kvpass.policies.kvmerger import SIZE, KVMerger
from tests.policies.merging_support import ARCHS, full_output, prompt, tiny_model


def correlated_cache(c=24, d=6, seed=0) -> LayerCache:
    """One row whose keys drift slowly (runs of similar neighbours) with random accumulated attention."""
    g = torch.Generator().manual_seed(seed)
    steps = torch.randn(c, d, generator=g, dtype=torch.float64) * 0.25
    jumps = (torch.rand(c, generator=g) < 0.2).double()[:, None] * torch.randn(c, d, generator=g, dtype=torch.float64) * 3
    k = (steps + jumps).cumsum(0) + torch.tensor([3.0] + [0.0] * (d - 1), dtype=torch.float64)
    v = torch.randn(c, d, generator=g, dtype=torch.float64)
    col = torch.rand(c, generator=g).float() * 5
    return LayerCache(k=k[None, None], v=v[None, None], log_weight=torch.zeros(1, 1, c),
                      length=torch.tensor([[c]]), position=torch.arange(c)[None, None],
                      slot_meta={"col_sum": col[None, None]})


def reference_sets(k, a, protected, eps):
    """Maximal runs of consecutive unprotected positions with adjacent key cosine > eps (§3.4 step 4)."""
    sets, cur = [], []
    for j in range(len(a)):
        if protected[j]:
            if cur:
                sets.append(cur)
            cur = []
            continue
        if cur and float(k[j] @ k[j - 1]) / (float(k[j].norm()) * float(k[j - 1].norm()) + 1e-6) > eps:
            cur.append(j)
        else:
            if cur:
                sets.append(cur)
            cur = [j]
    if cur:
        sets.append(cur)
    return [s for s in sets if len(s) >= 2]


def test_merging_sets_pivots_and_gaussian_weights_match_reference():
    pol = KVMerger(epsilon=0.9, recent_ratio=0.17, heavy_ratio=0.12, sigma=1.0, budget_mode="adaptive")
    cache = correlated_cache()
    c = cache.capacity
    plan = pol.plan(cache, keep=c)                                         # keep = c: links above epsilon only
    k, a = cache.k[0, 0], cache.slot_meta["col_sum"][0, 0]
    n_r, n_h = math.ceil(0.17 * c), math.ceil(0.12 * c)
    recent = set(range(c - n_r, c))
    heavy = set(sorted((j for j in range(c) if j not in recent), key=lambda j: -float(a[j]))[:n_h])
    protected = [j in recent or j in heavy for j in range(c)]
    assert plan.protected[0, 0].tolist() == protected
    sets = reference_sets(k, a, protected, 0.9)
    assert sets, "the case must contain merging sets"
    got = {}
    for j in range(c):
        if int(plan.size[0, 0, j]) > 1:
            got.setdefault(int(plan.set_id[0, 0, j]), []).append(j)
    assert sorted(got.values()) == sets
    for s in sets:
        p = max(s, key=lambda j: (float(a[j]), -j))
        g = [math.exp(-float(((k[p] - k[j]) ** 2).sum()) / 2.0) for j in s]
        assert all(int(plan.pivot[0, 0, j]) == p for j in s)
        assert plan.gauss[0, 0, s].tolist() == pytest.approx(g, rel=1e-5)


def test_compress_merges_keys_and_values_per_spec():
    pol = KVMerger(epsilon=0.9, sigma=1.0, budget_mode="adaptive")
    cache = correlated_cache()
    c = cache.capacity
    plan = pol.plan(cache, keep=c)
    out = pol.compress(cache, keep=c - 1)                                   # forces compression
    k, v = cache.k[0, 0], cache.v[0, 0]
    sets = {}
    for j in range(c):
        if int(plan.size[0, 0, j]) > 1:
            sets.setdefault(int(plan.pivot[0, 0, j]), []).append(j)
    removed = sum(len(s) - 1 for s in sets.values())
    assert int(out.length) == c - removed <= c - 1
    pos = out.position[0, 0].tolist()
    for p, s in sets.items():
        g = torch.tensor([math.exp(-float(((k[p] - k[j]) ** 2).sum()) / 2.0) for j in s], dtype=torch.float64)
        w = g / g.sum()
        i = pos.index(p)                                                   # the merged entry at the pivot's place
        torch.testing.assert_close(out.k[0, 0, i], (w[:, None] * k[s]).sum(0), rtol=1e-5, atol=1e-6)  # fp32 weights (§0.7)
        torch.testing.assert_close(out.v[0, 0, i], len(s) * (w[:, None] * v[s]).sum(0), rtol=1e-5, atol=1e-6)
        assert float(out.slot_meta[SIZE][0, 0, i]) == len(s)
        assert float(out.log_weight[0, 0, i]) == 0.0                       # plain attention (§3.7)
    assert pos[:int(out.length)] == sorted(pos[:int(out.length)])


def test_strict_mode_reaches_the_budget_exactly():
    cache = correlated_cache(seed=1)
    for keep in (20, 14, 8):
        out = KVMerger(budget_mode="strict").compress(cache, keep)
        assert int(out.length) == keep
    none = KVMerger(value_scale="none", budget_mode="strict").compress(cache, 14)
    assert float(none.log_weight[0, 0, :14].max()) > 0                      # log|S| bias instead of |S| values


def overflowing_cache(c=96, d=8, seed=0) -> LayerCache:
    """One row whose protected entries (scaled to fill keep) and merge pivots together exceed keep: runs of
    near-identical keys separated by jumps, random accumulated attention."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(c // 8, d, generator=g, dtype=torch.float64).repeat_interleave(8, 0)
    k = base + 0.01 * torch.randn(c, d, generator=g, dtype=torch.float64)
    v = torch.randn(c, d, generator=g, dtype=torch.float64)
    col = torch.rand(c, generator=g).float() * 5
    return LayerCache(k=k[None, None], v=v[None, None], log_weight=torch.zeros(1, 1, c),
                      length=torch.tensor([[c]]), position=torch.arange(c)[None, None],
                      slot_meta={"col_sum": col[None, None]})


@pytest.mark.parametrize("value_scale", ["none", "set_size"])
def test_overflow_tiered_keeps_the_protected_entries(value_scale):
    cache = overflowing_cache()
    c, keep = cache.capacity, 12                                # protected: ceil(.17c) + ceil(.12c) = 45 > keep
    old = KVMerger(value_scale=value_scale, overflow="slot_order")
    plan = old.plan(cache, keep)
    protected = plan.protected[0, 0]
    pivots = (plan.size > 1) & (plan.pivot == torch.arange(c))
    assert int(protected.sum()) + int((pivots & ~plan.protected).sum()) > keep    # the case overflows
    # "slot_order" (the old default): protected entries and pivots tie; the last slots go, the newest tokens too
    kept_old = set(old.compress(cache, keep).position[0, 0, :keep].tolist())
    assert c - 1 not in kept_old
    # "tiered" (the default): every protected entry stays, the rest of keep goes to the pivots of highest col_sum
    assert KVMerger().overflow == "tiered"
    out = KVMerger(value_scale=value_scale).compress(cache, keep)
    assert int(out.length) == keep
    kept = set(out.position[0, 0, :keep].tolist())
    want_protected = {j for j in range(c) if protected[j]}
    assert want_protected <= kept and c - 1 in kept
    col = cache.slot_meta["col_sum"][0, 0]
    set_id = plan.set_id[0, 0]
    set_col = {int(p): float(col[set_id == set_id[p]].sum()) for p in torch.nonzero(pivots[0, 0] & ~protected).flatten()}
    best = sorted(set_col, key=lambda p: -set_col[p])[:keep - len(want_protected)]
    assert kept - want_protected == set(best)


def test_bad_hyperparameters_raise():
    for kwargs in ({"epsilon": 2.0}, {"recent_ratio": 1.0}, {"sigma": 0.0}, {"sigma_mode": "x"},
                   {"value_scale": "x"}, {"budget_mode": "x"}, {"overflow": "x"}):
        with pytest.raises(ValueError):
            KVMerger(**kwargs)


@pytest.mark.parametrize("arch", ARCHS)
def test_generate_within_budget(arch):
    model = tiny_model(arch)
    km = kvpass.apply(model, policy="kvmerger", budget=32, interval=8)
    out = km.generate(prompt(2, 80), max_new_tokens=12, eos_token_id=[])
    assert out.shape == (2, 92)
    report = km.last_report
    for layer, budget in report.layer_budgets.items():
        assert budget == 32 and report.entries[layer] <= budget + 8


def test_budget_changes_output_and_large_budget_is_exact():
    model = tiny_model("llama")
    ids = prompt(1, 80)
    full = full_output("llama", 1, 80, 16)
    big = kvpass.apply(model, policy="kvmerger", budget=1.0).generate(ids, max_new_tokens=16, eos_token_id=[])
    small = kvpass.apply(model, policy="kvmerger", budget=24, interval=8).generate(ids, max_new_tokens=16, eos_token_id=[])
    assert torch.equal(big, full)
    assert not torch.equal(small, full)
