"""Chelsea (docs/policies.md §1) against a direct float64 reference written from the spec, the §8.2
exactness property, and generate on every tiny architecture."""

from __future__ import annotations

import math

import pytest
import torch

import kvpass
import kvpass.runtime.layers as runtime  # where the stacked prompt compression splits its rows
from kvpass.cache import EMPTY, LayerCache, concat_rows, split_rows, with_capacity
from kvpass.kernels import decode_attention_reference, merge_entries_reference
from kvpass.policies.chelsea import Chelsea, best_edges
from tests.policies.merging_support import ARCHS, full_output, prompt, tiny_model


def random_cache(b: int, hkv: int, c: int, d: int, lengths: list[list[int]], seed: int = 0,
                 dtype=torch.float64) -> LayerCache:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(b, hkv, c, d, generator=g, dtype=dtype)
    v = torch.randn(b, hkv, c, d, generator=g, dtype=dtype)
    length = torch.tensor(lengths)
    live = torch.arange(c)[None, None] < length[..., None]
    log_weight = torch.where(live, torch.rand(b, hkv, c, generator=g).mul(2).log1p(), EMPTY).float()
    position = torch.where(live, torch.arange(c), -1)
    return LayerCache(k=k.masked_fill(~live[..., None], 0), v=v.masked_fill(~live[..., None], 0),
                      log_weight=log_weight, length=length, position=position)


# ------------------------------------------------------------------ merge_entries op
def test_merge_entries_matches_loop_reference():
    cache = random_cache(2, 2, 12, 4, [[12, 9], [7, 12]])
    g = torch.Generator().manual_seed(1)
    w = torch.rand(2, 2, 12, generator=g, dtype=torch.float64) + 0.1
    target = torch.arange(12).repeat(2, 2, 1)
    target[0, 0, 3], target[0, 0, 5], target[1, 1, 0], target[0, 1, 8] = 4, 4, 11, -1
    k, v, lw = merge_entries_reference(cache.k, cache.v, w, cache.log_weight, target)
    for b in range(2):
        for h in range(2):
            for j in range(12):
                srcs = [i for i in range(12) if int(target[b, h, i]) == j]
                if not srcs:
                    assert torch.equal(k[b, h, j], cache.k[b, h, j])
                    continue
                if all(i >= int(cache.length[b, h]) for i in srcs):     # an empty slot stays empty
                    assert float(lw[b, h, j]) == EMPTY
                    continue
                ws = torch.tensor([float(w[b, h, i]) for i in srcs], dtype=torch.float64)
                want_k = sum(ws[n] * cache.k[b, h, i] for n, i in enumerate(srcs)) / ws.sum()
                want_v = sum(ws[n] * cache.v[b, h, i] for n, i in enumerate(srcs)) / ws.sum()
                deg = sum(math.exp(float(cache.log_weight[b, h, i])) for i in srcs)
                torch.testing.assert_close(k[b, h, j], want_k)
                torch.testing.assert_close(v[b, h, j], want_v)
                assert float(lw[b, h, j]) == pytest.approx(math.log(deg), rel=1e-6)
    assert not torch.equal(k[0, 0, 4], cache.k[0, 0, 4])       # the merge did something


# ------------------------------------------------------------------ one CSM step, from the spec
def csm_reference(k, s, keep, step, pol: Chelsea):
    """§1.5/§1.7 for one row, written with loops: returns {A slot: B slot} of the kept edges."""
    n1, n2, c = pol.sinks, pol.recent, pol.chunk
    mid = list(range(n1, s - n2))
    edges = []                                                     # (sim, a, b)
    for start in range(0, len(mid), c):
        chunk = mid[start:start + c]
        aset, bset = chunk[0::2], chunk[1::2]
        for a in aset:
            best, arg = -math.inf, None
            for b in bset:
                cos = float(k[a] @ k[b]) / (float(k[a].norm()) * float(k[b].norm()) + 1e-6)
                if cos > best:
                    best, arg = cos, b
            if arg is not None:
                edges.append((best, a, arg))
    r = max(pol.r_init - pol.alpha * min(pol.m, step), pol.r_min)
    n_rm = max(min(math.floor(r * len(mid)), s - keep, len(edges)), 1)
    edges.sort(key=lambda e: (-e[0], e[1]))
    return {a: b for _, a, b in edges[:n_rm]}


@pytest.mark.parametrize("chunk", [4, 5, 16])
def test_csm_step_matches_reference(chunk):
    pol = Chelsea(sinks=2, recent=3, chunk=chunk, r_init=0.3, alpha=0.1, m=2, r_min=0.05)
    cache = random_cache(2, 2, 30, 8, [[30, 30], [23, 23]], seed=chunk)
    step = torch.tensor([[0, 0], [3, 3]])
    plan = pol.plan(cache, 17, step)
    for b in range(2):
        for h in range(2):
            s = int(cache.length[b, h])
            want = csm_reference(cache.k[b, h], s, 17, int(step[b, h]), pol)
            got = {j: int(plan.target[b, h, j]) for j in range(30) if int(plan.target[b, h, j]) >= 0}
            assert got == want
            assert int(plan.n_rm[b, h]) == len(want) > 0


@pytest.mark.parametrize("seed", range(4))
def test_best_edges_pick_what_a_stable_sort_picks(seed):
    """Ties (values drawn from a few), -0.0 and -inf (no edge) included, every n_rm up to the bound."""
    g = torch.Generator().manual_seed(seed)
    sim = torch.tensor([-1.0, -0.5, -0.0, 0.0, 0.25, 0.9, float("-inf")])[torch.randint(0, 7, (2, 3, 40), generator=g)]
    n_rm = torch.randint(0, 13, (2, 3), generator=g)
    order = torch.sort(sim, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(40).expand_as(order))
    want = (rank < n_rm[..., None]) & torch.isfinite(sim)
    assert torch.equal(best_edges(sim, n_rm, 12), want)
    assert not best_edges(sim, n_rm, 0).any()


def test_compress_merges_degree_weighted_and_keeps_order():
    pol = Chelsea(sinks=2, recent=3, chunk=6, r_init=0.5, alpha=0.0)
    cache = random_cache(1, 1, 20, 4, [[20]], seed=3)
    cache.log_weight.zero_()
    out = pol.compress(cache, 16)
    edges = csm_reference(cache.k[0, 0], 20, 16, 0, pol)
    assert len(edges) == 4 and int(out.length[0, 0]) == 16
    kept = [j for j in range(20) if j not in edges]
    assert out.position[0, 0, :16].tolist() == kept                 # merged entry at the B slot, in order
    for b in set(edges.values()):
        members = [b] + [x for x, y in edges.items() if y == b]
        i = kept.index(b)
        torch.testing.assert_close(out.k[0, 0, i], cache.k[0, 0, members].mean(0))
        assert float(out.log_weight[0, 0, i]) == pytest.approx(math.log(len(members)))
    assert int(out.state["chelsea_step"][0, 0]) == 1


@pytest.mark.parametrize("chunk, r_init, alpha, m, seed", [(4, 0.45, 0.05, 3, 0), (5, 0.3, 0.1, 2, 1), (16, 0.5, 0.0, 0, 2),
                                                          (7, 0.2, 0.1, 2, 3)])
def test_steps_to_budget_replays_the_device_loop(chunk, r_init, alpha, m, seed):
    """``compress`` runs ``steps_to_budget`` steps without asking the device: per row, the host replay takes
    as many steps as the rows' own CSM steps (run here one at a time, reading back after each) that remove
    entries, and the longest row's count is where every row is within budget."""
    pol = Chelsea(sinks=2, recent=3, chunk=chunk, r_init=r_init, alpha=alpha, m=m, r_min=0.05)
    g = torch.Generator().manual_seed(seed)
    keep = 12
    lengths = torch.randint(6, 61, (2, 3), generator=g).tolist()
    cache = random_cache(2, 3, 60, 4, lengths, seed=seed)
    step = torch.randint(0, 5, (2, 3), generator=g)
    want = [[pol.steps_to_budget(lengths[b][h], int(step[b, h]), keep) for h in range(3)] for b in range(2)]
    took = torch.zeros(2, 3, dtype=torch.long)
    while bool((cache.length > keep).any()):
        cache, stepped = pol.step(cache, keep, step)
        step, took = step + stepped.long(), took + stepped.long()
    assert took.tolist() == want and max(map(max, want)) > 1


def test_schedule_clamps_to_r_min():
    pol = Chelsea(r_init=0.2, alpha=0.1, m=2)                       # the Qwen2 schedule of §1.2
    r = pol.ratio(torch.arange(5)).tolist()
    assert r == pytest.approx([0.2, 0.1, 0.05, 0.05, 0.05])


# ------------------------------------------------------------------ §8.2 exactness
def test_centroids_with_log_degree_equal_exact_attention():
    """Duplicated middle keys (x1, x1, x2, x2, ...): one step with n_rm = M / 2 merges every copy
    into its twin and attention with the log N bias equals attention over the original tokens."""
    n1, n2, pairs, d = 4, 4, 12, 8
    g = torch.Generator().manual_seed(0)
    sinks, recent = torch.randn(2, n1, d, generator=g, dtype=torch.float64), torch.randn(2, n2, d, generator=g, dtype=torch.float64)
    mid = torch.randn(2, pairs, d, generator=g, dtype=torch.float64).repeat_interleave(2, dim=1)
    k = torch.cat([sinks[0], mid[0], recent[0]])[None, None]
    v = torch.cat([sinks[1], mid[1], recent[1]])[None, None]
    s = k.shape[2]
    cache = LayerCache(k=k, v=v, log_weight=torch.zeros(1, 1, s), length=torch.tensor([[s]]),
                       position=torch.arange(s)[None, None])
    pol = Chelsea(sinks=n1, recent=n2, chunk=8, r_init=0.5, alpha=0.0)
    out = pol.compress(cache, s - pairs)
    assert int(out.length) == s - pairs and float(out.log_weight.exp().sum()) == pytest.approx(s)
    q = torch.randn(1, 2, 1, d, generator=g, dtype=torch.float64)   # two query heads (GQA group of 2)
    exact, _ = decode_attention_reference(q, cache.k, cache.v, cache.log_weight, 0.3)
    merged, _ = decode_attention_reference(q, out.k, out.v, out.log_weight, 0.3)
    torch.testing.assert_close(merged, exact)
    unbiased, _ = decode_attention_reference(q, out.k, out.v, torch.zeros_like(out.log_weight), 0.3)
    assert not torch.allclose(unbiased, exact)                      # the check can fail without the bias


def test_bad_hyperparameters_raise():
    for kwargs in ({"chunk": 1}, {"r_min": 0.0}, {"r_init": 0.7}, {"sinks": -1}, {"interval": 0}):
        with pytest.raises(ValueError):
            Chelsea(**kwargs)
    with pytest.raises(ValueError):                                # would leave no middle to merge
        Chelsea(sinks=4, recent=4).compress(random_cache(1, 1, 12, 4, [[12]]), 8)


# ------------------------------------------------------------------ end to end
SMALL = dict(sinks=4, recent=8, chunk=16, interval=8)


@pytest.mark.parametrize("arch", ARCHS)
def test_generate_within_budget(arch):
    model = tiny_model(arch)
    ids = prompt(2, 80)
    km = kvpass.apply(model, policy="chelsea", budget=32, **SMALL)
    out = km.generate(ids, max_new_tokens=12, eos_token_id=[])
    assert out.shape == (2, 92)
    report = km.last_report
    for layer, budget in report.layer_budgets.items():
        assert budget == 32 and report.entries[layer] <= budget + SMALL["interval"]
    if report.layer_budgets:
        assert report.compressions > 0


def test_budget_changes_output_and_large_budget_is_exact():
    model = tiny_model("llama")
    ids = prompt(1, 80)
    full = full_output("llama", 1, 80, 16)
    big = kvpass.apply(model, policy="chelsea", budget=1.0, **SMALL).generate(ids, max_new_tokens=16, eos_token_id=[])
    small = kvpass.apply(model, policy="chelsea", budget=24, **SMALL).generate(ids, max_new_tokens=16, eos_token_id=[])
    assert torch.equal(big, full)
    assert not torch.equal(small, full)


@pytest.mark.parametrize("capacity, keep, one_step", [(20, 16, True), (12, 8, False)])
def test_compress_into_one_step_equals_compress(capacity, keep, one_step, monkeypatch):
    """The decode step's in-place form: where one CSM step provably suffices it runs just that step (no
    host sync, so it can sit in a CUDA graph) and leaves exactly what ``compress`` leaves, padded back
    to the capacity; otherwise it is ``compress`` and a copy back."""
    pol = Chelsea(sinks=2, recent=3, chunk=6, r_init=0.5, r_min=0.5, alpha=0.0, interval=4)
    assert pol.one_step_suffices(capacity, keep) == one_step
    lengths = [[capacity, keep + 1], [keep, keep - 3]]
    cache = random_cache(2, 2, capacity, 8, lengths, seed=capacity)
    cache.state["chelsea_step"] = torch.tensor([[0, 2], [1, 5]])
    want = with_capacity(pol.compress(cache, keep), capacity)
    got = LayerCache(k=cache.k.clone(), v=cache.v.clone(), log_weight=cache.log_weight.clone(),
                     length=cache.length.clone(), position=cache.position.clone(),
                     slot_meta={n: t.clone() for n, t in cache.slot_meta.items()},
                     state={n: t.clone() for n, t in cache.state.items()})
    if one_step:
        monkeypatch.setattr(Chelsea, "compress", lambda *a: pytest.fail("the one-step path called compress"))
    addresses = (got.k.data_ptr(), got.state["chelsea_step"].data_ptr())
    pol.compress_into(got, keep)
    assert (got.k.data_ptr(), got.state["chelsea_step"].data_ptr()) == addresses
    assert got.length.tolist() == [[keep, keep], [keep, keep - 3]]
    for name in ("log_weight", "length", "position"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    live = got.live[..., None]                                   # empty slots' K/V are never read
    for name in ("k", "v"):
        assert torch.equal(getattr(got, name) * live, getattr(want, name) * live), name
    assert torch.equal(got.state["chelsea_step"], want.state["chelsea_step"])


def test_layers_stacked_by_rows_compress_as_each_alone():
    """The prompt's layers compressed as one cache of their stacked rows (``Policy.rows_independent``) leave
    each layer what compressing it alone leaves: rows of different lengths and step counters, so they take
    different numbers of CSM steps inside the one call."""
    pol = Chelsea(sinks=2, recent=3, chunk=6, r_init=0.45, alpha=0.05, r_min=0.1, interval=4)
    keep = 10
    layers = [random_cache(2, 2, 40, 8, lengths, seed=i)
              for i, lengths in enumerate(([[40, 33], [12, 9]], [[25, 40], [40, 11]], [[40, 40], [38, 17]]))]
    for i, cache in enumerate(layers):
        cache.state["chelsea_step"] = torch.tensor([[0, i], [2 * i, 1]])
    stacked = split_rows(pol.compress(concat_rows(layers), keep), len(layers))
    for alone, got in zip((pol.compress(c, keep) for c in layers), stacked, strict=True):
        live = alone.live[..., None]
        assert got.length.max() <= keep and torch.equal(got.length, alone.length)
        for name in ("log_weight", "position"):
            assert torch.equal(getattr(got, name), getattr(alone, name)), name
        for name in ("k", "v"):
            torch.testing.assert_close(getattr(got, name) * live, getattr(alone, name) * live, rtol=0, atol=1e-12)
        assert torch.equal(got.state["chelsea_step"], alone.state["chelsea_step"])


def test_generate_with_stacked_layers_equals_layer_by_layer(monkeypatch):
    """End to end: the runtime's stacked prompt compression gives the tokens and cache entries of
    compressing layer by layer."""
    model = tiny_model("llama")
    ids = prompt(2, 80)
    km = kvpass.apply(model, policy="chelsea", budget=24, **SMALL)
    splits = []
    monkeypatch.setattr(runtime, "split_rows", lambda cache, n: splits.append(n) or split_rows(cache, n))
    stacked = km.generate(ids, max_new_tokens=12, eos_token_id=[])
    entries = km.last_report.entries
    assert splits == [len(km.last_report.layer_budgets)] and splits[0] > 1      # every layer in one group
    monkeypatch.setattr(Chelsea, "rows_independent", False)
    alone = km.generate(ids, max_new_tokens=12, eos_token_id=[])
    assert torch.equal(stacked, alone) and entries == km.last_report.entries


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_decode_step_keeps_the_cpu_entries():
    """On CUDA (the Triton matcher and merge, bf16, Llama-3.1-8B's KV shape) the decode step's one CSM step
    keeps the same entries as on the CPU (plain torch, fp32) from the same bf16 values, with the same
    degrees and the merged K, V equal to bf16 rounding."""
    pol = Chelsea()
    keep = 2000
    cap = keep + pol.interval
    cache = random_cache(1, 8, cap, 128, [[cap] * 8], seed=11, dtype=torch.float32)
    cache.k, cache.v = cache.k.bfloat16().float(), cache.v.bfloat16().float()
    cache.state["chelsea_step"] = torch.full((1, 8), 2)
    on_gpu = LayerCache(k=cache.k.bfloat16().cuda(), v=cache.v.bfloat16().cuda(), log_weight=cache.log_weight.cuda(),
                        length=cache.length.cuda(), position=cache.position.cuda(),
                        state={n: t.cuda() for n, t in cache.state.items()})
    pol.compress_into(cache, keep)
    pol.compress_into(on_gpu, keep)
    assert int(cache.length.max()) == keep
    for name in ("length", "position"):
        assert torch.equal(getattr(on_gpu, name).cpu(), getattr(cache, name)), name
    torch.testing.assert_close(on_gpu.log_weight.cpu(), cache.log_weight, rtol=1e-5, atol=1e-6)
    live = cache.live[..., None]
    for name in ("k", "v"):
        torch.testing.assert_close(getattr(on_gpu, name).float().cpu() * live, getattr(cache, name).bfloat16().float() * live,
                                   rtol=1e-2, atol=1e-2)
    assert torch.equal(on_gpu.state["chelsea_step"].cpu(), cache.state["chelsea_step"])
