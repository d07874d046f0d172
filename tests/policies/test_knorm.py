"""Knorm (docs/policies.md §6.9) against a direct loop reference, and generating on a tiny model."""

from __future__ import annotations

import pytest
import torch

from kvpass.policies import get_policy
from kvpass.policies.knorm import Knorm
from tests.policies.policy_helpers import (
    check_budget_8_generation,
    live_positions,
    random_cache,
)


def reference_knorm(keys: torch.Tensor, s: int, keep: int, sinks: int, recent: int = 0) -> list[int]:
    """keys: [s, D] float64 -> kept positions: the sinks, the last ``recent`` (clamped to keep - sinks), then
    the smallest norms among the others, ascending."""
    if s <= keep:
        return list(range(s))
    sinks = min(sinks, keep)
    recent = min(recent, keep - sinks)
    window = set(range(s - recent, s))
    norms = [float(keys[j].norm()) for j in range(s)]
    rest = sorted((j for j in range(sinks, s) if j not in window), key=lambda j: norms[j])[: keep - sinks - recent]
    return sorted(set(range(sinks)) | window | set(rest))


@pytest.mark.parametrize("keep, sinks, recent", [(10, 0, 0), (7, 2, 0), (3, 3, 0), (1, 0, 0), (30, 4, 0),
                                                 (10, 0, 4), (7, 2, 3), (5, 2, 9), (1, 0, 2)])
def test_kept_indices_match_reference(keep: int, sinks: int, recent: int) -> None:
    cache = random_cache([[24, 17], [20, 24]], c=24, d=8, seed=5)
    got = Knorm(sinks=sinks, recent=recent).compress(cache, keep)
    for b in range(2):
        for g in range(2):
            s = int(cache.length[b, g])
            want = reference_knorm(cache.k[b, g, :s].double(), s, keep, sinks, recent)
            assert live_positions(got, b, g) == want
            torch.testing.assert_close(got.k[b, g, : len(want)], cache.k[b, g, want])    # nothing merged
            torch.testing.assert_close(got.v[b, g, : len(want)], cache.v[b, g, want])


def test_key_norms_drive_the_choice() -> None:
    """A huge key leaves and a tiny one stays, whatever the attention statistics say."""
    cache = random_cache([[30]], c=30, seed=6)
    cache.k[0, 0, 5] *= 100.0
    cache.k[0, 0, 6] *= 1e-3
    cache.slot_meta["col_sum"][0, 0, 5] = 100.0         # ignored: Knorm reads no statistic
    pos = live_positions(Knorm(recent=0).compress(cache, 8), 0, 0)
    assert 6 in pos and 5 not in pos and len(pos) == 8


def test_bad_sinks_raise() -> None:
    with pytest.raises(ValueError, match="sinks"):
        get_policy("knorm", sinks=-1)
    with pytest.raises(ValueError, match="recent"):
        get_policy("knorm", recent=-2)


def test_recent_window_keeps_the_newest_even_with_large_norms() -> None:
    """Without ``recent`` (kvpress's rule) the newest (large-norm) keys leave; with it (the default) they stay."""
    cache = random_cache([[30]], c=30, seed=7)
    cache.k[0, 0, 26:] *= 100.0
    assert not set(range(26, 30)) & set(live_positions(Knorm(recent=0).compress(cache, 8), 0, 0))
    assert Knorm().recent == 32 and set(range(22, 30)) == set(live_positions(Knorm().compress(cache, 8), 0, 0))
    assert set(range(26, 30)) <= set(live_positions(Knorm(recent=4).compress(cache, 8), 0, 0))


def test_generates_within_budget_and_differs_from_full(prompt_ids: torch.Tensor) -> None:
    check_budget_8_generation("knorm", prompt_ids, 2, sinks=1, interval=2)
