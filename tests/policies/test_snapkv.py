"""SnapKV (docs/policies.md §6.3): the window-score op against a dense float64 loop, and the selection."""

from __future__ import annotations

import pytest
import torch

from kvpass.kernels import attention_window_scores
from kvpass.policies import Stat, get_policy
from kvpass.policies.snapkv import SnapKV
from tests.policies.policy_helpers import check_rows_compress_as_alone, live_positions, random_cache


def reference_window_scores(q, k, pad, scale, w, kernel, pool):
    """Loops over rows, heads and columns in float64; SnapKV's attn[..., -w:, :-w] then zero-padded pooling."""
    b_rows, hq, t, _ = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    out = torch.zeros(b_rows, hkv, t, dtype=torch.float64)
    for b in range(b_rows):
        p0 = int(pad[b])
        n = t - p0
        for g in range(hkv):
            raw = [0.0] * n
            for h in range(g * group, (g + 1) * group):
                for i in range(max(n - w, 0), n):
                    logits = [float(q[b, h, p0 + i].double() @ k[b, g, p0 + j].double()) * scale for j in range(i + 1)]
                    probs = torch.softmax(torch.tensor(logits, dtype=torch.float64), 0)
                    for j in range(max(n - w, 0)):
                        if j <= i:
                            raw[j] += float(probs[j]) / group
            pooled = []
            for j in range(n):
                window = [raw[x] if 0 <= x < n else (0.0 if pool == "avg" else float("-inf"))
                          for x in range(j - kernel // 2, j + kernel // 2 + 1)]
                pooled.append(sum(window) / kernel if pool == "avg" else max(window))
            out[b, g, p0:] = torch.tensor(pooled)
    return out


@pytest.mark.parametrize("pool", ["avg", "max"])
def test_window_scores_op_matches_loop(pool: str) -> None:
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 12, 8, generator=gen), torch.randn(2, 2, 12, 8, generator=gen)
    pad = torch.tensor([0, 3])
    got = attention_window_scores(q, k, pad, 0.35, None, None, obs_window=4, kernel=3, pool=pool)
    want = reference_window_scores(q, k, pad, 0.35, 4, 3, pool)
    # pad columns are 0 in the op (the reference leaves them 0 too); the window columns come out of pooling
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    assert got[1, :, :3].abs().max() == 0


def test_selection_keeps_window_and_top_pooled() -> None:
    cache = random_cache([[40, 40]], c=40, seed=3)
    policy = SnapKV(window=8)
    got = policy.compress(cache, 15)
    for g in range(2):
        score = cache.slot_meta["window_scores"][0, g]
        top = sorted(sorted(range(32), key=lambda j: -float(score[j]))[:7])
        assert live_positions(got, 0, g) == top + list(range(32, 40))
    small = policy.compress(cache, 3)                 # budget below the window: the newest 3 only
    assert live_positions(small, 0, 0) == [37, 38, 39]
    assert torch.isfinite(small.k).all()


def test_stat_options_reach_the_op() -> None:
    opts = SnapKV(window=16, kernel=5, pool="max").stat_options(Stat.WINDOW_SCORES)
    assert opts == {"obs_window": 16, "kernel": 5, "pool": "max"}


@pytest.mark.parametrize("kwargs, name", [({"window": 0}, "window"), ({"kernel": 4}, "kernel"), ({"pool": "x"}, "pool")])
def test_bad_hyperparameters_raise(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        get_policy("snapkv", **kwargs)


@pytest.mark.parametrize("seed", range(3))
def test_rows_of_their_own_budgets_compress_each_as_alone(seed: int) -> None:
    """``compress_rows_into`` with a budget per row (one below the window): a due row ends slot for slot as
    ``compress_into`` leaves it alone; a row not due is left bit for bit."""
    check_rows_compress_as_alone(SnapKV(window=5, interval=4), [10, 3, 8], [[14, 14], [7, 7], [9, 11]],
                                 [True, True, False], "window_scores", seed)
