"""kvpass/cache.py's row operations: take_rows / put_rows_at with per-row state of another width."""

from __future__ import annotations

import torch

from kvpass.cache import put_rows_at, take_rows
from tests.policies.policy_helpers import random_cache


def test_put_rows_at_widens_per_row_state_with_zeros():
    """Rows whose per-row state is wider (EMS's slot table follows a row's budget) widen the destination's
    state; narrower ones are padded with zeros; every row keeps its own values."""
    dst = random_cache([[6, 5], [4, 6], [6, 6]], c=6, seed=1)
    dst.state["table"] = torch.arange(3 * 2 * 4).reshape(3, 2, 4)
    wide = take_rows(dst, [1])
    wide.state["table"] = torch.full((1, 2, 7), -5)
    put_rows_at(dst, wide, [1])
    assert dst.state["table"].shape == (3, 2, 7)
    assert dst.state["table"][1].tolist() == [[-5] * 7] * 2
    assert dst.state["table"][0].tolist() == [[0, 1, 2, 3, 0, 0, 0], [4, 5, 6, 7, 0, 0, 0]]
    narrow = take_rows(dst, [2])
    narrow.state["table"] = torch.full((1, 2, 2), 9)
    put_rows_at(dst, narrow, [2])
    assert dst.state["table"].shape == (3, 2, 7)
    assert dst.state["table"][2].tolist() == [[9, 9, 0, 0, 0, 0, 0]] * 2
