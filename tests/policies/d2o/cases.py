"""Random D2O layers and the one comparison every fast form of D2O's compression must pass: against the reference
(``kvpass.policies.d2o.reference.compress_reference``, through ``D2O.compress``) on the same entries in sequence
order, each row as a set of entries (position -> K, V, log-weight, scores, other metadata) with the same EMA
threshold. The forms leave their live slots in [0, length) but in any order, so inputs are shuffled too (the
newest entry stays in slot length - 1, where the decode step writes it)."""

from __future__ import annotations

import torch

from kvpass.cache import LayerCache, take_rows, with_capacity
from kvpass.policies.d2o import D2O, TAU, TAU_SET
from tests.policies.policy_helpers import by_position


def ordered_cache(lengths: list[list[int]], c: int, d: int = 8, seed: int = 0, dtype: torch.dtype = torch.float64,
                  near: float = 0.4) -> LayerCache:
    """A cache [B, Hkv, C, D] in sequence order: row (b, g) holds positions 0, 2, 4, ... of its lengths[b][g]
    entries (gaps, as after earlier compressions) but its newest 8 consecutive (as decoding leaves them: the
    one-in-one-out kernels find the recent window by position arithmetic), continuous random scores (no ties) in 'col_sum' and
    'window_scores', a fraction ``near`` of keys near-copies of others (so merges happen), garbage K, V in the
    empty slots, and an EMA threshold already set in some batch rows."""
    gen = torch.Generator().manual_seed(seed)
    b, h = len(lengths), len(lengths[0])
    length = torch.tensor(lengths, dtype=torch.long)
    live = torch.arange(c) < length[..., None]
    k = torch.randn(b, h, c, d, generator=gen, dtype=torch.float64)
    src = torch.randint(0, c, (b, h, c), generator=gen)
    copy = torch.rand(b, h, c, generator=gen) < near
    k = torch.where(copy[..., None], torch.gather(k, 2, src[..., None].expand(-1, -1, -1, d)) + 0.05 * k, k)
    meta = {name: torch.rand(b, h, c, generator=gen, dtype=torch.float64).float() * live
            for name in ("col_sum", "window_scores")}
    tau_set = torch.rand(b, generator=gen) < 0.5
    state = {TAU: torch.where(tau_set, 0.2 + 0.6 * torch.rand(b, generator=gen), 0.0).float(), TAU_SET: tau_set}
    return LayerCache(k=k.to(dtype), v=torch.randn(b, h, c, d, generator=gen, dtype=torch.float64).to(dtype),
                      log_weight=torch.where(live, 0.0, float("-inf")).float(), length=length,
                      position=torch.where(live, _positions(length, c), -1), slot_meta=meta, state=state)


def _positions(length: torch.Tensor, c: int, tail: int = 8) -> torch.Tensor:
    j = torch.arange(c)
    start = (length[..., None] - tail).clamp(min=0)
    return torch.where(j < start, 2 * j, j + start)


def shuffled(cache: LayerCache, seed: int, front: int = 4) -> LayerCache:
    """The same entries with each row's live slots in a random order, as after earlier in-place steps, except the
    first ``front`` (the sinks: in place since the prompt's compression, which the one-in-one-out kernels rely on)
    and the newest (slot length - 1, where the decode step writes it)."""
    gen = torch.Generator().manual_seed(seed)
    b, h, c = cache.position.shape
    perm = torch.arange(c).repeat(b, h, 1)
    for (bi, g), n in zip(((x, y) for x in range(b) for y in range(h)), cache.length.view(-1).tolist(), strict=True):
        if n - 1 > front:
            perm[bi, g, front:n - 1] = front + torch.randperm(n - 1 - front, generator=gen)
    return reorder(cache, perm)


def reorder(cache: LayerCache, perm: torch.Tensor) -> LayerCache:
    """A copy of ``cache`` whose slot j of row (b, g) holds the entry of slot perm[b, g, j]."""
    take = lambda t: torch.take_along_dim(t, perm.reshape(*perm.shape, *([1] * (t.dim() - 3))), dim=2)  # noqa: E731
    return LayerCache(k=take(cache.k), v=take(cache.v), log_weight=take(cache.log_weight), length=cache.length.clone(),
                      position=take(cache.position), slot_meta={n: take(t) for n, t in cache.slot_meta.items()},
                      state={n: t.clone() for n, t in cache.state.items()})


def in_order(cache: LayerCache) -> LayerCache:
    """The same entries in sequence order (the reference's input), empty slots last."""
    order = torch.where(cache.position < 0, torch.iinfo(torch.long).max, cache.position).argsort(-1)
    return reorder(cache, order)


def copied(cache: LayerCache, device: str | torch.device = "cpu") -> LayerCache:
    """A copy of every tensor of ``cache`` on ``device`` (contiguous: the ops write in place)."""
    to = lambda t: t.to(device, copy=True).contiguous()  # noqa: E731
    return LayerCache(k=to(cache.k), v=to(cache.v), log_weight=to(cache.log_weight), length=to(cache.length),
                      position=to(cache.position), slot_meta={n: to(t) for n, t in cache.slot_meta.items()},
                      state={n: to(t) for n, t in cache.state.items()})


def reference(policy: D2O, cache: LayerCache, keep: int, capacity: int | None = None) -> LayerCache:
    """What ``policy`` must leave of every row of ``cache`` compressed to ``keep`` (in a copy of ``capacity``)."""
    ordered = in_order(copied(cache))
    if capacity is not None:
        ordered = with_capacity(ordered, capacity, check=False)
    return policy.compress(ordered, keep)


def reference_rows(policy: D2O, cache: LayerCache, keeps: list[int], capacities: list[int], b: int) -> LayerCache:
    """Row b of ``cache`` alone at its own budget and capacity (the per-row budgets' reference)."""
    return reference(policy, take_rows(in_order(copied(cache)), [b]), keeps[b], capacities[b])


def tolerance(dtype: torch.dtype) -> dict:
    return {torch.float64: dict(rtol=1e-9, atol=1e-6), torch.float32: dict(rtol=1e-5, atol=1e-5),
            torch.bfloat16: dict(rtol=2 ** -7, atol=2 ** -7), torch.float16: dict(rtol=2 ** -10, atol=1e-3)}[dtype]


def assert_rows_equal(got: LayerCache, want: LayerCache, rows: list[int], msg: str) -> None:
    """Rows ``rows`` of ``got`` hold ``want``'s rows 0, 1, ... as sets of entries (positions and metadata
    exactly, log-weights, K and V to the dtype's rounding: the forms sum in other orders), the same threshold;
    and ``got``'s live slots are [0, length), the others empty."""
    got = copied(got)
    g, w = by_position(got), by_position(want)
    n = want.capacity
    for i, b in enumerate(rows):
        assert torch.equal(got.length[b], want.length[i]), f"{msg}: length of row {b}"
        assert (g["position"][b, :, n:] == -1).all(), f"{msg}: row {b} holds more than {n}"
        for name in ("position", *want.slot_meta):
            assert torch.equal(g[name][b, :, :n], w[name][i]), f"{msg}: {name} of row {b}"
        torch.testing.assert_close(g["log_weight"][b, :, :n], w["log_weight"][i], rtol=1e-6, atol=1e-6,
                                   msg=f"{msg}: log_weight of row {b}")
        for name in ("k", "v"):
            torch.testing.assert_close(g[name][b, :, :n].double(), w[name][i].double(), **tolerance(want.k.dtype),
                                       msg=f"{msg}: {name} of row {b}")
        if TAU in want.state:
            torch.testing.assert_close(got.state[TAU][b], want.state[TAU][i], rtol=0, atol=1e-6, msg=f"{msg}: tau")
            assert bool(got.state[TAU_SET][b]) == bool(want.state[TAU_SET][i]), f"{msg}: tau_set of row {b}"
    live = torch.arange(got.capacity) < got.length[..., None]
    assert torch.equal(live, got.position >= 0) and torch.equal(live, got.log_weight > float("-inf")), msg
    for t in got.slot_meta.values():
        assert (t[~live] == 0).all(), f"{msg}: metadata of a freed slot"


def assert_rows_unchanged(got: LayerCache, before: LayerCache, rows: list[int], msg: str) -> None:
    g, w = by_position(copied(got)), by_position(before)
    for b in rows:
        for name, t in w.items():
            assert torch.equal(g[name][b], t[b]), f"{msg}: row {b} changed its {name}"
        assert torch.equal(got.length[b].cpu(), before.length[b]), f"{msg}: length of row {b}"


def decode_write(cache: LayerCache, step: int, gen: torch.Generator) -> None:
    """One decode step's write at slot length in every row that has room: a fresh entry (every third step a
    near-copy of slot 1's key, 20% noise: similar, never tied) at the row's newest position + 1 with a fresh score;
    every live score grows by a little."""
    b, h, c, d = cache.k.shape
    room = cache.length < c
    slot = cache.length.clamp(max=c - 1)[..., None]
    live = cache.log_weight > float("-inf")
    k_new = torch.randn(b, h, 1, d, generator=gen, dtype=torch.float64).to(cache.k.dtype)
    if step % 3 == 1:
        k_new = cache.k[:, :, 1:2] + 0.2 * k_new
    for t, new in ((cache.k, k_new), (cache.v, torch.randn(b, h, 1, d, generator=gen, dtype=torch.float64))):
        old = t.gather(2, slot[..., None].expand(-1, -1, 1, d))
        t.scatter_(2, slot[..., None].expand(-1, -1, 1, d), torch.where(room[..., None, None], new.to(t.dtype), old))
    grow = {name: torch.rand(b, h, c, generator=gen).float() * 0.1 for name in cache.slot_meta}
    for name, t in cache.slot_meta.items():
        t += torch.where(live, grow[name], 0.0)
        fresh = torch.rand(b, h, 1, generator=gen).float()
        t.scatter_(2, slot, torch.where(room[..., None], fresh, t.gather(2, slot)))
    newest = cache.position.amax(-1, keepdim=True) + 1
    cache.position.scatter_(2, slot, torch.where(room[..., None], newest, cache.position.gather(2, slot)))
    cache.log_weight.scatter_(2, slot, torch.where(room[..., None], 0.0, cache.log_weight.gather(2, slot)))
    cache.length += room.long()
