"""KeyDiff (§6.12) against a loop reference in float64: each row keeps its sinks, its recent window and the keys
least similar to its mean unit key; a key turned away from the rest is kept; generation on a tiny model."""

from __future__ import annotations

import pytest
import torch

from kvpass.policies import get_policy
from kvpass.policies.keydiff import KeyDiff
from tests.policies.policy_helpers import (
    apply_cached,
    check_budget_8_generation,
    live_positions,
    random_cache,
)


def reference_kept(cache, keep: int, sinks: int, recent: int) -> dict[tuple[int, int], list[int]]:
    """Per (b, g): the positions a row keeps, computed one row at a time in float64."""
    out = {}
    b, h = cache.length.shape
    for bi in range(b):
        for g in range(h):
            n = int(cache.length[bi, g])
            k = cache.k[bi, g, :n].double()
            if n <= keep:
                out[(bi, g)] = list(range(n))
                continue
            unit = k / k.norm(dim=-1, keepdim=True).clamp(min=1e-12)
            anchor = unit.sum(0) / unit.sum(0).norm().clamp(min=1e-12)
            score = -(unit @ anchor)
            s, r = min(sinks, keep), min(recent, keep - min(sinks, keep))
            forced = set(range(s)) | set(range(n - r, n))
            rest = sorted((j for j in range(n) if j not in forced), key=lambda j: -float(score[j]))
            out[(bi, g)] = sorted(forced | set(rest[:keep - len(forced)]))
    return out


@pytest.mark.parametrize("sinks, recent", [(4, 32), (0, 0), (2, 3)])
@pytest.mark.parametrize("seed", range(3))
def test_compress_keeps_what_the_loop_reference_keeps(sinks: int, recent: int, seed: int) -> None:
    policy = KeyDiff(sinks=sinks, recent=recent)
    cache = random_cache([[40, 25, 12], [33, 40, 7]], c=40, d=8, seed=seed)
    keep = 10
    got = policy.compress(cache, keep)
    for (b, g), want in reference_kept(cache, keep, sinks, recent).items():
        assert live_positions(got, b, g) == want, (b, g)


def test_a_key_turned_away_from_the_others_stays() -> None:
    """The score is the policy's input: the entry whose key points opposite the row's mean is kept, and the
    same entry with a key like the others' is not (so a policy ignoring its keys fails here)."""
    policy = KeyDiff(sinks=0, recent=0)
    cache = random_cache([[30]], c=30, d=8, seed=5)
    cache.k[0, 0] = cache.k[0, 0, :1] + 0.05 * cache.k[0, 0]          # every key close to the first
    assert 17 not in live_positions(policy.compress(cache, 5), 0, 0)
    cache.k[0, 0, 17] = -cache.k[0, 0, 0]
    assert 17 in live_positions(policy.compress(cache, 5), 0, 0)


def test_options_are_checked() -> None:
    for bad in (dict(sinks=-1), dict(recent=1.5)):
        with pytest.raises(ValueError, match="keydiff: "):
            get_policy("keydiff", **bad)


def test_generates_within_its_budget(prompt_ids: torch.Tensor) -> None:
    check_budget_8_generation("keydiff", prompt_ids, 2, sinks=1, recent=2, interval=2)


def test_query_agnostic_prompt_compression() -> None:
    """No statistic: the rewritten prefill emits none for it, and its decode step returns no scores."""
    kv = apply_cached("llama", "keydiff", 0.5)
    assert kv.graphs.prefill_stats == () and kv.graphs.decode_scores == ()
