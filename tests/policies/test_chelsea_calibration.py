"""Chelsea's outlier heads (docs/policies.md §1.10): the calibration statistic against a direct float64
reference, outlier selection, the budget reallocation, the calibration file, and the split-group
layout (§0.6 b) end to end: outlier heads keep every token, the others are compressed to R', the
cache bytes stay within the nominal budget."""

from __future__ import annotations

import json
import math

import pytest
import torch

import kvpass
from kvpass.budget import budget_tokens, budget_with_full_heads
from kvpass.calibrate import a_set_size, calibrate, unmatched_fraction
from kvpass.policies.calibration import Calibration, load_calibration, select_outliers
from kvpass.policies.chelsea import Chelsea
from tests.policies.policy_helpers import apply_cached, captured_model

SMALL = dict(sinks=4, recent=8, chunk=16, interval=8)


def p_reference(k: torch.Tensor, sinks: int, recent: int, chunk: int, threshold: float) -> float:
    """§1.10 steps 2-3 for one head, with loops in float64: k [T, D] -> p."""
    mid = list(range(sinks, k.shape[0] - recent))
    no_edge = a_count = 0
    for start in range(0, len(mid), chunk):
        part = mid[start:start + chunk]
        for a in part[0::2]:
            a_count += 1
            best = max((float(k[a] @ k[b]) / (float(k[a].norm()) * float(k[b].norm()) + 1e-6) for b in part[1::2]),
                       default=-math.inf)
            no_edge += best < threshold
    return no_edge / a_count


def smooth_keys(hkv: int, t: int, d: int, noise: list[float], seed: int = 0) -> torch.Tensor:
    """[1, Hkv, T, D] float64: a slowly drifting direction plus per-head noise (neighbours similar)."""
    g = torch.Generator().manual_seed(seed)
    drift = torch.randn(hkv, t, d, generator=g, dtype=torch.float64).cumsum(1) * 0.1 + 3.0
    return (drift + torch.tensor(noise, dtype=torch.float64)[:, None, None] *
            torch.randn(hkv, t, d, generator=g, dtype=torch.float64))[None]


@pytest.mark.parametrize("chunk, t", [(5, 26), (8, 29), (16, 61)])    # (5, 26): a last chunk of one entry
def test_unmatched_fraction_matches_reference(chunk, t):
    keys = smooth_keys(4, t, 8, noise=[0.3, 1.0, 2.5, 6.0], seed=chunk)
    pol = Chelsea(sinks=2, recent=3, chunk=chunk)
    got = unmatched_fraction(keys, pol, threshold=0.8)
    want = [p_reference(keys[0, g], 2, 3, chunk, 0.8) for g in range(4)]
    torch.testing.assert_close(got[0], torch.tensor(want, dtype=torch.float64))
    assert min(want) < 0.5 < max(want)                               # the threshold separates the heads
    assert a_set_size(t - 5, chunk) == sum(math.ceil(len(range(s, min(s + chunk, t - 5))) / 2)
                                           for s in range(0, t - 5, chunk))


def test_select_outliers_top_k_ties_and_forced_layers():
    p = [[0.5, 0.9], [0.5, 0.1], [None, None]]                       # layer 2: sliding window, not eligible
    assert select_outliers(p, ratio=0.5) == ((0, 1), (0, 0))         # tie at 0.5: the lower (layer, head)
    assert select_outliers(p, ratio=0.3) == ((0, 1), (0, 0))         # ceil(0.3 * 4) = 2
    assert select_outliers(p, ratio=0.2) == ((0, 1),)
    assert select_outliers(p, ratio=0.5, forced_layers=[1]) == ((1, 0), (1, 1))   # forced count toward the set
    assert select_outliers(p, ratio=0.75, forced_layers=[1]) == ((1, 0), (1, 1), (0, 1))
    g = torch.Generator().manual_seed(0)
    big = torch.rand(30, 3, generator=g, dtype=torch.float64).tolist()
    want = sorted(((layer, h) for layer in range(30) for h in range(3)), key=lambda lh: -big[lh[0]][lh[1]])[:4]
    assert select_outliers(big) == tuple(want)                       # ceil(0.04 * 90) = 4
    for bad in (dict(ratio=0.0), dict(ratio=1.0), dict(forced_layers=[2]), dict(forced_layers=[7])):
        with pytest.raises(ValueError):
            select_outliers(p, **bad)


def test_budget_reallocation_formula():
    # §1.10's example: R = 0.2, 4% outliers -> R' = 0.16 / 0.96 = 0.1667
    assert budget_with_full_heads(0.2, 1200, 100, 4) == math.floor(0.16 / 0.96 * 1200) == 200
    assert budget_with_full_heads(240, 1200, 100, 4) == 200          # a token count: the same total
    assert budget_with_full_heads(0.2, 1200, 100, 0) == budget_tokens(0.2, 1200)
    for heads, full, total in ((90, 4, 5000), (4, 1, 92), (7, 2, 1000)):    # the largest that fits R H total
        kept = budget_with_full_heads(0.4, total, heads, full)
        assert (heads - full) * kept + full * total <= 0.4 * total * heads + 1e-9
        assert (heads - full) * (kept + 1) + full * total > 0.4 * total * heads
    with pytest.raises(ValueError, match="raise the budget"):
        budget_with_full_heads(0.2, 1000, 10, 2)                     # 2 full heads alone are 20%
    with pytest.raises(ValueError, match="at least one head"):
        budget_with_full_heads(0.5, 1000, 2, 2)


def tiny_calibration(outliers, layers=2, kv_heads=2, head_dim=16) -> Calibration:
    p = tuple(tuple(0.1 * (layer * kv_heads + h) for h in range(kv_heads)) for layer in range(layers))
    return Calibration(model="tiny", model_type="llama", layers=layers, kv_heads=kv_heads, head_dim=head_dim,
                       p=p, outliers=tuple(outliers), settings=(("samples", 2), ("text", "random")))


def test_calibration_file_round_trip(tmp_path):
    cal = tiny_calibration([(1, 0), (0, 1)])
    path = cal.save(tmp_path / "sub" / "tiny.json")
    data = json.loads(path.read_text())
    assert data["outliers"] == [[1, 0], [0, 1]] and data["layers"] == 2 and len(data["p"]) == 2
    assert load_calibration(path) == cal and load_calibration(str(path)) == cal
    assert Chelsea(calibration=str(path)).calibration == cal
    shipped = load_calibration("smollm2")                             # kvpass/calibrations/smollm2.json
    assert (shipped.layers, shipped.kv_heads, len(shipped.outliers)) == (30, 3, math.ceil(0.04 * 90))


@pytest.mark.parametrize("edit, message", [
    (lambda d: "{not json", "not JSON"),
    (lambda d: {**d, "format": "other"}, "'format'"),
    (lambda d: {**d, "p": d["p"][:1]}, "p must be 2 x 2"),
    (lambda d: {**d, "p": [[0.1, 2.0], [0.1, 0.1]]}, "numbers in [0, 1]"),
    (lambda d: {**d, "outliers": [[0, 5]]}, "is not a (layer, kv_head)"),
    (lambda d: {**d, "outliers": [[0, 1], [0, 1]]}, "listed twice"),
    (lambda d: {**d, "outliers": "0,1"}, "'outliers' must be"),
    (lambda d: {k: v for k, v in d.items() if k != "layers"}, "'layers'"),
])
def test_malformed_calibration_files_raise(tmp_path, edit, message):
    data = edit(tiny_calibration([(0, 1)]).to_dict())
    path = tmp_path / "bad.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    with pytest.raises(ValueError, match="not a valid calibration file") as err:
        load_calibration(path)
    assert message in str(err.value)


def test_calibration_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="kvpass calibrate"):                # kvpass.errors.InvalidValue
        Chelsea(calibration=str(tmp_path / "missing.json"))
    model = captured_model("llama")[0]
    with pytest.raises(ValueError, match="does not fit a model with 2 layers"):
        apply_cached("llama", "chelsea", 0.2, calibration=tiny_calibration([(0, 0)], layers=3))
    with pytest.raises(ValueError, match="2 KV heads"):
        apply_cached("llama", "chelsea", 0.2, calibration=tiny_calibration([(0, 0)], kv_heads=4))
    with pytest.raises(ValueError, match=r"calibration belongs to: chelsea"):
        kvpass.apply(model, policy="h2o", budget=0.2, calibration=tiny_calibration([(0, 0)]))


# ------------------------------------------------------------------ split-group layout, end to end
def prompt(b: int, t: int) -> torch.Tensor:
    return torch.randint(1, 128, (b, t), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("outliers", [[(0, 1)], [(0, 0), (1, 1)], [(0, 0), (0, 1)]])   # last: a whole layer full
def test_split_layout_is_exact_at_full_budget(outliers):
    """Budget 1.0 compresses nothing: any error in routing heads to their group or putting the
    outputs back into head order would change the tokens."""
    ids = prompt(2, 40)
    want = apply_cached("llama", "full", 1.0).generate(ids, max_new_tokens=10, eos_token_id=[])
    km = apply_cached("llama", "chelsea", 1.0, calibration=tiny_calibration(outliers), **SMALL)
    km.prefill_rows = 1                                              # rows prefilled apart, then stacked
    assert torch.equal(km.generate(ids, max_new_tokens=10, eos_token_id=[]), want)
    assert km.last_report.full_heads == {layer: tuple(h for lh, h in outliers if lh == layer)
                                         for layer in sorted({lh for lh, _ in outliers})}


def test_outlier_heads_keep_every_token_and_others_are_compressed():
    km = apply_cached("llama", "chelsea", 0.4, calibration=tiny_calibration([(0, 1)]), **SMALL)
    ids, new = prompt(2, 80), 12
    session = km.start(ids, max_new_tokens=new)
    for i in range(new - 1):
        session.step(torch.full((2,), 3 + i))
    seen = 80 + new - 1
    split, plain = session.layers
    assert split.full is not None and plain.full is None
    assert split.full.k.shape[1] == 1 and split.cache.k.shape[1] == 1      # KV head 1 full, head 0 compressed
    assert split.full.length.tolist() == [[seen], [seen]]
    assert torch.equal(split.full.position[:, :, :seen], torch.arange(seen).expand(2, 1, seen))
    assert torch.equal(split.full.log_weight[:, :, :seen], torch.zeros(2, 1, seen))   # no merged entries
    keep = budget_with_full_heads(0.4, 80 + new, 4, 1)
    assert keep == math.floor((0.4 * 4 - 1) / 3 * 92) == 18
    for lay in (split, plain):
        assert lay.budget == keep and int(lay.cache.length.max()) <= keep + SMALL["interval"]
        assert float(lay.cache.log_weight.max()) > 0                 # merged entries (log N > 0)
    # the full head's K equals what the model computes: the prompt's keys of KV head 1, layer 0
    prefill_k = km.graphs.prefill(ids, torch.arange(80).expand(2, 80), torch.zeros(2, dtype=torch.long))[1]
    torch.testing.assert_close(split.full.k[:, :, :80], prefill_k[:, 1:2])


def test_cache_bytes_stay_within_the_nominal_budget():
    ids = prompt(2, 80)
    km = apply_cached("llama", "chelsea", 0.4, calibration=tiny_calibration([(0, 1)]), **SMALL)
    km.generate(ids, max_new_tokens=12, eos_token_id=[])
    nominal = apply_cached("llama", "chelsea", 0.4, **SMALL)
    nominal.generate(ids, max_new_tokens=12, eos_token_id=[])
    got, ref = km.last_report, nominal.last_report
    assert got.layer_budgets == {0: 18, 1: 18} and ref.layer_budgets == {0: 36, 1: 36}
    assert got.cache_bytes <= ref.cache_bytes
    # the real allocation: 3 compressed heads of R' * total + interval slots and 1 full head of every
    # token, fewer slots than 4 heads of R * total + interval; cache_bytes counts every buffer
    session = km.start(ids, max_new_tokens=12)
    slots = sum(c.k.shape[1] * c.capacity for lay in session.layers for c in lay.caches())
    assert slots == 3 * (18 + 8) + 92 <= 4 * (36 + 8)
    assert got.cache_bytes == sum(c.nbytes() for lay in session.layers for c in lay.caches())


def test_generate_with_a_calibration_file_end_to_end(tmp_path):
    path = tiny_calibration([(1, 0)]).save(tmp_path / "tiny.json")
    km = apply_cached("llama", "chelsea", 0.4, calibration=str(path), **SMALL)      # kvpass.apply, one trace
    out = km.generate(prompt(1, 80), max_new_tokens=8, eos_token_id=[])
    assert out.shape == (1, 88) and km.last_report.full_heads == {1: (0,)}
    assert km.last_report.compressions > 0


def test_calibrate_reads_post_rope_keys_of_every_layer():
    """calibrate's p equals the reference on the keys transformers caches (post-RoPE), per layer."""
    model = captured_model("llama")[0]
    seqs = [prompt(1, 70)[0].tolist(), prompt(1, 70)[0].flip(0).tolist()]
    pol = Chelsea(sinks=2, recent=4, chunk=8)
    cal = calibrate(model, seqs, name="tiny", policy=pol, threshold=0.3, ratio=0.25, progress=False,
                    runner=apply_cached("llama", "full", 1.0))
    want = torch.zeros(2, 2, dtype=torch.float64)
    with torch.no_grad():
        for seq in seqs:
            cache = model(torch.tensor([seq]), use_cache=True).past_key_values
            for layer in range(2):
                k = cache.layers[layer].keys[0].double()
                want[layer] += torch.tensor([p_reference(k[g], 2, 4, 8, 0.3) for g in range(2)])
    torch.testing.assert_close(torch.tensor(cal.p, dtype=torch.float64), want / 2, atol=1e-6, rtol=0)
    assert len(cal.outliers) == 1 and cal.p[cal.outliers[0][0]][cal.outliers[0][1]] == max(max(r) for r in cal.p)
    assert (cal.layers, cal.kv_heads, cal.head_dim, cal.model_type) == (2, 2, 16, "llama")


def test_calibrate_skips_sliding_window_layers():
    model = captured_model("gemma3")[0]                              # layer 0 sliding, layer 1 full attention
    cal = calibrate(model, [prompt(1, 40)[0].tolist()], name="tiny-gemma3", policy=Chelsea(sinks=2, recent=4, chunk=8),
                    progress=False, runner=apply_cached("gemma3", "full", 1.0))
    assert cal.p[0] == (None,) and cal.p[1][0] is not None and cal.outliers == ((1, 0),)
    with pytest.raises(ValueError, match="at least one head must be compressed"):   # its only compressible head
        apply_cached("gemma3", "chelsea", 0.5, calibration=cal, sinks=2, recent=4, chunk=8).generate(
            prompt(1, 40), max_new_tokens=2)


@pytest.mark.slow          # ~30-80 s on 2 cores: a trace of SmolLM2 and two 1.5k-token generates
@pytest.mark.real_model
def test_shipped_smollm2_calibration_on_the_real_model(smollm2):
    """kvpass/calibrations/smollm2.json (written by `kvpass calibrate`) fits SmolLM2; its heads stay
    full and the cache is no larger than the uncalibrated one at the same budget."""
    from kvpass.prompts import chat_ids, needle_prompt

    model, tokenizer = smollm2
    ids = torch.tensor([chat_ids(tokenizer, needle_prompt(tokenizer, 1500, 0.5, seed=1).messages())])
    km = kvpass.apply(model, policy="chelsea", budget=0.2, calibration="smollm2")
    km.generate(ids, max_new_tokens=4, do_sample=False)
    nominal = kvpass.apply(model, Chelsea(), 0.2, captured=km.captured)
    nominal.generate(ids, max_new_tokens=4, do_sample=False)
    got, ref = km.last_report, nominal.last_report
    cal = load_calibration("smollm2")
    assert got.full_heads == cal.heads_by_layer(km.graphs.sites) and sum(map(len, got.full_heads.values())) == 4
    total = ids.shape[1] + 4
    assert set(got.layer_budgets.values()) == {budget_with_full_heads(0.2, total, 90, 4)}
    assert got.cache_bytes <= ref.cache_bytes < ref.full_cache_bytes
