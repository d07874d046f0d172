"""Shared eviction mechanics (kvpass/policies/selection.py) against direct references."""

from __future__ import annotations

import pytest
import torch

from kvpass.policies.selection import kept_slots, ordered_slots, sort_rank


@pytest.mark.parametrize("seed", range(5))
def test_ordered_slots_is_the_stable_sort_of_set_then_unset_slots(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for c in (1, 2, 7, 33):
        mask = torch.rand(2, 3, c, generator=g) < torch.rand((), generator=g)
        for count in {0, 1, c // 2, c}:
            got = ordered_slots(mask, count)
            for b in range(2):
                for h in range(3):
                    row = mask[b, h].tolist()
                    want = [j for j in range(c) if row[j]] + [j for j in range(c) if not row[j]]
                    assert got[b, h].tolist() == want[:count]


def test_kept_slots_of_all_set_and_none_set() -> None:
    kept = torch.tensor([[[True] * 5, [False] * 5]])
    assert kept_slots(kept, 3).tolist() == [[[0, 1, 2], [0, 1, 2]]]


@pytest.mark.parametrize("descending", [False, True])
def test_sort_rank_is_each_place_in_a_stable_sort(descending: bool) -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 4, (2, 3, 17), generator=g).float()            # many ties
    rank = sort_rank(x, descending=descending)
    for row, got in zip(x.reshape(-1, 17).tolist(), rank.reshape(-1, 17).tolist(), strict=True):
        key = (lambda i, row=row: (-row[i], i)) if descending else (lambda i, row=row: (row[i], i))
        want = [0] * 17
        for place, i in enumerate(sorted(range(17), key=key)):
            want[i] = place
        assert got == want
