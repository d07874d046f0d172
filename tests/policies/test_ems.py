"""EMS (docs/policies.md §4) against the float64 loop reference of ``ems_reference.py``: prefill sets and
expansion tables, one decode step's demotion / merge / slot overflow, the expansion attention op
against plain attention over the explicitly expanded cache, and properties of long decodes."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import kvpass
from kvpass.cache import LayerCache, with_capacity
from kvpass.kernels import decode_attention_reference, ems_expansion_attention_reference
from kvpass.policies import get_policy
from kvpass.policies.ems import (
    BUDGET,
    EMS,
    ENTRY,
    FOUNDER,
    GLO,
    KNORM,
    KRAW,
    LOC_CUR,
    LOC_PAST,
    POS,
    PROB,
    unrotate,
)
from tests.conftest import padded_batch
from tests.policies import ems_reference as ref
from tests.policies.merging_support import prompt, tiny_model
from tests.policies.policy_helpers import ARCHS, apply_cached, captured_model

INV_FREQ = (1.0, 0.3, 0.05)          # rotate-half RoPE over the first 6 of 8 dims (2 pass through)


def clustered_cache(lengths: list[list[int]], c: int, d: int = 8, seed: int = 0) -> LayerCache:
    """Random float64 cache whose keys/values are noisy copies of 4 prototypes (so that both merges and
    zero-class evictions happen), with positive random s_Glo / s_Loc."""
    g = torch.Generator().manual_seed(seed)
    b, hkv = len(lengths), len(lengths[0])
    proto_k, proto_v = torch.randn(4, d, generator=g, dtype=torch.float64), torch.randn(4, d, generator=g, dtype=torch.float64)
    pick = torch.randint(0, 4, (b, hkv, c), generator=g)
    k = proto_k[pick] + 0.5 * torch.randn(b, hkv, c, d, generator=g, dtype=torch.float64)
    v = proto_v[pick] + 0.5 * torch.randn(b, hkv, c, d, generator=g, dtype=torch.float64)
    k = k * (0.5 + torch.rand(b, hkv, c, 1, generator=g, dtype=torch.float64))       # varied norms
    length = torch.tensor(lengths)
    live = torch.arange(c)[None, None] < length[..., None]
    meta = {"col_sum": torch.rand(b, hkv, c, generator=g, dtype=torch.float64) * live,
            "window_scores": torch.rand(b, hkv, c, generator=g, dtype=torch.float64) * live}
    return LayerCache(k=k * live[..., None], v=v * live[..., None], log_weight=torch.where(live, 0.0, -math.inf).float(),
                      length=length, position=torch.where(live, torch.arange(c), -1), slot_meta=meta)


def table_of(out: LayerCache, b: int, g: int) -> dict[int, dict]:
    """{slot position: its row of the slot table, with the owner's position}."""
    st = out.state
    rows = {}
    for t in range(st[ENTRY].shape[-1]):
        e = int(st[ENTRY][b, g, t])
        if e < 0:
            continue
        rows[int(st[POS][b, g, t])] = dict(owner=int(out.position[b, g, e]), entry=e, knorm=float(st[KNORM][b, g, t]),
                                           glo=float(st[GLO][b, g, t]), loc_past=float(st[LOC_PAST][b, g, t]),
                                           loc_cur=float(st[LOC_CUR][b, g, t]), founder=bool(st[FOUNDER][b, g, t]))
    return rows


# ------------------------------------------------------------------ prefill (§4.6)
@pytest.mark.parametrize("with_pos", [False, True])
def test_prefill_matches_reference(with_pos):
    keep, win, tau, gamma = 8, 3, 0.3, 2.0
    pol = EMS(local_window=win, tau=tau, gamma=gamma, with_pos=with_pos, rope_inv_freq=INV_FREQ)
    cache = clustered_cache([[40, 33], [26, 40]], c=40, seed=1)
    out = pol.compress(cache, keep)
    assert out.capacity == keep and out.state[ENTRY].shape[-1] == pol.n_slots(keep) == 16
    seen = {"merged": 0, "zero": 0, "evicted": 0}
    for b in range(2):
        for g in range(2):
            n = int(cache.length[b, g])
            want = ref.prefill_reference(cache.k[b, g, :n], cache.v[b, g, :n], cache.slot_meta["col_sum"][b, g, :n],
                                         cache.slot_meta["window_scores"][b, g, :n], keep, win, tau, gamma,
                                         None if with_pos else INV_FREQ)
            table = table_of(out, b, g)
            assert {p: r["owner"] for p, r in table.items()} == want["owner"]          # kept + merged tokens
            assert set(range(n)) - set(table) == want["evicted"] | want["zero"]
            entries = out.position[b, g, : int(out.length[b, g])].tolist()
            assert entries == sorted(want["centres"] | want["local"])                   # N_budget entries, in order
            for p, r in table.items():
                assert r["knorm"] == pytest.approx(float(cache.k[b, g, p].norm()))
                assert r["glo"] == pytest.approx(float(cache.slot_meta["col_sum"][b, g, p]))
                assert r["loc_past"] == pytest.approx(float(cache.slot_meta["window_scores"][b, g, p]))
                assert r["founder"] == (p == r["owner"])
            for e, p in enumerate(entries):
                k_e = out.k[b, g, e]
                torch.testing.assert_close(k_e / k_e.norm(), want["khat"][p])
                torch.testing.assert_close(out.v[b, g, e], want["vent"][p])
                if not with_pos:
                    torch.testing.assert_close(out.slot_meta[KRAW][b, g, e], want["kraw"][p], rtol=1e-5, atol=1e-5)
            seen["merged"] += sum(1 for p, o in want["owner"].items() if o != p)
            seen["zero"] += len(want["zero"])
            seen["evicted"] += len(want["evicted"])
    assert all(seen.values()), seen                                                     # every outcome occurs


def test_prompt_within_budget_is_kept_whole():
    pol = EMS(local_window=3, rope_inv_freq=())
    cache = clustered_cache([[10, 7]], c=10)
    out = pol.prepare(with_capacity(cache, 13), layer=0, budget=12)
    assert out.capacity == 13 and out.length.tolist() == [[10, 7]]
    torch.testing.assert_close(out.k, with_capacity(cache, 13).k)
    for g, n in enumerate((10, 7)):
        assert {p: r["owner"] for p, r in table_of(out, 0, g).items()} == {p: p for p in range(n)}


# ------------------------------------------------------------------ one decode step (§4.8)
def reference_state(out: LayerCache, b: int, g: int):
    slots = [dict(pos=p, owner=r["owner"], knorm=r["knorm"], glo=r["glo"], loc_past=r["loc_past"],
                  loc_cur=r["loc_cur"], founder=r["founder"]) for p, r in table_of(out, b, g).items()]
    entries = {}
    for e in range(int(out.length[b, g])):
        k = out.k[b, g, e]
        entries[int(out.position[b, g, e])] = {"k": k / k.norm(), "v": out.v[b, g, e],
                                               "kraw": out.slot_meta[KRAW][b, g, e] if KRAW in out.slot_meta else None}
    return slots, entries


@pytest.mark.parametrize("with_pos, tau", [(False, -1.0), (True, -1.0), (False, 1.0), (False, 0.5)])
def test_decode_step_matches_reference(with_pos, tau):
    keep, win, gamma = 8, 3, 2.0
    pol = EMS(local_window=win, tau=0.0, gamma=gamma, with_pos=with_pos, rope_inv_freq=INV_FREQ)
    cache = pol.compress(clustered_cache([[40, 36]], c=40, seed=2), keep)
    cache = with_capacity(cache, keep + 1)
    g_ = torch.Generator().manual_seed(3)
    # the step's attention: the new token at entry `length`, probabilities of every slot and of the new token
    n = cache.length.clone()
    pos_new = torch.tensor([[40, 36]])
    k_new, v_new = torch.randn(1, 2, 8, generator=g_, dtype=torch.float64), torch.randn(1, 2, 8, generator=g_, dtype=torch.float64)
    cache.state[PROB] = torch.rand(cache.state[PROB].shape, generator=g_, dtype=torch.float64).float() * (cache.state[ENTRY] >= 0)
    p_new = torch.rand(1, 2, generator=g_).double() * 0.1
    for gg in range(2):
        e = int(n[0, gg])
        cache.k[0, gg, e], cache.v[0, gg, e] = k_new[0, gg], v_new[0, gg]
        cache.log_weight[0, gg, e] = 0.0
        cache.position[0, gg, e] = pos_new[0, gg]
        cache.slot_meta["col_sum"][0, gg, e] = p_new[0, gg]
    cache.length = n + 1
    before = [reference_state(cache, 0, gg) for gg in range(2)]
    probs = [{int(cache.state[POS][0, gg, t]): float(cache.state[PROB][0, gg, t])
              for t in range(cache.state[ENTRY].shape[-1]) if int(cache.state[ENTRY][0, gg, t]) >= 0} for gg in range(2)]
    pol = EMS(local_window=win, tau=tau, gamma=gamma, with_pos=with_pos, rope_inv_freq=INV_FREQ)
    out = pol.maintain(cache, layer=0)
    assert out.length.tolist() == [[keep, keep]] and out.capacity == keep + 1
    outcomes = set()
    for gg in range(2):
        slots, entries = before[gg]
        for s in slots:
            s["prob"] = probs[gg][s["pos"]]
        p = int(pos_new[0, gg])
        kraw_new = ref.unit(ref.unrotate(k_new[0, gg], p, INV_FREQ))
        want_slots, want_entries, c_loc, demoted, dest = ref.decode_step_reference(
            slots, entries, {"pos": p, "k": k_new[0, gg], "v": v_new[0, gg], "kraw": kraw_new, "prob": float(p_new[0, gg])},
            keep, win, tau, pol.n_slots(keep), 0, with_pos)
        outcomes.add(dest is not None)
        got = table_of(out, 0, gg)
        assert {pp: r["owner"] for pp, r in got.items()} == {s["pos"]: s["owner"] for s in want_slots}
        for s in want_slots:
            r = got[s["pos"]]
            assert (r["glo"], r["loc_cur"], r["loc_past"]) == pytest.approx((s["glo"], s["loc_cur"], s["loc_past"]), rel=1e-5)
            assert r["founder"] == s["founder"]
        assert out.position[0, gg, :keep].tolist() == sorted(want_entries)
        for e, pp in enumerate(sorted(want_entries)):
            k_e = out.k[0, gg, e]
            torch.testing.assert_close(k_e / k_e.norm(), want_entries[pp]["k"], rtol=1e-5, atol=1e-5)   # fp32 scores
            torch.testing.assert_close(out.v[0, gg, e], want_entries[pp]["v"], rtol=1e-5, atol=1e-5)
            if not with_pos:
                torch.testing.assert_close(out.slot_meta[KRAW][0, gg, e], want_entries[pp]["kraw"], rtol=1e-5, atol=1e-5)
    if tau == -1.0:
        assert outcomes == {True}                                   # merged at centre level (and slot overflow)
    if tau == 1.0:
        assert outcomes == {False}                                  # zero class: the demoted centre's slots deleted


# ------------------------------------------------------------------ expansion attention (§4.7)
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_expansion_equals_attention_over_expanded_cache(softcap):
    g = torch.Generator().manual_seed(4)
    b, hkv, group, c, s, d = 2, 2, 3, 9, 14, 8
    q = torch.randn(b, hkv * group, 1, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, hkv, c, d, generator=g, dtype=torch.float64) * 3     # any norm: directions are used
    v = torch.randn(b, hkv, c, d, generator=g, dtype=torch.float64)
    lw = torch.zeros(b, hkv, c)
    lw[:, :, 8] = -math.inf                                                 # an empty entry
    entry = torch.randint(0, 7, (b, hkv, s), generator=g)                   # entry 7 unnamed: implicit slot
    entry[:, :, 11:] = -1                                                   # free slots
    knorm = torch.rand(b, hkv, s, generator=g, dtype=torch.float64).float() * 4
    prob = torch.zeros(b, hkv, s)
    o, scores = ems_expansion_attention_reference(q, k, v, lw, entry, knorm, prob, 0.4, softcap, want_scores=True)
    for bb in range(b):
        for gg in range(hkv):
            used = [t for t in range(s) if int(entry[bb, gg, t]) >= 0]
            k_exp = [float(knorm[bb, gg, t]) * k[bb, gg, int(entry[bb, gg, t])] / k[bb, gg, int(entry[bb, gg, t])].norm() for t in used]
            v_exp = [v[bb, gg, int(entry[bb, gg, t])] for t in used]
            named = {int(entry[bb, gg, t]) for t in used}
            implicit = [e for e in range(c) if e not in named and float(lw[bb, gg, e]) == 0.0]
            assert 7 in implicit
            k_exp += [k[bb, gg, e] for e in implicit]                       # implicit slots: plain tokens
            v_exp += [v[bb, gg, e] for e in implicit]
            kx, vx = torch.stack(k_exp)[None, None], torch.stack(v_exp)[None, None]
            qx = q[bb:bb + 1, gg * group:(gg + 1) * group]
            want, want_p = decode_attention_reference(qx, kx, vx, torch.zeros(1, 1, len(k_exp)), 0.4, softcap, True)
            torch.testing.assert_close(o[bb:bb + 1, gg * group:(gg + 1) * group], want)
            n_used = len(used)
            torch.testing.assert_close(prob[bb, gg, used].double(), want_p[0, 0, :n_used], rtol=1e-5, atol=1e-6)
            mass = torch.zeros(c, dtype=torch.float64).index_add_(0, entry[bb, gg, used], want_p[0, 0, :n_used])
            mass[implicit] += want_p[0, 0, n_used:]
            torch.testing.assert_close(scores[bb, gg], mass)
    assert float(prob[:, :, 11:].abs().sum()) == 0.0
    plain, _ = decode_attention_reference(q, k, v, lw, 0.4, softcap)
    assert not torch.allclose(o, plain)                                     # the table matters


def test_empty_table_is_dense_attention():
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 4, 1, 8, generator=g), torch.randn(1, 2, 6, 8, generator=g), torch.randn(1, 2, 6, 8, generator=g))
    lw = torch.zeros(1, 2, 6)
    lw[..., 5] = -math.inf
    o, _ = ems_expansion_attention_reference(q, k, v, lw, torch.full((1, 2, 4), -1), torch.zeros(1, 2, 4),
                                             torch.zeros(1, 2, 4), 0.3)
    torch.testing.assert_close(o, decode_attention_reference(q, k, v, lw, 0.3)[0])


def test_unrotate_inverts_transformers_rope():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    g = torch.Generator().manual_seed(6)
    d, r = 8, 4
    inv_freq = 1.0 / (100.0 ** (torch.arange(0, d, 2).float() / d))
    pos = torch.tensor([[0, 5, 77, 1000]])
    freqs = pos[..., None].float() * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    raw = torch.randn(1, 1, 4, d, generator=g)
    _, rotated = apply_rotary_pos_emb(raw, raw, emb.cos(), emb.sin())
    back = unrotate(rotated, pos[None].expand(1, 1, 4), tuple(inv_freq.tolist()))
    torch.testing.assert_close(back, raw, rtol=1e-4, atol=1e-4)
    assert len(inv_freq) == r
    bound = get_policy("ems").bind_model(tiny_model("llama"))
    assert bound.rope_inv_freq == tuple(tiny_model("llama").model.rotary_emb.inv_freq.tolist())
    assert get_policy("ems").bind_model(tiny_model("gpt2")).rope_inv_freq == ()


# ------------------------------------------------------------------ properties of long decodes
SMALL = dict(local_window=4)


def test_long_decode_keeps_window_and_budget():
    km = apply_cached("llama", "ems", 12, **SMALL)
    session = km.start(prompt(2, 40), max_new_tokens=30)
    pol = km.policy
    for step in range(30):
        tok = session.logits.argmax(-1)
        session.step(tok)
        seen = 40 + step + 1
        for lay in session.layers:
            cache = lay.cache
            assert int(cache.length.max()) <= 12                                    # the budget, every step
            assert int((cache.state[ENTRY] >= 0).sum(-1).max()) <= pol.n_slots(12)
            for b in range(2):
                for g in range(cache.length.shape[1]):
                    n = int(cache.length[b, g])
                    assert cache.position[b, g, n - 4:n].tolist() == list(range(seen - 4, seen))   # the window, exact
                    rows = table_of(cache, b, g)
                    assert all(rows[p]["owner"] == p and rows[p]["founder"] for p in range(seen - 4, seen))
                    assert max(rows) == seen - 1 and all(r["owner"] <= p for p, r in rows.items())
    assert km.policy.report([lay.cache for lay in session.layers])["ems_slots_per_entry"] > 1.0   # merges happened


def test_tiny_budget_has_no_nan():
    km = apply_cached("qwen2", "ems", 3, local_window=2, tau=-1.0, gamma=8.0)
    out = km.generate(prompt(2, 50), max_new_tokens=30, eos_token_id=[], return_dict_in_generate=True, output_logits=True)
    assert torch.isfinite(torch.stack(out.logits)).all()


def test_batch_rows_are_independent():
    ids, mask = padded_batch([50, 37], seed=3)
    km = apply_cached("llama", "ems", 14, **SMALL)
    both = km.generate(ids, attention_mask=mask, max_new_tokens=20, eos_token_id=[], return_dict_in_generate=True,
                       output_logits=True)
    for row, n in enumerate((50, 37)):
        alone = km.generate(ids[row:row + 1, -n:], max_new_tokens=20, eos_token_id=[], return_dict_in_generate=True,
                            output_logits=True)
        torch.testing.assert_close(torch.stack(both.logits, 1)[row], torch.stack(alone.logits, 1)[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("lengths, budget", [([40, 8, 31], 0.4), ([40, 23, 31], 0.9)], ids=["mixed", "all-fit"])
def test_rows_of_different_budgets_share_one_cache(lengths, budget):
    """Left-padded rows with a fraction budget: every row gets its own N_budget (its own prompt + new tokens)
    and its own table of S = gamma * N_budget slots in the layer's table (as wide as the widest row's), and
    keeps exactly the entries and slots it keeps alone, every step. "mixed": rows compressed at prefill to
    different budgets beside a row whose prompt fits its budget (tabled at ``prepare``); "all-fit": no row
    compressed at prefill, every budget different. fp64 (the rows' scores then agree to the last bit that
    decides a near-tie; tests/runtime/test_rows_independent.py)."""
    new = 12
    km = kvpass.apply(copy.deepcopy(captured_model("llama")[0]).double(), "ems", budget, **SMALL)
    ids, mask = padded_batch(lengths, seed=5)
    both = km.start(ids, mask, max_new_tokens=new)
    alone = [km.start(ids[r:r + 1, ids.shape[1] - n:], max_new_tokens=new) for r, n in enumerate(lengths)]
    budgets = [int(budget * (n + new)) for n in lengths]
    assert len(set(budgets)) == len(budgets)
    for step in range(new):
        for r, solo in enumerate(alone):
            for lay, own in zip(both.layers, solo.layers, strict=True):
                c, o = lay.cache, own.cache
                assert c.state[BUDGET][r].tolist() == [budgets[r]] * c.length.shape[1]
                assert c.state[ENTRY].shape[-1] == km.policy.n_slots(max(budgets))
                assert int((c.state[ENTRY][r] >= 0).sum(-1).max()) <= km.policy.n_slots(budgets[r])
                for g in range(c.length.shape[1]):
                    assert c.position[r, g, :int(c.length[r, g])].tolist() == o.position[0, g, :int(o.length[0, g])].tolist()
                    got, want = table_of(c, r, g), table_of(o, 0, g)
                    assert {p: (x["owner"], x["founder"]) for p, x in got.items()} == \
                        {p: (x["owner"], x["founder"]) for p, x in want.items()}, (step, r, g)
        if step < new - 1:
            tok = both.logits.argmax(-1)
            both.step(tok)
            for r, solo in enumerate(alone):
                assert torch.equal(solo.logits.argmax(-1), tok[r:r + 1])
                solo.step(tok[r:r + 1])
    for r, solo in enumerate(alone):
        torch.testing.assert_close(both.logits[r:r + 1], solo.logits, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------ generate, errors
@pytest.mark.parametrize("arch", ARCHS)
def test_generate_within_budget(arch):
    km = apply_cached(arch, "ems", 20, **SMALL)
    out = km.generate(prompt(2, 80), max_new_tokens=10, eos_token_id=[])
    assert out.shape == (2, 90)
    report = km.last_report
    for layer, budget in report.layer_budgets.items():
        assert budget == 20 and report.entries[layer] <= budget + 1
    if report.layer_budgets:
        assert report.compressions > 0 and report.policy_stats["ems_slots_per_entry"] >= 1.0


@pytest.mark.parametrize("with_pos", [False, True])
def test_budget_changes_output_and_large_budget_is_exact(with_pos):
    ids = prompt(1, 80)
    full = apply_cached("llama", "full", 1.0).generate(ids, max_new_tokens=16, eos_token_id=[])
    big = apply_cached("llama", "ems", 1.0, with_pos=with_pos, **SMALL).generate(ids, max_new_tokens=16, eos_token_id=[])
    small = apply_cached("llama", "ems", 10, with_pos=with_pos, **SMALL).generate(ids, max_new_tokens=16, eos_token_id=[])
    assert torch.equal(big, full)
    assert not torch.equal(small, full)


def test_bad_hyperparameters_raise():
    for kwargs in ({"local_window": 0}, {"pool_kernel": 4}, {"tau": 1.5}, {"gamma": 0.5}, {"gamma": math.inf},
                   {"with_pos": "yes"}):
        with pytest.raises(ValueError):
            EMS(**kwargs)
    with pytest.raises(ValueError, match="local_window"):
        EMS(local_window=8).compress(clustered_cache([[20]], c=20), 8)
    with pytest.raises(ValueError, match="minimum"):
        kvpass.apply(tiny_model("llama"), policy="ems", budget=8, local_window=8)       # before any tracing


def test_decode_compression_runs_the_policy_bound_to_the_model(monkeypatch):
    """The decode steps compress with the policy ``bind_model`` gave the runtime (EMS: the model's RoPE
    frequencies, so "w.o. pos" compares un-rotated keys), the same one the prefill compressed with."""
    km = kvpass.apply(tiny_model("llama"), policy="ems", budget=12, **SMALL)
    assert km.policy.rope_inv_freq is not None
    seen = []
    compress = EMS.compress
    monkeypatch.setattr(EMS, "compress", lambda self, cache, keep: seen.append(self.rope_inv_freq)
                        or compress(self, cache, keep))
    km.generate(prompt(2, 40), max_new_tokens=8, do_sample=False)
    assert seen and all(f == km.policy.rope_inv_freq for f in seen)
