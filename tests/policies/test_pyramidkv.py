"""PyramidKV (docs/policies.md §6.5): per-layer budgets against the spec's formula, total conserved."""

from __future__ import annotations

import pytest

from kvpass.policies import get_policy
from kvpass.policies.pyramidkv import PyramidKV
from tests.policies.policy_helpers import random_cache


def reference_budgets(c: int, w: int, n: int, n_layers: int, beta: float) -> list[int]:
    """The spec's integer recipe, then the excess removed one entry at a time from layer 0 on."""
    if c <= w or n < c or n < 2 * (c - w):
        return [c] * n_layers
    min_num = int((c - w) // beta)
    max_num = 2 * (c - w) - min_num
    if max_num >= n - w:
        max_num = n - w
        min_num = 2 * (c - w) - max_num
    step = (max_num - min_num) // (n_layers - 1)
    caps = [w + max_num - layer * step for layer in range(n_layers)]
    i = 0
    while sum(caps) > n_layers * c:
        caps[i % n_layers] -= 1
        i += 1
    return caps


@pytest.mark.parametrize("c, w, n, layers", [(64, 32, 400, 8), (100, 8, 300, 5), (40, 8, 60, 4), (20, 8, 200, 3),
                                             (10, 32, 100, 4), (90, 8, 100, 4)])
def test_layer_budgets_match_spec(c: int, w: int, n: int, layers: int) -> None:
    caches = [random_cache([[n]], c=n, d=2) for _ in range(layers)]
    got = PyramidKV(window=w).layer_budgets(c, caches)
    assert got == reference_budgets(c, w, n, layers, 20.0)
    assert sum(got) == layers * c
    assert got == sorted(got, reverse=True)               # decreasing with depth


def test_pyramid_is_not_flat() -> None:
    caches = [random_cache([[400]], c=400, d=2) for _ in range(8)]
    got = PyramidKV(window=32).layer_budgets(64, caches)
    assert got[0] > 64 > got[-1]


def test_bad_beta_raises() -> None:
    with pytest.raises(ValueError, match="beta"):
        get_policy("pyramidkv", beta=0.5)
