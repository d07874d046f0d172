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


def reference_knorm(keys: torch.Tensor, s: int, keep: int, sinks: int) -> list[int]:
    """keys: [s, D] float64 -> kept positions: the sinks, then the smallest norms, ascending."""
    if s <= keep:
        return list(range(s))
    sinks = min(sinks, keep)
    norms = [float(keys[j].norm()) for j in range(s)]
    rest = sorted(range(sinks, s), key=lambda j: norms[j])[: keep - sinks]
    return sorted(set(range(sinks)) | set(rest))


@pytest.mark.parametrize("keep, sinks", [(10, 0), (7, 2), (3, 3), (1, 0), (30, 4)])
def test_kept_indices_match_reference(keep: int, sinks: int) -> None:
    cache = random_cache([[24, 17], [20, 24]], c=24, d=8, seed=5)
    got = Knorm(sinks=sinks).compress(cache, keep)
    for b in range(2):
        for g in range(2):
            s = int(cache.length[b, g])
            want = reference_knorm(cache.k[b, g, :s], s, keep, sinks)
            assert live_positions(got, b, g) == want
            torch.testing.assert_close(got.k[b, g, : len(want)], cache.k[b, g, want])    # nothing merged
            torch.testing.assert_close(got.v[b, g, : len(want)], cache.v[b, g, want])


def test_key_norms_drive_the_choice() -> None:
    """A huge key leaves and a tiny one stays, whatever the attention statistics say."""
    cache = random_cache([[30]], c=30, seed=6)
    cache.k[0, 0, 5] *= 100.0
    cache.k[0, 0, 6] *= 1e-3
    cache.slot_meta["col_sum"][0, 0, 5] = 100.0         # ignored: Knorm reads no statistic
    pos = live_positions(Knorm().compress(cache, 8), 0, 0)
    assert 6 in pos and 5 not in pos and len(pos) == 8


def test_bad_sinks_raise() -> None:
    with pytest.raises(ValueError, match="sinks"):
        get_policy("knorm", sinks=-1)


def test_generates_within_budget_and_differs_from_full(prompt_ids: torch.Tensor) -> None:
    check_budget_8_generation("knorm", prompt_ids, 2, sinks=1, interval=2)
