"""EMS planning blocks (docs/policies.md §4.3, §4.6) against float64 loop references, and the §8.3
property: a centre holding identical merged tokens reproduces full attention in the expanded form."""

from __future__ import annotations

import math

import pytest
import torch

from kvpass.policies.ems_plan import (
    CENTER,
    EVICTED,
    LOCAL,
    TBM,
    destinations,
    global_local_score,
    merge_into_centers,
    partition,
)


def test_global_local_score_matches_loops():
    g = torch.Generator().manual_seed(0)
    c = 20
    glo, loc = torch.rand(1, 1, c, generator=g) * 3, torch.rand(1, 1, c, generator=g)
    live = torch.arange(c)[None, None] < 18
    cand = torch.arange(c)[None, None] < 14
    got = global_local_score(glo, loc, cand, live)[0, 0]
    factor = float(loc[0, 0, :18].sum()) / float(glo[0, 0, :18].sum())
    gl = [max(float(glo[0, 0, j]) * factor, float(loc[0, 0, j])) if j < 14 else 0.0 for j in range(c)]
    for j in range(c):
        if j >= 14:
            assert got[j] == float("-inf")
            continue
        window = [gl[i] if 0 <= i < c else 0.0 for i in range(j - 3, j + 4)]
        assert float(got[j]) == pytest.approx(sum(window) / 7, rel=1e-5)


def test_partition_destinations_and_merge_match_loops():
    g = torch.Generator().manual_seed(1)
    c, d = 16, 4
    base = torch.randn(4, d, generator=g, dtype=torch.float64)
    k = base[torch.arange(c) % 4] + 0.3 * torch.randn(c, d, generator=g, dtype=torch.float64)
    v = base[torch.arange(c) % 4].flip(-1) + 0.3 * torch.randn(c, d, generator=g, dtype=torch.float64)
    s_hat = torch.rand(c, generator=g, dtype=torch.float64)
    local = torch.arange(c) >= 13
    cand = ~local
    s_hat = s_hat.masked_fill(local, float("-inf"))
    cls = partition(s_hat[None, None], cand[None, None], local[None, None], n_imp=3, n_tbm=6)[0, 0]
    ranked = sorted(range(13), key=lambda j: (-float(s_hat[j]), j))
    assert [j for j in range(c) if cls[j] == CENTER] == sorted(ranked[:3])
    assert [j for j in range(c) if cls[j] == TBM] == sorted(ranked[3:9])
    assert [j for j in range(c) if cls[j] == EVICTED] == sorted(ranked[9:])
    assert all(cls[j] == LOCAL for j in range(13, c))
    tau = 0.3
    dest, _ = destinations(k[None, None], v[None, None], cls[None, None], tau)
    centres = ranked[:3]

    def cos(a, b):
        return float(a @ b) / (float(a.norm()) * float(b.norm()) + 1e-6)

    want = {}
    for i in range(c):
        if cls[i] != TBM:
            assert int(dest[0, 0, i]) == -1
            continue
        best = max(sorted(centres), key=lambda dd: cos(k[i], k[dd]) * cos(v[i], v[dd]))
        r = cos(k[i], k[best]) * cos(v[i], v[best])
        want[i] = best if r >= tau else -1
        assert int(dest[0, 0, i]) == want[i]
    assert any(x >= 0 for x in want.values()) and any(x < 0 for x in want.values())   # both outcomes occur
    merged = merge_into_centers(k[None, None], v[None, None], s_hat[None, None], cls[None, None], dest)
    for dd in centres:
        members = [dd] + [i for i, t in want.items() if t == dd]
        w = torch.tensor([float(s_hat[j]) for j in members], dtype=torch.float64)
        w = w / w.sum()
        kh = sum(w[n] * k[j] / k[j].norm() for n, j in enumerate(members))
        torch.testing.assert_close(merged.khat[0, 0, dd], kh / kh.norm(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(merged.vent[0, 0, dd], sum(w[n] * v[j] for n, j in enumerate(members)))
        for j in members:
            assert int(merged.entry[0, 0, j]) == dd
            assert float(merged.knorm[0, 0, j]) == pytest.approx(float(k[j].norm()))


def test_identical_merged_tokens_reproduce_full_attention():
    """§8.3: tokens identical to their centre, expanded through the slot table, give full attention."""
    g = torch.Generator().manual_seed(2)
    d = 8
    uniq_k, uniq_v = torch.randn(3, d, generator=g, dtype=torch.float64), torch.randn(3, d, generator=g, dtype=torch.float64)
    assign = torch.tensor([0, 1, 2, 0, 0, 1])                        # slots 0-2 centres, 3-5 copies
    k, v = uniq_k[assign], uniq_v[assign]
    cls = torch.tensor([CENTER] * 3 + [TBM] * 3)
    s_hat = torch.rand(6, generator=g, dtype=torch.float64) + 0.1
    dest, _ = destinations(k[None, None], v[None, None], cls[None, None], tau=0.99)
    assert dest[0, 0, 3:].tolist() == [0, 0, 1]
    m = merge_into_centers(k[None, None], v[None, None], s_hat[None, None], cls[None, None], dest)
    q = torch.randn(d, generator=g, dtype=torch.float64)
    entry = m.entry[0, 0]
    logits = m.knorm[0, 0] * (m.khat[0, 0, entry] @ q) / math.sqrt(d)
    expanded = torch.softmax(logits, 0) @ m.vent[0, 0, entry]
    exact = torch.softmax(k @ q / math.sqrt(d), 0) @ v
    torch.testing.assert_close(expanded, exact)
    single = torch.softmax((k[:3] @ q) / math.sqrt(d), 0) @ v[:3]
    assert not torch.allclose(single, exact)                         # dropping the slots would differ
