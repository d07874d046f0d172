"""``expand_kv_heads=True`` (docs/policies.md §0.5, §4.10, §5.3): the cache holds K, V repeated G = Hq/Hkv
times, so every policy scores, evicts and merges per query head, at G times the memory.

References: plain transformers (``full``); transformers' own eager attention probabilities (the
per-query-head column sums H2O ranks by) with ``H2O.compress`` on the explicitly repeated cache; and
the same policy, not expanded, on an MHA twin of the model whose KV projections are repeated per query
head (D2O, H2O: the whole generation)."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from transformers import AutoModelForCausalLM

import kvpass
from kvpass.cache import entries_from_prompt
from kvpass.policies import POLICIES, get_policy
from kvpass.policies.h2o import H2O
from kvpass.rewrites import expand_kv_heads
from tests.conftest import padded_batch, tiny_model
from tests.policies.policy_helpers import apply_cached, captured_model

G = 2                          # tiny llama: 4 query heads over 2 KV heads
GEN = dict(do_sample=False, pad_token_id=0, eos_token_id=None, return_dict_in_generate=True, output_logits=True)


def test_sites_are_expanded_to_one_head_per_query_head() -> None:
    _, _, sites = captured_model("llama")
    wide = expand_kv_heads(list(sites))
    assert [(s.n_kv_heads, s.kv_repeat, s.group, s.model_kv_heads) for s in wide] == [(4, G, 1, 2)] * 2
    assert expand_kv_heads(wide) == wide                                   # idempotent
    _, _, mha = captured_model("gpt2")                                     # nothing to expand
    assert expand_kv_heads(list(mha)) == list(mha)


def test_the_flag_is_a_field_of_every_policy() -> None:
    for name in POLICIES:
        assert get_policy(name, expand_kv_heads=True).expand_kv_heads is True
        assert get_policy(name).expand_kv_heads is False
    with pytest.raises(ValueError, match="expand_kv_heads must be True or False"):
        get_policy("d2o", expand_kv_heads="yes")


@pytest.mark.parametrize("lengths", [[21], [21, 14, 9]], ids=["batch1", "batch3-left-padded"])
def test_full_expanded_reproduces_transformers(lengths: list[int]) -> None:
    model = tiny_model("llama")
    ids, mask = padded_batch(lengths)
    want = model.generate(ids, attention_mask=mask, max_new_tokens=12, **GEN)
    km = kvpass.apply(model, policy="full", expand_kv_heads=True)
    got = km.generate(ids, attention_mask=mask, max_new_tokens=12, **GEN)
    assert torch.equal(got.sequences, want.sequences)
    err = max((a.float() - b.float()).abs().max().item() for a, b in zip(got.logits, want.logits, strict=True))
    assert err < 1e-4, f"max logit difference {err}"
    session = km.start(ids, mask, max_new_tokens=1)                       # the cache really is per query head
    k = session.layers[0].cache.k
    assert k.shape[1] == 4 and torch.equal(k[:, 0], k[:, 1]) and torch.equal(k[:, 2], k[:, 3])
    assert not torch.equal(k[:, 1], k[:, 2])


@pytest.mark.parametrize("policy", ["full", "h2o"])
def test_cache_bytes_are_g_times_larger(policy: str, prompt_ids: torch.Tensor) -> None:
    reports = {}
    for expand in (False, True):
        km = apply_cached("llama", policy, 12, expand_kv_heads=expand)
        km.generate(prompt_ids, max_new_tokens=4, eos_token_id=[])
        reports[expand] = km.last_report
    plain, wide = reports[False], reports[True]
    assert wide.cache_bytes == G * plain.cache_bytes
    assert wide.full_cache_bytes == plain.full_cache_bytes               # the model's own full cache
    assert wide.entries == plain.entries and wide.layer_budgets == plain.layer_budgets


def _eager_copy(model: torch.nn.Module) -> torch.nn.Module:
    twin = copy.deepcopy(model)
    twin.set_attn_implementation("eager")
    return twin


def test_h2o_expanded_ranks_each_query_head_by_its_own_attention(prompt_ids: torch.Tensor) -> None:
    """Prefill statistics are transformers' per-query-head column sums (not a group mean), and the kept
    entries of every query head are H2O.compress of the explicitly repeated cache under those scores."""
    model, _, _ = captured_model("llama")
    keep = 10
    with torch.no_grad():
        attn = _eager_copy(model)(prompt_ids, output_attentions=True).attentions    # per layer [B, Hq, T, T]
    wide = apply_cached("llama", "h2o", keep, expand_kv_heads=True, interval=1)
    plain = apply_cached("llama", "h2o", keep, interval=1)
    pre_wide, pre_plain = wide.prefill(prompt_ids), plain.prefill(prompt_ids)
    session = wide.start_from(pre_wide)
    grouped = plain.start_from(pre_plain)
    differs = False
    for layer, probs in enumerate(attn):
        col = probs.float().sum(dim=2)                                               # [B, Hq, T]
        torch.testing.assert_close(pre_wide.stats[layer]["col_sum"], col, atol=1e-5, rtol=1e-5)
        k, v = (x.repeat_interleave(G, dim=1) for x in pre_plain.kv[2 * layer: 2 * layer + 2])
        torch.testing.assert_close(pre_wide.kv[2 * layer], k)
        ref = H2O(interval=1).compress(entries_from_prompt(k, v, pre_plain.pad, {"col_sum": col}), keep)
        got = session.layers[layer].cache
        assert torch.equal(got.length, ref.length) and (got.length == keep).all()
        assert torch.equal(got.position[..., :keep], ref.position[..., :keep])
        torch.testing.assert_close(got.k[..., :keep, :], ref.k)
        mean = grouped.layers[layer].cache.position[..., :keep].repeat_interleave(G, dim=1)
        differs |= not torch.equal(got.position[..., :keep], mean)
    assert differs, "per-query-head selection never differed from the group mean: the test could not fail"


@functools.cache
def _mha_twin() -> torch.nn.Module:
    """The tiny llama with its KV projections repeated per query head: an MHA model computing exactly
    what the GQA model computes, whose plain (per KV head) cache is the expanded cache of the original."""
    model, _, _ = captured_model("llama")
    cfg = copy.deepcopy(model.config)
    cfg.num_key_value_heads = cfg.num_attention_heads
    twin = AutoModelForCausalLM.from_config(cfg).eval()
    state = dict(model.state_dict())
    for name, w in model.state_dict().items():
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            hkv, d = model.config.num_key_value_heads, w.shape[0] // model.config.num_key_value_heads
            state[name] = w.reshape(hkv, d, -1).repeat_interleave(G, dim=0).reshape(-1, w.shape[1])
    twin.load_state_dict(state)
    return twin


@pytest.mark.parametrize("policy, kwargs", [("h2o", {}), ("d2o", {}), ("d2o", {"d2o_variant": "code", "interval": 3})])
def test_expanded_equals_the_policy_on_an_mha_twin(policy: str, kwargs: dict, prompt_ids: torch.Tensor) -> None:
    """Expanded D2O / H2O = the same policy, per KV head, on a model whose KV heads are explicitly repeated:
    same tokens, and at the end the same kept positions and (merged) keys of every query head."""
    model, _, _ = captured_model("llama")
    twin = _mha_twin()
    with torch.no_grad():
        torch.testing.assert_close(twin(prompt_ids).logits, model(prompt_ids).logits, atol=1e-5, rtol=1e-5)
    new = 8
    ref_km = kvpass.apply(twin, policy=policy, budget=10, **kwargs)
    got_km = apply_cached("llama", policy, 10, expand_kv_heads=True, **kwargs)
    plain_km = apply_cached("llama", policy, 10, **kwargs)
    runs = {}
    for name, km in (("ref", ref_km), ("got", got_km), ("plain", plain_km)):
        session = km.start(prompt_ids, max_new_tokens=new)
        tokens, logits = session.sample(new, torch.tensor([], dtype=torch.long), 0, output_logits=True, do_sample=False)
        runs[name] = tokens, torch.stack(logits, 1), [lay.cache for lay in session.layers], session.compressions
    (t_ref, l_ref, c_ref, n_ref), (t_got, l_got, c_got, n_got), (_, _, c_plain, _) = (runs[n] for n in
                                                                                          ("ref", "got", "plain"))
    assert torch.equal(t_got, t_ref) and n_got == n_ref > 0
    torch.testing.assert_close(l_got, l_ref, atol=1e-4, rtol=1e-4)
    for got, ref in zip(c_got, c_ref, strict=True):
        assert got.k.shape[1] == 4
        assert torch.equal(got.length, ref.length) and torch.equal(got.position, ref.position)
        torch.testing.assert_close(got.k, ref.k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.v, ref.v, atol=1e-5, rtol=1e-5)
    same_as_grouped = [torch.equal(g.position, p.position.repeat_interleave(G, dim=1))
                       for g, p in zip(c_got, c_plain, strict=True)]
    assert not all(same_as_grouped), "per-query-head eviction kept what the group mean kept: the test could not fail"


SMALL = {"snapkv": {"window": 4}, "pyramidkv": {"window": 4}, "ems": {"local_window": 4},
         "chelsea": {"sinks": 4, "recent": 8, "chunk": 16, "interval": 8},
         "clusterkv": {"sinks": 4, "cluster_ratio": 8, "window": 4, "window_clusters": 2, "full_layers": 1},
         "quest": {"full_layers": 0}, "kvmerger": {"interval": 8}}


@pytest.mark.parametrize("arch", ["llama", "gemma3"])          # GQA (G = 2) and MQA (G = 4, a sliding layer)
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_generates_expanded(arch: str, policy: str) -> None:
    ids = torch.randint(1, 128, (2, 40), generator=torch.Generator().manual_seed(3))
    km = apply_cached(arch, policy, 16, expand_kv_heads=True, **SMALL.get(policy, {}))
    out = km.generate(ids, max_new_tokens=6, eos_token_id=[], **{k: v for k, v in GEN.items() if "token" not in k})
    assert out.sequences.shape == (2, 46)
    assert torch.isfinite(torch.stack(out.logits, 1)).all()
    assert all(s.n_kv_heads == s.n_heads and s.group == 1 for s in km.graphs.sites)
    report = out.report
    interval = getattr(km.policy, "interval", 1)
    assert sum(report.layer_budgets.values()) == len(report.layer_budgets) * report.budget_tokens
    for layer, b in report.layer_budgets.items():
        assert report.entries[layer] <= b + interval
    if km.policy.compresses:
        assert report.layer_budgets and report.compressions > 0
    assert report.cache_bytes > 0 and report.full_cache_bytes == sum(
        2 * 2 * s.model_kv_heads * s.head_dim * 46 * 4 for s in km.graphs.sites)


def test_a_prefill_of_another_layout_is_refused(prompt_ids: torch.Tensor) -> None:
    wide = apply_cached("llama", "h2o", 12, expand_kv_heads=True)
    plain = apply_cached("llama", "h2o", 12)
    with pytest.raises(ValueError, match="expand_kv_heads differs"):
        wide.prefill(prompt_ids, graphs=plain.graphs)


def test_chelsea_outlier_heads_keep_every_copy() -> None:
    """A calibration names the model's KV heads; expanded, all G copies of an outlier head stay full."""
    from kvpass.policies.calibration import Calibration

    model, _, sites = captured_model("llama")
    cal = Calibration(model="tiny", model_type="llama", layers=2, kv_heads=2, head_dim=16,
                      p=((0.0, 0.9), (0.0, 0.0)), outliers=((0, 1),), settings=())
    km = apply_cached("llama", "chelsea", 24, expand_kv_heads=True, calibration=cal, sinks=4, recent=8, chunk=16,
                      interval=8)
    assert km.graphs.full_heads == {0: (2, 3)}
    out = km.generate(torch.randint(1, 128, (1, 40), generator=torch.Generator().manual_seed(3)), max_new_tokens=4,
                      eos_token_id=[], return_dict_in_generate=True, output_logits=True)
    assert torch.isfinite(torch.stack(out.logits, 1)).all() and out.report.full_heads == {0: (2, 3)}


