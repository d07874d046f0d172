"""CaM (docs/policies.md §6.4, streaming version) against a direct loop over evicted tokens."""

from __future__ import annotations

import pytest
import torch

from kvpass.policies import get_policy
from kvpass.policies.cam import CaM, hashed_uniform, merged_values
from tests.policies.policy_helpers import live_positions, random_cache


def reference_cam(cache, keep: int, sinks: int, m: int, seed: int) -> dict:
    out = {}
    b_rows, hkv = cache.length.shape
    for b in range(b_rows):
        for g in range(hkv):
            s = int(cache.length[b, g])
            v = cache.v[b, g].double().clone()
            acc = cache.slot_meta["col_sum"][b, g].double()
            s0 = min(sinks, keep - 1)
            for e in range(s0, s0 + max(s - keep, 0)):          # leave the window in sequence order
                targets = list(range(e + 1, min(e + 1 + m, s)))
                mean = sum(float(acc[t]) for t in targets) / len(targets)
                p = min(max(float(acc[e]) / mean, 0.0), 1.0) if mean > 0 else 0.0
                u = float(hashed_uniform(cache.position[b, g, e:e + 1], torch.tensor([g]), seed)[0])
                if u < p:
                    for t in targets:
                        v[t] += v[e] / m
            kept = list(range(s)) if s <= keep else list(range(s0)) + list(range(s - (keep - s0), s))
            out[(b, g)] = (kept, v[kept])
    return out


@pytest.mark.parametrize("keep, m, capacity", [(10, 4, 30), (6, 16, 30), (3, 2, 30), (40, 4, 30),
                                               (10, 4, 36), (20, 3, 33)])
def test_matches_reference(keep: int, m: int, capacity: int) -> None:
    # capacity > the longest row: the loop runs to capacity - keep and must mask the extra offsets
    cache = random_cache([[30, 28, 30], [21, 21, 25]], c=capacity, seed=6)
    got = CaM(merge_window=m).compress(cache, keep)
    want = reference_cam(cache, keep, 4, m, 0)
    for (b, g), (kept, v) in want.items():
        assert live_positions(got, b, g) == kept
        torch.testing.assert_close(got.v[b, g, : len(kept)].double(), v)
        torch.testing.assert_close(got.k[b, g, : len(kept)], cache.k[b, g, kept])      # keys untouched


def test_merging_happens_and_is_seeded() -> None:
    cache = random_cache([[30]], c=30, seed=6)
    a, b = CaM().compress(cache, 10), CaM().compress(cache, 10)
    plain = cache.v[0, 0, live_positions(a, 0, 0)]
    assert not torch.allclose(a.v[0, 0, :10], plain)                     # values received evicted mass
    torch.testing.assert_close(a.v, b.v)                                  # deterministic
    assert not torch.allclose(CaM(seed=1).compress(cache, 10).v, a.v)   # the seed matters


def test_zero_scores_give_no_nan() -> None:
    cache = random_cache([[30]], c=30, seed=6)
    cache.slot_meta["col_sum"].zero_()
    got = CaM().compress(cache, 5)
    assert torch.isfinite(got.v).all()


def test_bad_merge_window_raises() -> None:
    with pytest.raises(ValueError, match="merge_window"):
        get_policy("cam", merge_window=0)


def replayed_values(cache, keep: int, sinks: int, m: int, seed: int) -> torch.Tensor:
    """The eviction-by-eviction replay CaM.compress used before ``merged_values`` (vectorised over rows,
    one Python step per evicted slot): v [B, Hkv, C, D] fp64 before the kept slots are gathered."""
    length = cache.length
    n_evict = (length - keep).clamp(min=0)
    c = cache.capacity
    acc = cache.slot_meta["col_sum"].double()
    v = cache.v.double().clone()
    head = torch.arange(length.shape[1])[None, :].expand_as(length)
    for offset in range(max(c - keep, 0)):
        e = sinks + offset
        targets = slice(e + 1, min(e + 1 + m, c))
        present = torch.arange(targets.start, targets.stop) < length[..., None]
        mean = (acc[:, :, targets] * present).sum(-1) / present.sum(-1)
        p = torch.nan_to_num((acc[:, :, e] / mean).clamp(0.0, 1.0), nan=0.0)
        on = (hashed_uniform(cache.position[:, :, e], head, seed) < p) & (offset < n_evict)
        v[:, :, targets] += (on[..., None] & present)[..., None] * v[:, :, e:e + 1] / m
    return v


@pytest.mark.parametrize("lengths, c, keep, m, block", [
    ([[300, 287, 300], [211, 300, 64]], 300, 40, 16, 256),   # several blocks, ragged rows, one short row
    ([[300, 287, 300], [211, 300, 64]], 300, 40, 16, 7),     # blocks smaller than the merge window
    ([[120, 97]], 130, 9, 3, 16),
    ([[17]], 17, 16, 16, 256),                                # one eviction (a decode-time compression)
])
def test_merged_values_match_the_replay(lengths, c, keep, m, block) -> None:
    cache = random_cache(lengths, c=c, seed=11)
    sinks = min(4, keep - 1)
    want = replayed_values(cache, keep, sinks, m, 0)
    got = merged_values(cache, keep, sinks, m, 0, block)
    live = cache.position >= 0
    assert not torch.allclose(want[live], cache.v.double()[live])           # merges happened
    torch.testing.assert_close(got[live], want[live], rtol=1e-10, atol=1e-10)


def test_long_merge_chains_match_the_replay() -> None:
    # every draw says merge (scores equal): each value carries all earlier ones down the row
    cache = random_cache([[400, 400]], c=400, seed=3)
    cache.slot_meta["col_sum"].fill_(1.0)
    want = replayed_values(cache, 10, 4, 16, 0)
    torch.testing.assert_close(merged_values(cache, 10, 4, 16, 0, 64), want, rtol=1e-10, atol=1e-8)


def test_compress_reads_nothing_back_to_the_host() -> None:
    # under FakeTensorMode any data-dependent read (.item(), bool(), int() of a tensor) raises
    from torch._subclasses.fake_tensor import FakeTensorMode

    cache = random_cache([[60, 58]], c=64, seed=2, dtype=torch.float32)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = type(cache)(**{f: mode.from_tensor(getattr(cache, f)) for f in ("k", "v", "log_weight", "length",
                                                                              "position")},
                           slot_meta={n: mode.from_tensor(t) for n, t in cache.slot_meta.items()})
        out = CaM().compress(fake, 48)
    assert out.v.shape == (1, 2, 48, 8)


def test_first_compression_decode_attends_the_whole_prompt_once(prompt_ids: torch.Tensor) -> None:
    """first_compression="decode" (kvpress CAMPress's timing): the first decode step attends the whole prompt,
    so its logits are the full cache's; the prompt is compressed before the second step, which then
    differs from the full cache and matches no longer; every layer ends within budget + interval."""
    from tests.policies.policy_helpers import apply_cached

    full = apply_cached("llama", "full", 1.0)
    deferred = apply_cached("llama", "cam", 8, first_compression="decode", sinks=2, merge_window=4)
    eager = apply_cached("llama", "cam", 8, sinks=2, merge_window=4)
    first = torch.tensor([5, 7])
    sessions = [m.start(prompt_ids, max_new_tokens=3) for m in (full, deferred, eager)]
    assert [lay.host_len for lay in sessions[1].layers] == [prompt_ids.shape[1]] * len(sessions[1].layers)
    after_first = [s.step(first) for s in sessions]
    torch.testing.assert_close(after_first[1], after_first[0])
    assert not torch.allclose(after_first[2], after_first[0], atol=1e-4)
    assert [lay.host_len for lay in sessions[1].layers] == [prompt_ids.shape[1] + 1] * len(sessions[1].layers)
    after_second = [s.step(first + 1) for s in sessions]
    assert [lay.host_len for lay in sessions[1].layers] == [9] * len(sessions[1].layers)
    assert not torch.allclose(after_second[1], after_second[0], atol=1e-4)


def test_bad_first_compression_raises() -> None:
    with pytest.raises(ValueError, match="first_compression"):
        get_policy("cam", first_compression="never")
