"""H2O (docs/policies.md §6.1) against a direct loop reference."""

from __future__ import annotations

import pytest
import torch

from kvpass.policies import get_policy
from kvpass.policies.h2o import H2O
from tests.policies.policy_helpers import live_positions, random_cache


def reference_h2o(acc: list[float], s: int, keep: int, recent_ratio: float) -> list[int]:
    if s <= keep:
        return list(range(s))
    recent = int(keep * recent_ratio)
    heavy = sorted(range(s - recent), key=lambda j: -acc[j])[: keep - recent]
    return sorted(set(heavy) | set(range(s - recent, s)))


@pytest.mark.parametrize("keep, ratio", [(10, 0.5), (7, 0.3), (3, 0.5), (1, 0.5), (25, 0.5)])
def test_kept_indices_match_reference(keep: int, ratio: float) -> None:
    cache = random_cache([[24, 24], [18, 18]], c=24, seed=2)
    got = H2O(recent_ratio=ratio).compress(cache, keep)
    for b in range(2):
        for g in range(2):
            s = int(cache.length[b, g])
            want = reference_h2o(cache.slot_meta["col_sum"][b, g].tolist(), s, keep, ratio)
            assert live_positions(got, b, g) == want
            torch.testing.assert_close(got.k[b, g, : len(want)], cache.k[b, g, want])   # nothing merged
    assert torch.isfinite(got.k).all()


def test_scores_drive_the_choice() -> None:
    """Raising one middle token's score keeps it; a policy ignoring scores would fail."""
    cache = random_cache([[30]], c=30, seed=4)
    cache.slot_meta["col_sum"][0, 0, 5] = 100.0
    cache.slot_meta["col_sum"][0, 0, 6] = -1.0
    pos = live_positions(H2O().compress(cache, 8), 0, 0)
    assert 5 in pos and 6 not in pos and set(range(26, 30)) <= set(pos)


def test_bad_recent_ratio_raises() -> None:
    with pytest.raises(ValueError, match="recent_ratio"):
        get_policy("h2o", recent_ratio=2.0)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("interval", [1, 4])
def test_rows_of_their_own_budgets_compress_each_as_alone(seed: int, interval: int) -> None:
    """``compress_rows_into`` with a budget per row (with sinks, a ratio that does not divide every budget): a due
    row ends slot for slot as ``compress_into`` leaves it alone; a row not due is left bit for bit."""
    from tests.policies.policy_helpers import check_rows_compress_as_alone

    keeps = [10, 5, 8]
    lengths = [[k + interval] * 2 for k in keeps[:2]] + [[8, 8 + interval - 1] if interval > 1 else [7, 8]]
    check_rows_compress_as_alone(H2O(recent_ratio=0.3, sinks=2, interval=interval), keeps, lengths,
                                 [True, True, False], "col_sum", seed)
