"""Chunked prefill (``prefill_chunk``, kvpass/runtime/chunked_prefill.py): ``full`` gives the unchunked tokens and logits
whatever the chunk (padded batches, sliding-window rings, groups of rows); a chunk of at least the prompt is the
unchunked run exactly for every policy; with small chunks every compressed layer holds at most budget + chunk
entries (``GenerationReport.peak_entries``) while the unchunked prefill holds the prompt; with nothing evicted the
statistics chunks accumulate or replace are the unchunked prefill's; refusals name ``prefill_chunk``."""

from __future__ import annotations

import pytest
import torch

import kvpass
from kvpass.errors import InvalidType, InvalidValue, OutOfDeviceMemory
from kvpass.policies import POLICIES
from kvpass.runtime.chunked_prefill import chunk_bounds
from tests.conftest import padded_batch
from tests.policies.policy_helpers import apply_cached, by_position

# parameters that let every policy compress a 48-token prompt several times at a budget of 24 (as test_bounded)
SMALL = {"chelsea": dict(sinks=2, recent=8, chunk=8, interval=4), "snapkv": dict(window=4),
         "pyramidkv": dict(window=4), "streamingllm": dict(sinks=4), "adakv": dict(inner="snapkv"),
         "clusterkv": dict(sinks=4, window=8, cluster_ratio=4, full_layers=0), "quest": dict(page_size=8, full_layers=0)}
CHUNKABLE = sorted(name for name, cls in POLICIES.items() if cls.prefill_chunks)
LENGTHS = [48, 6, 33]             # row 1's first chunks are all padding; its first chunk holds no real token


def _run(kv, ids, mask, chunk, new=6):
    out = kv.generate(ids, attention_mask=mask, max_new_tokens=new, eos_token_id=None, prefill_chunk=chunk,
                      return_dict_in_generate=True, output_logits=True)
    return out, torch.stack(out.logits, 1)


def test_chunks_are_balanced_and_bounded():
    assert chunk_bounds(10, 4) == [(0, 3), (3, 6), (6, 10)]
    assert chunk_bounds(8, 8) == [(0, 8)] and chunk_bounds(5, 100) == [(0, 5)]
    for t, c in [(4096 * 32 + 7, 4096), (100, 1), (31, 7)]:
        bounds = chunk_bounds(t, c)
        sizes = [b - a for a, b in bounds]
        assert bounds[0][0] == 0 and bounds[-1][1] == t and max(sizes) <= c and max(sizes) - min(sizes) <= 1
        assert all(a == b for (_, a), (b, _) in zip(bounds, bounds[1:], strict=False))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3", "mistral"])
def test_full_chunked_equals_unchunked(arch):
    """gemma3: a sliding layer (window 16) kept as a ring; mistral: every layer sliding."""
    ids, mask = padded_batch(LENGTHS, seed=3)
    kv = apply_cached(arch, "full", 1.0)
    want, want_logits = _run(kv, ids, mask, None)
    for chunk in (1, 7, 16):
        got, logits = _run(kv, ids, mask, chunk)
        assert torch.equal(got.sequences, want.sequences), (arch, chunk)
        torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)
        assert got.report.prefill_chunk == chunk and want.report.prefill_chunk is None
        for site in kv.graphs.sites:                  # full: the whole prompt either way, a sliding layer its window
            peak = got.report.peak_entries[site.layer]
            if site.window is None:
                assert peak == want.report.peak_entries[site.layer] == 48 + 5
            else:
                assert peak <= site.window + max(b - a for a, b in chunk_bounds(48, chunk)) < 48


def test_full_chunked_in_groups_of_rows_equals_unchunked():
    ids, mask = padded_batch(LENGTHS, seed=4)
    kv = apply_cached("llama", "full", 1.0)
    want, want_logits = _run(kv, ids, mask, None)
    kv.prefill_rows = 2
    try:
        got, logits = _run(kv, ids, mask, 10)
    finally:
        kv.prefill_rows = None
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("policy", CHUNKABLE)
def test_a_chunk_holding_the_prompt_is_the_unchunked_run(policy):
    ids, mask = padded_batch(LENGTHS, seed=5)
    kv = apply_cached("llama", policy, 24, **SMALL.get(policy, {}))
    want, want_logits = _run(kv, ids, mask, None)
    for chunk in (48, 100):
        got, logits = _run(kv, ids, mask, chunk)
        assert torch.equal(got.sequences, want.sequences) and torch.equal(logits, want_logits), (policy, chunk)


@pytest.mark.parametrize("policy", CHUNKABLE + ["d2o[expand_kv_heads=true]", "d2o[first_compression=decode]",
                                                "d2o[scores=window]"])
def test_small_chunks_bound_every_compressed_layer(policy):
    """Every compressed layer holds at most (the most one head may hold at its budget) + chunk entries at any time,
    the unchunked prefill the prompt; a compressing policy compresses during the prefill and changes the logits."""
    name, _, _ = policy.partition("[")
    ids, mask = padded_batch(LENGTHS, seed=6)
    kv = apply_cached("llama", policy, 24, **SMALL.get(name, {}))
    full_logits = _run(apply_cached("llama", "full", 1.0), ids, mask, None)[1]
    plain = _run(kv, ids, mask, None)[0]
    chunk = 10
    got, logits = _run(kv, ids, mask, chunk)
    size = max(b - a for a, b in chunk_bounds(48, chunk))
    report = got.report
    assert got.sequences.shape == (3, 54) and torch.isfinite(logits).all()
    heads = kv.graphs.sites[0].n_kv_heads
    interval = getattr(kv.policy, "interval", 1)
    for layer, peak in report.peak_entries.items():
        if layer in report.layer_budgets:
            cap = kv.policy.head_capacity(report.layer_budgets[layer], heads)
            deferred = int(kv.policy.prompt_compression_deferred())     # the last chunk and the first step
            assert peak <= max(cap + size + deferred, cap + interval), (policy, layer, peak, cap, size)
            assert plain.report.peak_entries[layer] >= 48             # the whole prompt (+ a deferred step)
        else:                                         # every token kept (full, recall policies)
            assert peak == plain.report.peak_entries[layer]
    if report.layer_budgets:
        assert min(report.peak_entries[la] for la in report.layer_budgets) < 48
    if kv.policy.compresses:
        assert report.compressions > plain.report.compressions
        assert not torch.allclose(logits, full_logits, atol=1e-4)


@pytest.mark.parametrize("policy, stat, extra", [("h2o", "col_sum", {}), ("snapkv", "window_scores", {"window": 4}),
                                                 ("tova", "last_attn", {}), ("d2o", "col_sum", {})])
def test_statistics_without_evictions_are_the_unchunked_ones(policy, stat, extra):
    """At a budget of every token nothing is evicted: column sums added up over chunks, and the last chunk's
    observation window (or last query) over every entry, are the unchunked prefill's."""
    ids, mask = padded_batch(LENGTHS, seed=7)
    kv = apply_cached("llama", policy, 1.0, **extra)
    want = kv.start(ids, mask, max_new_tokens=3, prefill_chunk=None)
    got = kv.start(ids, mask, max_new_tokens=3, prefill_chunk=9)
    assert got.compressions == 0 and got.prefill_chunk == 9
    for a, b in zip(got.layers, want.layers, strict=True):
        torch.testing.assert_close(by_position(a.cache)[stat], by_position(b.cache)[stat], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(by_position(a.cache)["k"], by_position(b.cache)["k"], rtol=1e-5, atol=1e-6)
    if policy == "d2o":                               # the head variance is the first chunk's, not the prompt's
        var = [lay.cache.state["attn_var"] for lay in got.layers]
        assert all(not torch.allclose(v, w.cache.state["attn_var"]) for v, w in zip(var, want.layers, strict=True))


def test_the_memory_check_counts_a_chunk_not_the_prompt():
    ids = torch.randint(1, 128, (1, 200), generator=torch.Generator().manual_seed(8))
    kv = apply_cached("llama", "streamingllm", 0.2, sinks=4)
    kv.free_bytes = lambda device: 150_000        # below the whole prompt's prefill, above one chunk's
    try:
        with pytest.raises(OutOfDeviceMemory):
            kv.generate(ids, max_new_tokens=4, eos_token_id=None)
        out = kv.generate(ids, max_new_tokens=4, eos_token_id=None, prefill_chunk=16, return_dict_in_generate=True)
    finally:
        kv.free_bytes = None
    assert out.sequences.shape == (1, 204) and max(out.report.peak_entries.values()) <= 41 + 16


def test_apply_sets_the_default_and_generate_overrides_it(tiny_llama_prompt=None):
    from tests.conftest import tiny_model

    ids, mask = padded_batch(LENGTHS, seed=9)
    kv = kvpass.apply(tiny_model("llama"), "h2o", 24, prefill_chunk=10)
    assert kv.prefill_chunk == 10
    chunked = kv.generate(ids, attention_mask=mask, max_new_tokens=2, eos_token_id=None, return_dict_in_generate=True)
    plain = kv.generate(ids, attention_mask=mask, max_new_tokens=2, eos_token_id=None, prefill_chunk=None,
                        return_dict_in_generate=True)
    assert chunked.report.prefill_chunk == 10 and plain.report.prefill_chunk is None
    assert max(chunked.report.peak_entries.values()) < max(plain.report.peak_entries.values())


@pytest.mark.parametrize("value, error", [(0, InvalidValue), (-3, InvalidValue), ("64", InvalidType),
                                          (True, InvalidType), (2.5, InvalidType)])
def test_bad_values_are_refused(value, error):
    from tests.conftest import tiny_model

    with pytest.raises(error) as info:
        kvpass.apply(tiny_model("llama"), "h2o", 24, prefill_chunk=value)
    assert info.value.argument == "prefill_chunk" and "prefill_chunk" in str(info.value)
    kv = apply_cached("llama", "h2o", 24)
    with pytest.raises(error) as info:
        kv.generate(torch.ones(1, 8, dtype=torch.long), max_new_tokens=2, prefill_chunk=value)
    assert info.value.argument == "prefill_chunk"


def test_a_policy_that_cannot_chunk_is_refused():
    from tests.conftest import tiny_model

    with pytest.raises(InvalidValue) as info:
        kvpass.apply(tiny_model("llama"), "ems", 24, local_window=8, prefill_chunk=16)
    assert info.value.argument == "prefill_chunk" and "ems" in str(info.value)
    kv = apply_cached("llama", "ems", 24, local_window=8)
    with pytest.raises(InvalidValue, match="prefill_chunk=16 cannot be used with policy ems"):
        kv.generate(torch.ones(1, 40, dtype=torch.long), max_new_tokens=2, prefill_chunk=16)
    assert kv.generate(torch.ones(1, 40, dtype=torch.long), max_new_tokens=2).shape == (1, 42)   # unchunked: fine
