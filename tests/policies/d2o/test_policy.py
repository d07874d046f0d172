"""D2O (docs/policies.md §5) against a direct float64 loop over tokens written from the spec."""

from __future__ import annotations

import math

import pytest
import torch

from kvpass.cache import LayerCache, keep_slots, load_into
from kvpass.policies import get_policy
from kvpass.policies.d2o import D2O, TAU
from kvpass.policies.selection import kept_slots, select_kept
from tests.policies.policy_helpers import by_position, live_positions, random_cache


def reference_d2o(cache: LayerCache, keep: int, policy: D2O, tau_prev: list[float | None]):
    """Per (row, head): sinks + recent + top acc; nearest kept key by cosine; EMA tau per row;
    merge per the variant. Returns ({(b, g): (positions, k rows, v rows)}, taus)."""
    n, m = policy.n_m_ratio
    recent = keep * m // (n + m)
    sinks = min(policy.sinks, keep - recent)
    out, taus = {}, []
    b_rows, hkv = cache.length.shape
    for b in range(b_rows):
        per_head = []
        for g in range(hkv):
            s = int(cache.length[b, g])
            acc = cache.slot_meta["col_sum"][b, g].double().tolist()
            if s <= keep:
                kept = list(range(s))
            else:
                middle = sorted(range(sinks, s - recent), key=lambda j: -acc[j])[: keep - sinks - recent]
                kept = sorted(set(range(sinks)) | set(range(s - recent, s)) | set(middle))
            evicted = [j for j in range(s) if j not in kept]
            k = cache.k[b, g].double()
            best = []
            for i in evicted:
                sims = [float(k[i] @ k[j] / (k[i].norm() * k[j].norm() + 1e-6)) for j in kept]
                jj = max(range(len(kept)), key=lambda x: sims[x])
                best.append((i, kept[jj], sims[jj]))
            per_head.append((kept, best))
        all_u = [u for _, best in per_head for _, _, u in best]
        if not all_u:
            taus.append(tau_prev[b])
        else:
            cur = sum(all_u) / len(all_u)
            taus.append(cur if tau_prev[b] is None else policy.beta * cur + (1 - policy.beta) * tau_prev[b])
        tau = taus[-1]
        for g, (kept, best) in enumerate(per_head):
            k, v = cache.k[b, g].double().clone(), cache.v[b, g].double().clone()
            new_k, new_v = {}, {}
            for j in kept:
                into = []
                for slot, (i, target, u) in enumerate(best):
                    if target != j:
                        continue
                    if policy.d2o_variant == "paper":
                        ok = u >= tau
                    else:
                        ok = sum(per_head[h][1][slot][2] for h in range(hkv)) / hkv >= tau
                    if ok:
                        into.append((i, u))
                if policy.d2o_variant == "paper":
                    z = math.e + sum(math.exp(u) for _, u in into)
                    new_k[j] = (math.e * k[j] + sum(math.exp(u) * k[i] for i, u in into)) / z
                    new_v[j] = (math.e * v[j] + sum(math.exp(u) * v[i] for i, u in into)) / z
                else:
                    new_k[j] = (k[j] + sum(u * k[i] for i, u in into)) / (1 + len(into))
                    new_v[j] = (v[j] + sum(u * v[i] for i, u in into)) / (1 + len(into))
            out[(b, g)] = (cache.position[b, g, kept].tolist(), torch.stack([new_k[j] for j in kept]), torch.stack([new_v[j] for j in kept]))
    return out, taus


def _check(got: LayerCache, want: dict) -> None:
    for (b, g), (kept, k, v) in want.items():
        assert live_positions(got, b, g) == kept
        # fp32 cache vs the float64 reference (cosines on CUDA come from the tf32 Triton matcher)
        torch.testing.assert_close(got.k[b, g, : len(kept)].double(), k, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got.v[b, g, : len(kept)].double(), v, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("variant", ["paper", "code"])
def test_compress_matches_reference_over_steps(variant: str) -> None:
    """Prefill compression then three one-in-one-out steps: kept indices, merged K/V, tau."""
    policy = D2O(d2o_variant=variant)
    cache = random_cache([[20, 20], [17, 17]], c=20, seed=3)
    keep = 12                                                   # recent 3, sinks 4, 5 heavy hitters
    tau = [None, None]
    for step in range(4):
        want, tau = reference_d2o(cache, keep, policy, tau)
        got = policy.compress(cache, keep)
        _check(got, want)
        torch.testing.assert_close(got.state[TAU].double(), torch.tensor(tau, dtype=torch.float64))
        # one decode step: a new token with a fresh key and some attention mass
        nxt = random_cache([[13, 13], [13, 13]], c=13, seed=10 + step)
        got.k, got.v = torch.cat([got.k, nxt.k[:, :, -1:]], 2), torch.cat([got.v, nxt.v[:, :, -1:]], 2)
        got.log_weight = torch.cat([got.log_weight, torch.zeros(2, 2, 1)], 2)
        got.position = torch.cat([got.position, got.position.amax(-1, keepdim=True) + 1], 2)   # tokens seen
        got.slot_meta = {n: torch.cat([t, nxt.slot_meta[n][:, :, -1:]], 2) for n, t in got.slot_meta.items()}
        got.length = got.length + 1
        cache = got
    assert cache.state["d2o_tau_set"].all()


def test_merge_fires_and_threshold_matters() -> None:
    """Some evicted tokens merge and some are dropped (tau sits inside the similarities), and the
    merge changes the kept keys: a policy that ignored merging would fail the reference test."""
    cache = random_cache([[30]], c=30, seed=5)
    got = D2O().compress(cache, 20)
    plain = cache.k[0, 0, got.position[0, 0, :20]]
    changed = (got.k[0, 0, :20] - plain).abs().amax(-1) > 1e-5
    assert 0 < int(changed.sum()) < 10                     # 10 evicted: at most 10 targets, not all merged


def test_sinks_and_recent_always_kept_and_budget_respected() -> None:
    policy = D2O()
    cache = random_cache([[40, 40, 40]], c=40, seed=7)
    cache.slot_meta["col_sum"][..., :4] = 0.0              # the lowest scores: still kept as sinks
    cache.slot_meta["col_sum"][..., -5:] = 0.0             # recent: still kept
    for keep in (20, 9, 5, 2, 1):
        got = policy.compress(cache, keep)
        sinks, _, recent = policy.split(keep)
        assert int(got.length.max()) == keep
        for g in range(3):
            pos = live_positions(got, 0, g)
            assert set(range(sinks)) <= set(pos) and set(range(40 - recent, 40)) <= set(pos)
        assert torch.isfinite(got.k).all() and torch.isfinite(got.v).all()
        assert torch.isfinite(got.state[TAU]).all()


def test_batch_rows_independent() -> None:
    both = random_cache([[25, 25], [19, 19]], c=25, seed=11)
    one = random_cache([[19, 19]], c=25, seed=11)
    for name in ("k", "v"):
        setattr(one, name, getattr(both, name)[1:].clone())
    one.slot_meta = {n: t[1:].clone() for n, t in both.slot_meta.items()}
    got_both, got_one = D2O().compress(both, 10), D2O().compress(one, 10)
    torch.testing.assert_close(got_both.k[1:], got_one.k)
    torch.testing.assert_close(got_both.state[TAU][1:], got_one.state[TAU])


def _var_cache(var: list[float], n: int = 100) -> LayerCache:
    cache = random_cache([[n]], c=n, seed=0)
    cache.state["attn_var"] = torch.tensor([var])
    return cache


def test_layer_budgets_code_form_matches_spec() -> None:
    """§5.4 code form: min-max normalised head variances, mean, softmax(-sig), L * rho * budget."""
    variances = [[1.0, 3.0, 2.0, 9.0], [5.0, 5.5, 6.0, 5.0], [0.1, 0.1, 0.1, 10.0]]
    caches = [_var_cache(v) for v in variances]
    sig = []
    for v in variances:
        lo, hi = min(v), max(v)
        sig.append(sum((x - lo) / (hi - lo + 1e-6) for x in v) / len(v))
    z = [math.exp(-s) for s in sig]
    want = [3 * 20 * x / sum(z) for x in z]
    got = D2O().layer_budgets(20, caches)
    assert sum(got) == 60
    assert all(abs(g - w) < 1 for g, w in zip(got, want, strict=True))
    assert got[2] > got[0] > got[1]                       # dense (low normalised variance) layers get more
    assert D2O(allocation="uniform").layer_budgets(20, caches) == [20, 20, 20]


def test_layer_budgets_never_exceed_total_with_small_budgets_and_skips() -> None:
    caches = [_var_cache([float(i), 2.0 * i + 1, 0.5]) for i in range(5)]
    for budget in (1, 2, 3, 7, 50):
        got = D2O().layer_budgets(budget, caches)
        assert sum(got) == 5 * budget and min(got) >= 1
    got = D2O(skip_layers=(0, -1)).layer_budgets(60, caches)
    assert got[0] == got[-1] == 100 and sum(got) == 300
    with pytest.raises(ValueError, match="skip_layers"):
        D2O(skip_layers=(0, 1)).layer_budgets(20, caches)


@pytest.mark.parametrize("kwargs, name", [({"beta": 1.5}, "beta"), ({"d2o_variant": "x"}, "d2o_variant"),
                                          ({"n_m_ratio": (0, 0)}, "n_m_ratio"), ({"sinks": -1}, "sinks"),
                                          ({"allocation": "?"}, "allocation")])
def test_bad_hyperparameters_raise(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        get_policy("d2o", **kwargs)


def _with_state(cache: LayerCache, tau: list[float] | None) -> LayerCache:
    if tau is not None:
        cache.state[TAU] = torch.tensor(tau, dtype=torch.float32)
        cache.state["d2o_tau_set"] = torch.tensor([True, False][: len(tau)])
    return cache


def test_one_in_one_out_merges_the_evicted_entry() -> None:
    """A decode step's compression (capacity keep + 1) evicts the lowest score and merges it into its copy."""
    policy = D2O()
    cache = random_cache([[17]], c=17, seed=1)
    cache.k[0, 0, 9] = cache.k[0, 0, 5]                          # slot 9 would merge into 5 if evicted
    cache.slot_meta["col_sum"][0, 0, 9] = 0.0                      # lowest score: evicted
    cache.state[TAU] = torch.tensor([0.5])
    cache.state["d2o_tau_set"] = torch.tensor([True])
    got = policy.compress(cache, 16)
    assert 9 not in live_positions(got, 0, 0) and int(got.length) == 16
    torch.testing.assert_close(got.k[0, 0, 5], cache.k[0, 0, 5])   # merging a copy keeps the key
    assert not torch.equal(got.v[0, 0, 5], cache.v[0, 0, 5])        # the value moves towards v_9


@pytest.mark.parametrize("variant", ["paper", "code"])
def test_export_form_of_the_merge_equals_the_scatter_form(variant, monkeypatch):
    """Under torch.export D2O sums merges with dense assignment matmuls (TensorRT has no scatter-add);
    the entries must equal the run-time scatter-add form."""
    cache = random_cache([[40, 33, 40], [28, 40, 36]], c=40, seed=11)
    policy = D2O(d2o_variant=variant)
    want = policy.compress(cache, 17)
    monkeypatch.setattr(torch.compiler, "is_exporting", lambda: True)
    got = policy.compress(cache, 17)
    for name in ("k", "v", "log_weight", "position", "length"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=1e-6, atol=1e-6)
    assert not torch.equal(want.k, keep_slots(cache, kept_slots(select_kept(cache.slot_meta["col_sum"], cache.length,
                                                                            17, *policy.split(17)[::2]), 17)).k)


@pytest.mark.parametrize("variant", ["paper", "code"])
@pytest.mark.parametrize("seed", range(3))
def test_in_place_decode_compression_keeps_the_same_entries(variant: str, seed: int) -> None:
    """``compress_into`` (the runtime's in-place one-in-one-out: the newest entry takes the evicted
    slot) over 12 simulated decode steps holds, at every step, the same entries (K, V, positions,
    scores, log-weights) and the same threshold as the pure ``compress`` chain, whose slots stay in
    sequence order; ragged rows, some of which never fill."""
    policy = D2O(d2o_variant=variant)
    keep = 12
    gen = torch.Generator().manual_seed(100 + seed)
    pure = random_cache([[keep, keep, 9], [keep, 5, keep]], c=keep + 1, d=8, seed=seed, extra_meta=("col_sum",))
    pure.k[:, :, 7] = pure.k[:, :, 3] + 0.05 * pure.k[:, :, 7]          # near-copies: merges happen
    fast = LayerCache(**{f: getattr(pure, f).clone() for f in ("k", "v", "log_weight", "length", "position")},
                      slot_meta={n: t.clone() for n, t in pure.slot_meta.items()})
    addresses = [t.data_ptr() for t in fast.tensors()]
    for step in range(12):
        k_new, v_new = torch.randn(2, 2, 3, 8, generator=gen, dtype=torch.float64).unbind(0)
        score = torch.rand(2, 3, generator=gen, dtype=torch.float64).float()
        if step % 4 == 1:
            k_new = pure.k[:, :, 4].clone()                                  # an exact copy of a kept key
        for cache in (pure, fast):                                           # the decode step's write at slot length
            pos = cache.position.amax(-1) + 1
            slot = cache.length[..., None]
            cache.k.scatter_(2, slot[..., None].expand(-1, -1, 1, 8), k_new[:, :, None])
            cache.v.scatter_(2, slot[..., None].expand(-1, -1, 1, 8), v_new[:, :, None])
            cache.log_weight.scatter_(2, slot, 0.0)
            cache.position.scatter_(2, slot, pos[..., None])
            # this step's attention row, a function of the entry (not its slot): both layouts add the same
            cache.slot_meta["col_sum"] += torch.where(cache.live, (cache.position * (step + 3) % 7).float() / 7, 0.0)
            cache.slot_meta["col_sum"].scatter_(2, slot, score[..., None])
            cache.length.add_(1)
        load_into(pure, policy.compress(pure, keep))
        policy.compress_into(fast, keep)
        assert [t.data_ptr() for t in fast.tensors()[: len(addresses)]] == addresses
        torch.testing.assert_close(fast.length, pure.length, rtol=0, atol=0)
        want, got = by_position(pure), by_position(fast)
        for name in want:
            torch.testing.assert_close(got[name], want[name], msg=f"step {step}: {name}", rtol=0, atol=0)
        for name in pure.state:
            torch.testing.assert_close(fast.state[name], pure.state[name], msg=name)
    assert not torch.equal(fast.position, pure.position)                     # the layouts did diverge
