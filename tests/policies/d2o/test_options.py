"""D2O's options (scores="window", merge off, merge_floor, merge_into_sinks=False, merge_bias,
first_compression, skip_memory) and EMS's scores="window", each against a plain float64 loop written
from its docstring, on fresh random inputs; and the options through the runtime on tiny models."""

from __future__ import annotations

import math

import pytest
import torch

from kvpass.cache import LayerCache, with_capacity
from kvpass.policies import get_policy
from kvpass.policies.base import Stat
from kvpass.policies.d2o import D2O, TAU
from kvpass.policies.ems import EMS
from tests.policies.policy_helpers import apply_cached, by_position, live_positions, random_cache

OPTIONS = {
    "window": dict(scores="window"),
    "no-merge": dict(merge=False),
    "floor": dict(merge_floor=0.2),
    "no-sinks": dict(merge_into_sinks=False),
    "bias": dict(merge_bias=True),
    "protect": dict(merge_protect=0.5),
    "protect-most": dict(merge_protect=0.9, merge_into_sinks=False),      # some evictions find no target
    "score-weights": dict(merge_weighting="score"),
    "score-protect": dict(scores="window", merge_weighting="score", merge_protect=0.5, merge_bias=True),
    "score-window": dict(scores="window", merge_weighting="score"),
    "all": dict(scores="window", merge_floor=0.1, merge_into_sinks=False, merge_bias=True),
    "all-protect": dict(scores="window", merge_floor=0.1, merge_into_sinks=False, merge_bias=True, merge_protect=0.3),
}


def reference(cache: LayerCache, keep: int, policy: D2O, tau_prev: list[float | None]):
    """One compression per (row, head) by loops: rank (window scores for scores="window" until ``prepare``
    turns them into col_sum, else col_sum),
    keep sinks + recent + top; the nearest kept key by cosine among the allowed targets (not the sinks when
    merge_into_sinks is False) and outside the floor(merge_protect * keep) kept entries of highest score (an
    evicted entry with no such target is dropped and skips tau); EMA tau; the variant's weights or, with
    merge_weighting="score", the ranking scores (+ 1e-6); merge where the variant's decision, merge and the floor allow;
    log-size bias. Returns ({(b, g): (positions, k, v, log_weight)}, taus)."""
    sinks, _, recent = policy.split(keep)
    score_name = "window_scores" if policy.scores == "window" and "window_scores" in cache.slot_meta else "col_sum"
    floor = -math.inf if policy.merge_floor is None else policy.merge_floor
    first_target = 0 if policy.merge_into_sinks else sinks
    n_protect = int(policy.merge_protect * keep) if policy.merge else 0
    out, taus = {}, []
    b_rows, hkv = cache.length.shape
    for b in range(b_rows):
        heads = []
        for g in range(hkv):
            s = int(cache.length[b, g])
            score = cache.slot_meta[score_name][b, g].double().tolist()
            if s <= keep:
                kept = list(range(s))
            else:
                middle = sorted(range(sinks, s - recent), key=lambda j: -score[j])[: keep - sinks - recent]
                kept = sorted(set(range(sinks)) | set(range(s - recent, s)) | set(middle))
            k = cache.k[b, g].double()
            rank = sorted(kept, key=lambda j: (-score[j], j))          # the row's positions are its slots here
            protected = set(rank[:n_protect]) if s > keep else set()
            best = []
            for i in (j for j in range(s) if j not in kept):
                allowed = [j for j in kept if j >= first_target and j not in protected]
                if not allowed:
                    continue
                sims = [float(k[i] @ k[j] / (k[i].norm() * k[j].norm())) for j in allowed]
                x = max(range(len(allowed)), key=lambda a: sims[a])
                best.append((i, allowed[x], sims[x]))
            heads.append((kept, best))
        all_u = [u for _, best in heads for _, _, u in best]
        if all_u:
            cur = sum(all_u) / len(all_u)
            taus.append(cur if tau_prev[b] is None else policy.beta * cur + (1 - policy.beta) * tau_prev[b])
        else:
            taus.append(tau_prev[b])
        tau = taus[-1]
        for g, (kept, best) in enumerate(heads):
            k, v, lw = cache.k[b, g].double(), cache.v[b, g].double(), cache.log_weight[b, g].double()
            rows_k, rows_v, rows_lw = [], [], []
            for j in kept:
                into = []
                for rank, (i, target, u) in enumerate(best):
                    if target != j:
                        continue
                    if policy.d2o_variant == "paper":
                        decided = u >= tau
                    else:
                        same_rank = [best_h[rank][2] for _, best_h in heads if rank < len(best_h)]   # ragged rows
                        decided = sum(same_rank) / len(same_rank) >= tau
                    if decided and policy.merge and u >= floor:
                        into.append((i, u))
                if policy.merge_weighting == "score":
                    head_score = cache.slot_meta[score_name][b, g].double().tolist()
                    w = {i: head_score[i] + 1e-6 for i, _ in into + [(j, 0.0)]}
                    z = sum(w.values())
                    rows_k.append(sum(w[i] * k[i] for i in w) / z)
                    rows_v.append(sum(w[i] * v[i] for i in w) / z)
                elif policy.d2o_variant == "paper":
                    z = math.e + sum(math.exp(u) for _, u in into)
                    rows_k.append((math.e * k[j] + sum(math.exp(u) * k[i] for i, u in into)) / z)
                    rows_v.append((math.e * v[j] + sum(math.exp(u) * v[i] for i, u in into)) / z)
                else:
                    rows_k.append((k[j] + sum(u * k[i] for i, u in into)) / (1 + len(into)))
                    rows_v.append((v[j] + sum(u * v[i] for i, u in into)) / (1 + len(into)))
                size = math.exp(lw[j]) + sum(math.exp(lw[i]) for i, _ in into) if policy.merge_bias else math.exp(lw[j])
                rows_lw.append(math.log(size))
            out[(b, g)] = (cache.position[b, g, kept].tolist(), torch.stack(rows_k), torch.stack(rows_v),
                           torch.tensor(rows_lw, dtype=torch.float64))
    return out, taus


def _check(got: LayerCache, want: dict, what: str) -> None:
    ours = by_position(got)
    for (b, g), (kept, k, v, lw) in want.items():
        n = len(kept)
        assert ours["position"][b, g, :n].tolist() == kept, what
        torch.testing.assert_close(ours["k"][b, g, :n].double(), k, rtol=1e-5, atol=1e-6, msg=what)
        torch.testing.assert_close(ours["v"][b, g, :n].double(), v, rtol=1e-5, atol=1e-6, msg=what)
        torch.testing.assert_close(ours["log_weight"][b, g, :n].double(), lw, rtol=0, atol=1e-5, msg=what)


@pytest.mark.parametrize("variant", ["paper", "code"])
@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_options_match_the_reference_over_steps(option: str, variant: str) -> None:
    """A prompt-time compression (general path) then one-in-one-out steps through ``compress_into`` (the
    in-place step), and the reference (``compress``), on fresh random ragged rows: same tokens, K, V, log-weights, tau."""
    policy = D2O(d2o_variant=variant, **OPTIONS[option])
    keep = 10
    cache = random_cache([[21, 17, 12], [9, 21, 16]], 21, d=6, seed=hash(option) % 1000)
    cache.k[:, :, 11] = cache.k[:, :, 5] + 0.05 * cache.k[:, :, 11]          # some near-copies: merges
    cache.k[:, :, 13] = cache.k[:, :, 1] + 0.05 * cache.k[:, :, 13]
    want, taus = reference(cache, keep, policy, [None, None])
    got = policy.compress(cache, keep)
    _check(got, want, "prompt")
    assert [float(t) for t in got.state[TAU]] == pytest.approx(_unset_as_zero(taus), abs=1e-6)
    policy.prepare(got, 0, keep)                                            # scores="window": col_sum := window scores
    assert "window_scores" not in got.slot_meta or policy.scores != "window"
    gen = torch.Generator().manual_seed(1)
    cache = with_capacity(got, keep + 1)
    for step in range(5):
        slot = cache.length.clone()                                         # the decode step's write
        b, h, c, d = cache.k.shape
        k_new = torch.randn(b, h, d, generator=gen, dtype=torch.float64)
        if step % 2 == 0:
            k_new = cache.k[:, :, 6] + 0.05 * k_new
        for bb in range(b):
            for hh in range(h):
                s = int(slot[bb, hh])
                cache.k[bb, hh, s], cache.v[bb, hh, s] = k_new[bb, hh], torch.randn(d, generator=gen, dtype=torch.float64)
                cache.position[bb, hh, s] = int(cache.position[bb, hh].max()) + 1
                cache.log_weight[bb, hh, s] = 0.0
        cache.length += 1
        cache.slot_meta["col_sum"] += torch.rand(b, h, c, generator=gen) * cache.live
        step_want, taus = reference(_sequence_order(cache), keep, policy, taus)
        pure = policy.compress(_sequence_order(cache), keep)              # the reference (in sequence order)
        policy.compress_into(cache, keep)                                 # the in-place step
        _check(cache, step_want, f"step {step} in place")
        _check(pure, step_want, f"step {step} reference")
        assert [float(t) for t in cache.state[TAU]] == pytest.approx(_unset_as_zero(taus), abs=1e-6)


def _unset_as_zero(taus: list[float | None]) -> list[float]:
    """The reference's taus as the state stores them: a row with no merge candidate yet holds 0."""
    return [0.0 if t is None else t for t in taus]


def _sequence_order(cache: LayerCache) -> LayerCache:
    """The same entries with each row's slots in position order (what the loop reference reads)."""
    ordered = by_position(cache)
    return LayerCache(k=ordered["k"], v=ordered["v"], log_weight=ordered["log_weight"], length=cache.length.clone(),
                      position=ordered["position"], state={n: t.clone() for n, t in cache.state.items()},
                      slot_meta={n: ordered[n] for n in cache.slot_meta})


def test_options_change_what_they_should() -> None:
    """On one random cache: the window ranking keeps other tokens than col_sum's; merge off leaves kept
    entries untouched; the floor and the sink guard merge fewer entries; the bias marks merged entries."""
    cache = random_cache([[40, 40]], 40, d=4, seed=7)
    keep = 16
    base = D2O().compress(cache, keep)
    window = D2O(scores="window").compress(cache, keep)
    assert live_positions(base, 0, 0) != live_positions(window, 0, 0)
    plain = D2O(merge=False).compress(cache, keep)
    kept = torch.tensor(live_positions(plain, 0, 0))
    assert torch.equal(plain.k[0, 0, :keep], cache.k[0, 0, kept])
    changed = lambda out: int((out.k[0, :, :keep] != cache.k[0][:, torch.tensor(live_positions(out, 0, 0))]).any(-1).sum())  # noqa: E731
    assert changed(base) > changed(D2O(merge_floor=0.9).compress(cache, keep))
    guarded = D2O(merge_into_sinks=False).compress(cache, keep)
    assert torch.equal(guarded.k[0, :, :4], cache.k[0, :, :4])                  # the sinks absorbed nothing
    biased = D2O(merge_bias=True).compress(cache, keep)
    assert bool((biased.log_weight[0, :, :keep] > 0).any()) and bool((biased.log_weight[0, :, :keep] >= 0).all())


def test_merge_protect_keeps_the_top_scores_untouched() -> None:
    """merge_protect=0.5: the 8 highest-scoring of 16 kept entries keep their own K, V in every head (the
    paper merges into some of them on this cache); the others still absorb tokens; the kept set is the same."""
    cache = random_cache([[40, 40]], 40, d=4, seed=7)
    keep = 16
    base, guarded = D2O().compress(cache, keep), D2O(merge_protect=0.5).compress(cache, keep)
    into_top = 0
    for g in range(cache.k.shape[1]):
        pos = torch.tensor(live_positions(guarded, 0, g))           # the general path keeps sequence order
        assert pos.tolist() == live_positions(base, 0, g) == guarded.position[0, g, :keep].tolist()
        top = cache.slot_meta["col_sum"][0, g, pos].argsort(descending=True)[:8]
        rest = torch.tensor([i for i in range(keep) if i not in set(top.tolist())])
        for name in ("k", "v"):
            own = getattr(cache, name)[0, g, pos]                    # [keep, D]: each kept entry's own row
            assert torch.equal(getattr(guarded, name)[0, g, top], own[top])
        assert not torch.equal(guarded.k[0, g, rest], cache.k[0, g, pos[rest]])
        into_top += int((base.k[0, g, top] != cache.k[0, g, pos[top]]).any(-1).sum())
    assert into_top > 0


@pytest.mark.parametrize(("kwargs", "name"), [
    (dict(scores="query"), "scores"), (dict(window=0), "window"), (dict(window_kernel=4), "window_kernel"),
    (dict(merge=1), "merge"), (dict(merge_floor=1.5), "merge_floor"), (dict(merge_floor="high"), "merge_floor"),
    (dict(merge_into_sinks=None), "merge_into_sinks"), (dict(merge_bias="yes"), "merge_bias"),
    (dict(first_compression="never"), "first_compression"), (dict(skip_memory="free"), "skip_memory"),
    (dict(window_pool="median"), "window_pool"),
    (dict(merge_protect=1.0), "merge_protect"), (dict(merge_protect=-0.1), "merge_protect"),
    (dict(merge_protect="half"), "merge_protect"), (dict(merge_protect=True), "merge_protect"),
    (dict(merge_weighting="attention"), "merge_weighting"),
    (dict(n_m_ratio="3-1"), "n_m_ratio"), (dict(n_m_ratio="a:1"), "n_m_ratio"),
])
def test_bad_options_raise(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        get_policy("d2o", **kwargs)


def test_n_m_ratio_from_a_spec() -> None:
    assert get_policy("d2o[n_m_ratio=7:1]").n_m_ratio == (7, 1)
    assert get_policy("d2o[n_m_ratio=7:1]").split(200) == D2O(n_m_ratio=(7, 1)).split(200) == (4, 175, 25)


def test_window_scores_are_asked_for_with_the_options() -> None:
    assert Stat.WINDOW_SCORES not in D2O().stats
    policy = D2O(scores="window", window=8, window_kernel=3)
    assert Stat.WINDOW_SCORES in policy.stats and Stat.COLUMN_SUM in policy.stats
    assert policy.stat_options(Stat.WINDOW_SCORES) == {"obs_window": 8, "kernel": 3, "pool": "avg"}
    wide = D2O(scores="window", window_kernel=31, window_pool="max")
    assert wide.stat_options(Stat.WINDOW_SCORES) == {"obs_window": 32, "kernel": 31, "pool": "max"}
    assert D2O(merge_into_sinks=False).min_budget() == 5


@pytest.mark.parametrize("kwargs", [dict(scores="window"), dict(scores="window", window_kernel=5, window_pool="max"),
                                    dict(first_compression="decode"),
                                    dict(merge_bias=True, merge_into_sinks=False, merge_floor=0.3),
                                    dict(scores="window", window_kernel=5, merge_protect=0.5),
                                    dict(scores="window", merge_weighting="score", d2o_variant="code"),
                                    dict(first_compression="decode", scores="window", d2o_variant="code",
                                         expand_kv_heads=True)])
def test_options_generate_within_the_budget(kwargs: dict, prompt_ids: torch.Tensor) -> None:
    """Through the runtime on a tiny Llama (batch of 2): every layer ends within budget + interval."""
    model = apply_cached("llama", "d2o", 12, allocation="uniform", **kwargs)
    out = model.generate(prompt_ids, max_new_tokens=6, do_sample=False, eos_token_id=None)
    assert out.shape == (2, prompt_ids.shape[1] + 6)
    report = model.last_report
    assert all(n <= 12 + model.policy.interval for n in report.entries.values()), report.entries
    assert report.compressions > 0


@pytest.mark.parametrize("interval", [1, 16])
def test_first_compression_decode_defers_the_prompt(prompt_ids: torch.Tensor, interval: int) -> None:
    """The prompt's buffers (prompt + 1 entries) are compressed after the first decode step into the decode's
    (budget + interval, at most the tokens), also where those are wider than the prompt's (interval 16: 28 > 25)."""
    model = apply_cached("llama", "d2o", 12, allocation="uniform", first_compression="decode", interval=interval)
    n = prompt_ids.shape[1]
    session = model.start(prompt_ids, max_new_tokens=4)
    assert [lay.host_len for lay in session.layers] == [n] * len(session.layers)
    session.step(torch.tensor([1, 2]))
    assert [lay.host_len for lay in session.layers] == [n + 1] * len(session.layers)
    session.step(torch.tensor([3, 4]))                       # compressed first, then this step's entry
    assert [lay.host_len for lay in session.layers] == [13] * len(session.layers)
    assert all(lay.cache.capacity == min(12 + interval, n + 4) for lay in session.layers)
    session.step(torch.tensor([5, 6]))                       # interval 1: due again (evicts one, then writes)
    assert [lay.host_len for lay in session.layers] == [13 if interval == 1 else 14] * len(session.layers)


def test_skip_layers_at_extra_memory_keep_every_token(prompt_ids: torch.Tensor) -> None:
    """skip_memory="extra": the skipped layer holds the whole sequence, the others their own budget."""
    model = apply_cached("llama", "d2o", 12, allocation="uniform", skip_layers=(-1,), skip_memory="extra")
    model.generate(prompt_ids, max_new_tokens=5, do_sample=False, eos_token_id=None)
    report = model.last_report
    assert report.entries[1] == prompt_ids.shape[1] + 4 and report.entries[0] <= 12 + model.policy.interval
    assert list(report.layer_budgets) == [0]


def test_ems_window_scores_rank_by_the_local_score_alone() -> None:
    """EMS scores="window": the prefill partition is the one s_GL gives when s_Glo is zero (max(0, s_Loc))."""
    cache = random_cache([[60, 50]], 60, d=8, seed=3)
    window = EMS(scores="window", rope_inv_freq=(), local_window=8).compress(cache, 20)
    zeroed = LayerCache(k=cache.k, v=cache.v, log_weight=cache.log_weight, length=cache.length, position=cache.position,
                        slot_meta={**cache.slot_meta, "col_sum": torch.zeros_like(cache.slot_meta["col_sum"])})
    want = EMS(rope_inv_freq=(), local_window=8).compress(zeroed, 20)
    default = EMS(rope_inv_freq=(), local_window=8).compress(cache, 20)
    for name in ("k", "v", "position", "length"):
        assert torch.equal(getattr(window, name), getattr(want, name)), name
    assert not torch.equal(window.position, default.position)
    with pytest.raises(ValueError, match="scores"):
        EMS(scores="global")
