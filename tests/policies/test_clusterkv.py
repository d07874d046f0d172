"""ClusterKV (docs/policies.md §2): K-means assignments, cluster selection order and trimming against
float64 loop references, exactness at a budget covering the context, generate on every tiny
architecture."""

from __future__ import annotations

import math

import pytest
import torch

import kvpass
from kvpass.kernels import decode_attention_reference
from kvpass.kernels.cluster_recall_attention import attend_selected, select_slots
from kvpass.policies.clusterkv import ClusterKV
from kvpass.policies.kmeans import cosine_kmeans, member_rank
from tests.policies.merging_support import ARCHS, full_output, prompt, tiny_model


def cos(a, b):
    return float(a @ b) / (float(a.norm()) * float(b.norm()) + 1e-12)


def test_kmeans_is_a_fixed_point_of_the_spec():
    """Final labels are the argmax-cosine centroid of every valid key and every non-empty centroid is
    the mean of its members' raw keys (§2.4), checked with loops in float64."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 2, 40, 6, generator=g, dtype=torch.float64)
    valid = torch.ones(2, 2, 40, dtype=torch.bool)
    valid[:, :, :3] = False                                            # sinks
    valid[1, 0, 30:] = False                                           # a shorter row
    out = cosine_kmeans(x, valid, 5, iters=50, seed=1)
    for b in range(2):
        for h in range(2):
            mu = out.centroids[b, h].double()
            for i in range(40):
                if not valid[b, h, i]:
                    assert int(out.labels[b, h, i]) == -1
                    continue
                usable = [c for c in range(5) if int(out.sizes[b, h, c]) > 0]
                best = max(usable, key=lambda c: (cos(x[b, h, i], mu[c]), -c))
                assert int(out.labels[b, h, i]) == best
            for c in range(5):
                members = [i for i in range(40) if int(out.labels[b, h, i]) == c]
                assert len(members) == int(out.sizes[b, h, c])
                if members:
                    torch.testing.assert_close(mu[c], x[b, h, members].mean(0), rtol=1e-5, atol=1e-5)
    assert int((out.sizes > 0).sum()) > 4                              # not a degenerate single cluster


def test_member_rank_is_position_order_inside_cluster():
    labels = torch.tensor([[[2, 0, -1, 2, 1, 0, 2, -1, 1]]])
    want = [0, 0, 0, 1, 0, 1, 2, 0, 1]
    assert member_rank(labels, 3)[0, 0].tolist() == want


def reference_selection(q, cluster, rank, mu, sizes, budget, live):
    """Selected slots per query head, by visiting clusters in descending q.mu (loops, §2.6 step 3)."""
    c = cluster.shape[-1]
    chosen = set()
    scores = sorted((-float(q @ mu[k]), k) for k in range(mu.shape[0]) if int(sizes[k]) > 0)
    taken = 0
    for _, k in scores:
        members = sorted(j for j in range(c) if live[j] and int(cluster[j]) == k + 1)
        for j in members:
            if taken < budget:
                chosen.add(j)
                taken += 1
    return chosen | {j for j in range(c) if live[j] and int(cluster[j]) == 0}


def test_selection_order_and_trimming_match_reference():
    g = torch.Generator().manual_seed(3)
    b, hkv, group, c, d, n_clusters = 1, 2, 2, 30, 8, 4
    k = torch.randn(b, hkv, c, d, generator=g, dtype=torch.float64)
    live = torch.arange(c)[None, None].expand(b, hkv, c) < 27
    valid = live & (torch.arange(c) >= 2)
    valid[..., 24:] = False                                            # pending generated tokens
    found = cosine_kmeans(k, valid, n_clusters, seed=0)
    cluster = found.labels + 1
    q = torch.randn(b, hkv * group, d, generator=g, dtype=torch.float64)
    budget = torch.full((b, hkv), 9)
    keep = select_slots(q, live, cluster, found.rank, found.centroids.double(), found.sizes, budget)
    for h in range(hkv * group):
        gh = h // group
        want = reference_selection(q[0, h], cluster[0, gh], found.rank[0, gh], found.centroids[0, gh].double(),
                                   found.sizes[0, gh], 9, live[0, gh])
        got = {j for j in range(c) if keep[0, gh, h % group, j]}
        assert got == want
        assert len(got) == 9 + 2 + 3                                   # budget + sinks + pending


def test_gathered_path_equals_masked_path():
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 1, 8, generator=g)
    k, v = torch.randn(2, 2, 20, 8, generator=g), torch.randn(2, 2, 20, 8, generator=g)
    lw = torch.zeros(2, 2, 20)
    keep = torch.rand(2, 2, 2, 20, generator=g) < 0.4
    keep[..., 0] = True
    masked = attend_selected(q, k, v, lw, keep, 0.3, None, gather=False)
    gathered = attend_selected(q, k, v, lw, keep, 0.3, None, gather=True)
    torch.testing.assert_close(gathered, masked)


def test_budget_covering_context_is_full_attention():
    g = torch.Generator().manual_seed(5)
    k, v = torch.randn(1, 2, 24, 8, generator=g), torch.randn(1, 2, 24, 8, generator=g)
    q = torch.randn(1, 4, 1, 8, generator=g)
    live = torch.ones(1, 2, 24, dtype=torch.bool)
    found = cosine_kmeans(k, live & (torch.arange(24) >= 2), 3)
    lw = torch.zeros(1, 2, 24)
    full, _ = decode_attention_reference(q, k, v, lw, 0.3)
    for budget, exact in ((22, True), (6, False)):
        keep = select_slots(q[:, :, 0], live, found.labels + 1, found.rank, found.centroids, found.sizes,
                            torch.full((1, 2), budget))
        got = attend_selected(q, k, v, lw, keep, 0.3, None, gather=False)
        assert torch.allclose(got, full, atol=1e-6) == exact


def test_prepare_cluster_counts_and_budget():
    pol = ClusterKV(sinks=4, cluster_ratio=8, window=4, window_clusters=2, full_layers=1)
    g = torch.Generator().manual_seed(0)
    from kvpass.cache import entries_from_prompt, with_capacity
    cache = entries_from_prompt(torch.randn(1, 2, 40, 8, generator=g), torch.randn(1, 2, 40, 8, generator=g),
                                torch.tensor([0]), {})
    cache = pol.prepare(with_capacity(cache, 48), layer=1, budget=20)
    assert cache.state["centroids"].shape[2] == 5 + 2 * 2              # C0 = 40 / 8, two decode windows
    assert int(cache.state["cluster_size"].sum(-1)[0, 0]) == 36        # every prompt token past the sinks
    assert cache.state["recall_budget"].tolist() == [[16, 16]]
    assert int(pol.prepare(cache, layer=0, budget=20).state["recall_budget"][0, 0]) > 48


def test_bad_hyperparameters_raise():
    for kwargs in ({"sinks": -1}, {"window": 0}, {"window_clusters": 0}, {"cluster_ratio": 0},
                   {"window": 2, "window_clusters": 3}):
        with pytest.raises(ValueError):
            ClusterKV(**kwargs)


SMALL = dict(sinks=4, cluster_ratio=8, window=4, window_clusters=2, full_layers=1)


@pytest.mark.parametrize("arch", ARCHS)
def test_generate(arch):
    model = tiny_model(arch)
    km = kvpass.apply(model, policy="clusterkv", budget=32, **SMALL)
    out = km.generate(prompt(2, 80), max_new_tokens=10, eos_token_id=[])
    assert out.shape == (2, 90)
    report = km.last_report
    assert report.host_bytes == 0                                      # CPU model: nothing is host-resident
    rate = report.policy_stats.get("recall_hit_rate")
    if arch != "mistral":                                              # every Mistral layer is sliding
        assert rate is not None and 0.0 <= rate <= 1.0 and not math.isnan(rate)


def test_generate_exact_at_large_budget_and_changed_at_small():
    model = tiny_model("llama")
    ids = prompt(1, 80)
    kw = dict(SMALL, full_layers=0)
    full = full_output("llama", 1, 80, 16)
    big = kvpass.apply(model, policy="clusterkv", budget=96, **kw).generate(ids, max_new_tokens=16, eos_token_id=[])
    small = kvpass.apply(model, policy="clusterkv", budget=12, **kw).generate(ids, max_new_tokens=16, eos_token_id=[])
    assert torch.equal(big, full)
    assert not torch.equal(small, full)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: K, V are host-resident only on an accelerator")
def test_host_resident_cache_is_reported_separately():
    model = tiny_model("llama").to("cuda")
    try:
        km = kvpass.apply(model, policy="clusterkv", budget=32, **SMALL)
        km.generate(prompt(1, 80).cuda(), max_new_tokens=8, eos_token_id=[])
        report = km.last_report
        assert report.host_bytes > 0 and report.cache_bytes > 0
        assert report.host_bytes >= 2 * 2 * 2 * 88 * 16 * 4             # K and V of both layers, 2 KV heads
    finally:
        model.to("cpu")


def test_maintain_clusters_pending_generated_tokens_among_themselves():
    from kvpass.cache import entries_from_prompt, with_capacity
    pol = ClusterKV(sinks=4, cluster_ratio=8, window=6, window_clusters=2, full_layers=0)
    g = torch.Generator().manual_seed(2)
    k, v = torch.randn(1, 2, 46, 8, generator=g), torch.randn(1, 2, 46, 8, generator=g)
    cache = pol.prepare(with_capacity(entries_from_prompt(k[:, :, :40], v[:, :, :40], torch.tensor([0]), {}), 52),
                        layer=0, budget=20)
    cache.k[:, :, 40:46], cache.v[:, :, 40:46] = k[:, :, 40:], v[:, :, 40:]     # six generated tokens
    cache.log_weight[:, :, 40:46] = 0.0
    cache.length += 6
    assert pol.maintenance_due(6) and not pol.maintenance_due(5)
    before = cache.slot_meta["cluster"].clone()
    out = pol.maintain(cache, layer=0)
    labels = out.slot_meta["cluster"]
    assert torch.equal(labels[:, :, :40], before[:, :, :40])                  # prompt clusters untouched
    assert set(labels[:, :, 40:46].unique().tolist()) <= {6, 7}              # new clusters 5 and 6 (+1)
    assert out.state["cluster_size"][:, :, 5:7].sum(-1).tolist() == [[6, 6]]
    assert out.state["cluster_count"].tolist() == [[7, 7]]
