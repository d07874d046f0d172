"""StreamingLLM (docs/policies.md §6.2): sinks + recent window, against a direct reference; the budget
holds over a long decode; sliding layers keep their window."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

import kvpass
from kvpass.cache import LayerCache, load_into
from kvpass.policies.streamingllm import StreamingLLM
from tests.policies.policy_helpers import by_position, check_rows_compress_as_alone, random_cache


def _cache(lengths: list[list[int]], c: int, d: int = 4) -> LayerCache:
    b, h = len(lengths), len(lengths[0])
    cache = LayerCache.empty(b, h, c, d, torch.float64, "cpu")
    for i in range(b):
        for j in range(h):
            n = lengths[i][j]
            cache.k[i, j, :n] = torch.randn(n, d, dtype=torch.float64)
            cache.v[i, j, :n] = torch.randn(n, d, dtype=torch.float64)
            cache.log_weight[i, j, :n] = 0.0
            cache.position[i, j, :n] = torch.arange(100, 100 + n)
            cache.length[i, j] = n
    return cache


def _reference_keep(n: int, keep: int, sinks: int) -> list[int]:
    """The slots StreamingLLM keeps, written as a plain loop."""
    if n <= keep:
        return list(range(n))
    return [i for i in range(n) if i < sinks or i >= n - (keep - sinks)]


def test_compress_matches_the_reference():
    torch.manual_seed(0)
    lengths = [[30, 7], [12, 30]]                     # ragged rows, one shorter than the budget
    cache = _cache(lengths, c=32)
    out = StreamingLLM(sinks=4).compress(cache, keep=10)
    for i, row in enumerate(lengths):
        for j, n in enumerate(row):
            want = _reference_keep(n, 10, 4)
            got_n = int(out.length[i, j])
            assert got_n == len(want)
            assert out.position[i, j, :got_n].tolist() == [100 + s for s in want]
            assert torch.equal(out.k[i, j, :got_n], cache.k[i, j, want])
            assert torch.equal(out.v[i, j, :got_n], cache.v[i, j, want])
            assert (out.log_weight[i, j, got_n:] == float("-inf")).all()


def test_a_smaller_budget_drops_more():
    cache = _cache([[30]], c=32)
    assert int(StreamingLLM().compress(cache, keep=20).length) == 20
    assert int(StreamingLLM().compress(cache, keep=8).length) == 8


def test_budget_holds_over_a_2000_step_decode_and_windows_stay_full():
    torch.manual_seed(0)
    cfg = transformers.Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                                        max_position_embeddings=4096, sliding_window=8, initializer_range=0.1,
                                        layer_types=["sliding_attention", "full_attention"])
    model = AutoModelForCausalLM.from_config(cfg).eval()
    kv = kvpass.apply(model, policy="streamingllm", budget=64, sinks=4, interval=16)
    session = kv.start(torch.randint(1, 128, (2, 50)), max_new_tokens=2000)
    ring, full = session.layers
    assert ring.window == 8 and full.compressible and full.budget == 64
    for step in range(2000):
        logits = session.step(session.logits.argmax(-1))
        live = int(full.cache.length.max())
        assert live <= 64 + 16, f"step {step}: {live} entries"
        assert live == full.host_len                              # host bookkeeping agrees with the device
        assert int(ring.cache.length.min()) == 8                  # the ring holds its whole window
        assert torch.isfinite(logits).all()
    newest = full.cache.position[0, 0, : int(full.cache.length[0, 0])]
    assert newest[:4].tolist() == [0, 1, 2, 3] and int(newest[-1]) == 50 + 2000 - 1
    ring_pos = sorted(ring.cache.position[0, 0].tolist())
    assert ring_pos == list(range(2049 - 7, 2050))                # exactly the last 8 positions
    # first compression when the 50-token prompt has grown to 64 + 16, then every 16 steps
    assert session.compressions == len(range(31, 2001, 16))


@pytest.mark.parametrize("interval", [1, 4])
@pytest.mark.parametrize("seed", range(3))
def test_in_place_decode_compression_keeps_the_same_entries(interval: int, seed: int) -> None:
    """``compress_into`` (in place: the kept tail entries fill the evicted slots) over 30 simulated decode
    steps holds the same entries (K, V, positions, log-weights, slot scores) as the pure ``compress``
    chain, whose slots stay in sequence order, in the same buffers; ragged rows, one that never fills."""
    policy = StreamingLLM(sinks=3, interval=interval)
    keep = 10
    c = keep + interval
    gen = torch.Generator().manual_seed(200 + seed)
    pure = random_cache([[keep, 4, keep - 2], [keep, keep, 7]], c=c, seed=seed, extra_meta=("col_sum",))
    fast = LayerCache(**{f: getattr(pure, f).clone() for f in ("k", "v", "log_weight", "length", "position")},
                      slot_meta={n: t.clone() for n, t in pure.slot_meta.items()})
    addresses = [t.data_ptr() for t in fast.tensors()]
    for step in range(30):
        k_new, v_new = torch.randn(2, 2, 3, 8, generator=gen, dtype=torch.float64).unbind(0)
        grows = torch.tensor([[True, step % 7 == 0, True], [True, True, step % 2 == 0]])  # ragged growth
        for cache in (pure, fast):                                            # the decode step's write at slot length
            slot = cache.length.clamp(max=c - 1)[..., None]
            pos = cache.position.amax(-1, keepdim=True) + 1
            write = grows[..., None]
            for name, new in (("k", k_new), ("v", v_new)):
                t = getattr(cache, name)
                old = t.gather(2, slot[..., None].expand(-1, -1, 1, 8))
                t.scatter_(2, slot[..., None].expand(-1, -1, 1, 8), torch.where(write[..., None], new[:, :, None], old))
            cache.log_weight.scatter_(2, slot, torch.where(write, 0.0, cache.log_weight.gather(2, slot)))
            cache.position.scatter_(2, slot, torch.where(write, pos, cache.position.gather(2, slot)))
            cache.slot_meta["col_sum"].scatter_(2, slot, torch.where(write, float(step), cache.slot_meta["col_sum"].gather(2, slot)))
            cache.length.add_(grows.long())
        if int(pure.length.max()) == c:                                       # the runtime's length check
            load_into(pure, policy.compress(pure, keep))
            policy.compress_into(fast, keep)
        assert [t.data_ptr() for t in fast.tensors()] == addresses
        torch.testing.assert_close(fast.length, pure.length, rtol=0, atol=0)
        want, got = by_position(pure), by_position(fast)
        for name in want:
            torch.testing.assert_close(got[name], want[name], msg=f"step {step}: {name}", rtol=0, atol=0)
    assert int(fast.length[0, 1]) < keep                                      # a row that never filled
    assert not torch.equal(fast.position, pure.position)                      # the layouts did diverge


@pytest.mark.parametrize("seed", range(3))
def test_rows_of_their_own_budgets_compress_each_as_alone(seed: int) -> None:
    """``compress_rows_into`` with a budget per row: a row holding its budget + interval entries ends slot for slot as
    ``compress_into`` leaves it alone; a row not due (over its budget, below its capacity) is left bit for bit."""
    check_rows_compress_as_alone(StreamingLLM(sinks=3, interval=4), [10, 6, 8], [[14, 14], [10, 10], [9, 11]],
                                 [True, True, False], "col_sum", seed)
