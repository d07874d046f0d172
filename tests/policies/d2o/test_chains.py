"""D2O's merge chains (``kvpass.policies.d2o.chains``): the fold against a child-by-child loop in float64 on fresh
random forests, the parents against a brute-force search, and a layer small enough to work out by hand through the
reference, the plain-torch step and the Triton kernels (through the interpreter on CPU), with chains and without."""

from __future__ import annotations

import math

import pytest
import torch

from kvpass.cache import LayerCache, gather_slots
from kvpass.policies.d2o import TAU, TAU_SET
from kvpass.policies.d2o.chains import chain_parents, chain_similarities, chain_window, fold_chains, put
from kvpass.policies.d2o.evict_many import evict_many_triton
from kvpass.policies.d2o.evict_one import split_tensor
from kvpass.policies.d2o.in_place import StepTensors, evict_in_place
from kvpass.policies.d2o.merge import StepOptions
from kvpass.policies.d2o.reference import compress_reference


def random_forest(b: int, h: int, m: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(parent, link) [b, h, m]: each entry's parent a later entry, linked with probability 0.7 (the last never)."""
    gen = torch.Generator().manual_seed(seed)
    i = torch.arange(m)
    parent = i + 1 + (torch.rand(b, h, m, generator=gen) * (m - 1 - i)).long()
    link = (torch.rand(b, h, m, generator=gen) < 0.7) & (i < m - 1)
    return parent.clamp(max=m - 1), link


@pytest.mark.parametrize("variant", ["paper", "code", "score"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fold_equals_merging_children_before_parents(variant: str, seed: int) -> None:
    b, h, m, d = 2, 3, 9, 5
    gen = torch.Generator().manual_seed(100 + seed)
    k, v = (torch.randn(b, h, m, d, generator=gen, dtype=torch.float64) for _ in range(2))
    parent, link = random_forest(b, h, m, seed)
    w = torch.rand(b, h, m, generator=gen, dtype=torch.float64) + 0.1
    sizes = torch.rand(b, h, m, generator=gen) + 1
    own = torch.rand(b, h, m, generator=gen, dtype=torch.float64) + 0.1 if variant == "score" else \
        (math.e if variant == "paper" else 1.0)
    k[0, 0, 0] = float("nan")               # an entry neither linked nor a parent may hold anything
    link[0, 0, 0] = False
    got_k, got_v, got_n = fold_chains(k, v, parent, link, w, own, variant == "code", sizes)
    want = [k.clone(), v.clone(), sizes.double().clone()]
    for bi in range(b):
        for g in range(h):
            for j in range(m):                      # children have lower indices: their values are final
                kids = [c for c in range(j) if link[bi, g, c] and parent[bi, g, c] == j]
                if not kids:
                    continue
                self_w = float(own[bi, g, j]) if variant == "score" else own
                norm = self_w + (len(kids) if variant == "code" else sum(float(w[bi, g, c]) for c in kids))
                for x in want[:2]:
                    x[bi, g, j] = (self_w * x[bi, g, j] + sum(w[bi, g, c] * x[bi, g, c] for c in kids)) / norm
                want[2][bi, g, j] += sum(want[2][bi, g, c] for c in kids)
    torch.testing.assert_close(got_k[:, :, 1:], want[0][:, :, 1:], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_v, want[1], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_n.double(), want[2], rtol=1e-6, atol=1e-6)
    assert not torch.equal(got_v, v), "nothing folded"


def test_parents_are_the_most_similar_later_valid_entries() -> None:
    gen = torch.Generator().manual_seed(7)
    b, h, m, d = 2, 2, 8, 4
    k = torch.randn(b, h, m, d, generator=gen)
    valid = torch.rand(b, h, m, generator=gen) < 0.8
    best, parent = chain_parents(k, valid)
    x = torch.nn.functional.normalize(k, dim=-1)
    for bi in range(b):
        for g in range(h):
            for i in range(m):
                later = [j for j in range(i + 1, m) if valid[bi, g, j]]
                if not valid[bi, g, i] or not later:
                    assert best[bi, g, i] == float("-inf")
                    continue
                sims = torch.stack([x[bi, g, i] @ x[bi, g, j] for j in later])
                assert later[int(sims.argmax())] == int(parent[bi, g, i])
                torch.testing.assert_close(best[bi, g, i], sims.max())
    u = torch.full((b, h, m), 0.5)
    u2, chained, _ = chain_similarities(k, valid, u)
    assert torch.equal(chained, valid & (best > 0.5)) and torch.equal(u2, torch.maximum(u, best))


def two_neighbours() -> StepTensors:
    """One (b, g) row of 3 entries: a kept one t at position 0 (high score) and two evicted neighbours at
    positions 1 and 2 with the same key k_n (cos(k_n, k_t) = 0.6), values v0, v1; the threshold already set at -1."""
    k = torch.tensor([[0.6, 0.8], [1.0, 0.0], [1.0, 0.0]]).view(1, 1, 3, 2)
    v = torch.tensor([[1.0, 0.0], [0.0, 2.0], [4.0, 0.0]]).view(1, 1, 3, 2)
    return StepTensors(k, v, torch.tensor([[[5.0, 0.1, 0.2]]]), torch.tensor([[[0, 1, 2]]]), torch.zeros(1, 1, 3),
                       torch.tensor([[3]]), torch.tensor([-1.0]), torch.tensor([True]), [])


@pytest.mark.parametrize("chains", [True, False])
@pytest.mark.parametrize("form", ["reference", "torch", "triton"])
def test_neighbours_merge_into_each_other_then_on(chains: bool, form: str, triton_device: str) -> None:
    """With chains the first neighbour (u = 1 to the second) merges into the second, and the pair into t: tau =
    0.7 * mean(1, 0.6) + 0.3 * (-1), v_pair = (e v1 + e v0) / 2e, v_t = (e v_t + e^0.6 v_pair) / (e + e^0.6).
    Without, both merge into t: tau = 0.7 * 0.6 + 0.3 * (-1), v_t = (e v_t + e^0.6 (v0 + v1)) / (e + 2 e^0.6)."""
    t = two_neighbours()
    v0, v1, vt = (t.v[0, 0, i].clone() for i in (1, 2, 0))
    opts = StepOptions(beta=0.7, variant="paper", chains=2 if chains else 0)
    if form == "reference":
        cache = LayerCache(t.k, t.v, t.log_weight, t.length, t.position, {"col_sum": t.score},
                           {TAU: t.tau, TAU_SET: t.tau_set})
        out = compress_reference(cache, "col_sum", 1, 0, 0, 0, opts)
        got_v, got_len, got_pos, got_tau = out.v, out.length, out.position, out.state[TAU]
    else:
        if form == "torch":
            evict_in_place(t, 1, 2, 2, 0, 0, 0, opts)
        else:
            dev = torch.device(triton_device)
            t = StepTensors(*(x.to(dev) for x in t[:8]), [])
            evict_many_triton(t, split_tensor(1, dev, 1, 2, 0, 0, 0), 2, opts)
        got_v, got_len, got_pos, got_tau = t.v.cpu(), t.length.cpu(), t.position.cpu(), t.tau.cpu()
    a = math.exp(0.6)
    if chains:
        tau, want = 0.7 * 0.8 - 0.3, (math.e * vt + a * (v0 + v1) / 2) / (math.e + a)
    else:
        tau, want = 0.7 * 0.6 - 0.3, (math.e * vt + a * (v0 + v1)) / (math.e + 2 * a)
    assert int(got_len) == 1 and int(got_pos[0, 0, 0]) == 0
    torch.testing.assert_close(got_v[0, 0, 0], want.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_tau, torch.tensor([tau]), rtol=1e-5, atol=1e-6)


def test_window_takes_the_last_valid_entries_and_put_writes_only_those() -> None:
    valid = torch.tensor([[[True, True, True, True, False], [True, False, False, False, False]]])
    index, ok = chain_window(valid, 3)
    assert index.tolist() == [[[1, 2, 3], [0, 0, 0]]] and ok.tolist() == [[[True, True, True], [False, False, True]]]
    x = torch.arange(10.0).view(1, 2, 5)
    assert torch.equal(gather_slots(x, index), torch.tensor([[[1.0, 2, 3], [5, 5, 5]]]))
    got = put(x, index, ok, torch.full((1, 2, 3), -1.0))
    assert got.tolist() == [[[0, -1, -1, -1, 4], [-1, 6, 7, 8, 9]]]
    rows = torch.arange(20.0).view(1, 2, 5, 2)                 # [B, Hkv, E, D] rows move whole
    assert torch.equal(gather_slots(rows, index)[0, 0], rows[0, 0, 1:4])
    assert torch.equal(put(rows, index, ok, torch.zeros(1, 2, 3, 2))[0, 1, 1:], rows[0, 1, 1:])
