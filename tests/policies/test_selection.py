"""Shared eviction mechanics (kvpass/policies/selection.py) against direct references."""

from __future__ import annotations

import pytest
import torch

from kvpass.policies.selection import kept_slots, ordered_slots, sort_rank


@pytest.mark.parametrize("seed", range(5))
def test_ordered_slots_is_the_stable_sort_of_set_then_unset_slots(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for c in (1, 2, 7, 33):
        mask = torch.rand(2, 3, c, generator=g) < torch.rand((), generator=g)
        for count in {0, 1, c // 2, c}:
            got = ordered_slots(mask, count)
            for b in range(2):
                for h in range(3):
                    row = mask[b, h].tolist()
                    want = [j for j in range(c) if row[j]] + [j for j in range(c) if not row[j]]
                    assert got[b, h].tolist() == want[:count]


def test_kept_slots_of_all_set_and_none_set() -> None:
    kept = torch.tensor([[[True] * 5, [False] * 5]])
    assert kept_slots(kept, 3).tolist() == [[[0, 1, 2], [0, 1, 2]]]


@pytest.mark.parametrize("descending", [False, True])
def test_sort_rank_is_each_place_in_a_stable_sort(descending: bool) -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 4, (2, 3, 17), generator=g).float()            # many ties
    rank = sort_rank(x, descending=descending)
    for row, got in zip(x.reshape(-1, 17).tolist(), rank.reshape(-1, 17).tolist(), strict=True):
        key = (lambda i, row=row: (-row[i], i)) if descending else (lambda i, row=row: (row[i], i))
        want = [0] * 17
        for place, i in enumerate(sorted(range(17), key=key)):
            want[i] = place
        assert got == want


def _write_step(cache, k_new, v_new, grows, scores, c: int) -> None:
    """The decode step's write of one entry at slot ``length`` (rows where ``grows``), slot scores ``scores``."""
    slot = cache.length.clamp(max=c - 1)[..., None]
    pos = cache.position.amax(-1, keepdim=True) + 1
    write = grows[..., None]
    d = cache.k.shape[-1]
    for name, new in (("k", k_new), ("v", v_new)):
        t = getattr(cache, name)
        idx = slot[..., None].expand(-1, -1, 1, d)
        t.scatter_(2, idx, torch.where(write[..., None], new[:, :, None], t.gather(2, idx)))
    cache.log_weight.scatter_(2, slot, torch.where(write, 0.0, cache.log_weight.gather(2, slot)))
    cache.position.scatter_(2, slot, torch.where(write, pos, cache.position.gather(2, slot)))
    for name, t in cache.slot_meta.items():
        t.scatter_(2, slot, torch.where(write, scores[name], t.gather(2, slot)))
    cache.length.add_(grows.long())


@pytest.mark.parametrize("spec", ["snapkv[window=3,kernel=1]", "h2o[recent_ratio=0.3,sinks=2]", "pyramidkv[window=2]"])
@pytest.mark.parametrize("interval", [1, 4])
@pytest.mark.parametrize("seed", range(2))
def test_keep_top_into_holds_compress_exactly(spec: str, interval: int, seed: int) -> None:
    """SnapKV's, H2O's and PyramidKV's ``compress_into`` (``keep_top_into``) over 30 simulated decode steps: the
    same entries (K, V, positions, log-weights, slot scores) as the out-of-place ``compress`` + ``load_into``
    chain, whose slots stay in sequence order (distinct scores, so no ties), in the same buffers; its own slots
    fill holes, so the layouts diverge and the recent window must go by position. Ragged rows, one that never
    fills."""
    import kvpass
    from kvpass.cache import LayerCache, load_into
    from tests.policies.policy_helpers import by_position, random_cache

    policy = kvpass.get_policy(spec.replace("]", f",interval={interval}]"))
    keep, c = 10, 10 + interval
    gen = torch.Generator().manual_seed(300 + seed)
    pure = random_cache([[keep, 4, keep - 2], [keep, keep, 7]], c=c, seed=seed)
    fast = LayerCache(**{f: getattr(pure, f).clone() for f in ("k", "v", "log_weight", "length", "position")},
                      slot_meta={n: t.clone() for n, t in pure.slot_meta.items()})
    addresses = [t.data_ptr() for t in fast.tensors()]
    for step in range(30):
        k_new, v_new = torch.randn(2, 2, 3, 8, generator=gen, dtype=torch.float64).unbind(0)
        grows = torch.tensor([[True, step % 7 == 0, True], [True, True, step % 2 == 0]])
        scores = {n: torch.rand(2, 3, 1, generator=gen) for n in pure.slot_meta}
        for cache in (pure, fast):
            _write_step(cache, k_new, v_new, grows, scores, c)
        if int(pure.length.max()) == c:
            load_into(pure, policy.compress(pure, keep))
            policy.compress_into(fast, keep)
        assert [t.data_ptr() for t in fast.tensors()] == addresses
        assert torch.equal(fast.length, pure.length)
        want, got = by_position(pure), by_position(fast)
        for name in want:
            torch.testing.assert_close(got[name], want[name], msg=f"step {step}: {name}", rtol=0, atol=0)
    assert int(fast.length[0, 1]) < keep                                     # a row that never filled
    assert not torch.equal(fast.position, pure.position)                     # the layouts did diverge


def test_keep_top_into_evicts_the_lowest_priority_older_first_on_ties() -> None:
    """Ties of priority (SnapKV's generated tokens all score 0): the older entry leaves first, whatever its slot;
    protected entries (+inf) stay; the survivors from slot ``keep`` on fill the holes, lowest first; a row within
    the budget is left as it is. Against a plain loop."""
    from kvpass.policies.selection import keep_top_into
    from tests.policies.policy_helpers import random_cache

    cache = random_cache([[9, 5]], c=9, seed=4, extra_meta=())
    cache.position[0, 0] = torch.tensor([0, 1, 7, 3, 2, 4, 5, 8, 6])         # slots out of sequence order
    before = cache.position.clone()
    prio = torch.tensor([[[float("inf"), 0.5, 0.0, 0.7, 0.0, 0.0, 0.2, float("inf"), float("inf")],
                          [0.1] * 5 + [float("-inf")] * 4]], dtype=torch.float64)
    keep_top_into(cache, prio, keep=6)
    row, pos = prio[0, 0].tolist(), before[0, 0].tolist()
    order = sorted(range(9), key=lambda j: (row[j], pos[j]))                 # on ties, the older position first
    gone = set(order[:3])
    assert gone == {4, 5, 2}                                                 # positions 2, 4, then 7
    holes, movers = sorted(j for j in gone if j < 6), [j for j in range(6, 9) if j not in gone]
    want = list(pos[:6])
    for h, m in zip(holes, movers, strict=True):
        want[h] = pos[m]
    assert cache.position[0, 0, :6].tolist() == want == [0, 1, 5, 3, 8, 6]
    assert cache.position[0, 0, 6:].tolist() == [-1] * 3 and int(cache.length[0, 0]) == 6
    assert torch.equal(cache.position[0, 1], before[0, 1]) and int(cache.length[0, 1]) == 5


def test_priority_key_orders_priority_then_position() -> None:
    """``priority_key``: ascending keys are ascending (fp32 priority, position) over negatives, zeros, +-inf,
    and empty slots come last (equal: a stable sort keeps them in slot order). Against a plain sort on fresh
    random values."""
    from kvpass.policies.selection import priority_key

    gen = torch.Generator().manual_seed(9)
    prio = torch.randn(4, 3, 50, generator=gen, dtype=torch.float64) * 10 ** torch.randint(-3, 4, (4, 3, 50), generator=gen)
    prio = torch.where(torch.rand(4, 3, 50, generator=gen) < 0.2, prio.round(), prio)        # ties
    prio[..., :3] = torch.tensor([float("inf"), float("-inf"), -0.0])
    position = torch.randperm(50, generator=gen).expand(4, 3, 50).contiguous()
    live = torch.rand(4, 3, 50, generator=gen) < 0.8
    key = priority_key(prio, position, live)
    for r in range(4):
        for h in range(3):
            p32, pos, lv = prio[r, h].float().tolist(), position[r, h].tolist(), live[r, h].tolist()
            want = sorted(range(50), key=lambda j: (not lv[j], p32[j] if lv[j] else 0.0, pos[j] if lv[j] else j))
            got = torch.sort(key[r, h], stable=True).indices.tolist()
            assert got == want
