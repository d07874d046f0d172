"""Shared eviction mechanics: which slots to keep (sinks + recent window + top scores), the slot
indices for ``keep_slots``, and the evicted slots. Used by H2O, D2O, SnapKV, PyramidKV and CaM.

All functions are per (batch row, KV head) and vectorised over both; rows may hold different
numbers of live entries (left-padded batches).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from kvpass.cache import EMPTY, LayerCache, gather_slots, keep_slots, load_into, put_slots
from kvpass.kernels.lowest_slots import lowest_slots


def sort_rank(x: Tensor, descending: bool = False) -> Tensor:
    """[..., C] int64: each element's place in a stable sort of ``x`` [..., C] along its last dimension
    (0 = first; ties: the lower index first)."""
    order = torch.sort(x, dim=-1, descending=descending, stable=True).indices
    return torch.empty_like(order).scatter_(-1, order, torch.arange(x.shape[-1], device=x.device).expand_as(order))


def select_kept(score: Tensor, length: Tensor, keep: int, sinks: int, recent: int,
                position: Tensor | None = None) -> Tensor:
    """The slots a row keeps: every live slot when ``length <= keep``; otherwise the sinks
    [0, sinks), the recent window (``keep_priority``) and the top ``keep - sinks - recent``
    of ``score`` among the other live slots. Callers ensure ``sinks + recent <= keep``.

    score: [B, Hkv, C] (any real dtype); length: [B, Hkv] int64; position: [B, Hkv, C] int64 or None.
    Returns kept: [B, Hkv, C] bool."""
    if sinks + recent > keep:
        raise ValueError(f"sinks ({sinks}) + recent ({recent}) exceed the budget of {keep} entries")
    c = score.shape[-1]
    j = torch.arange(c, device=score.device)
    n = length[..., None]
    live = j < n
    prio = keep_priority(score, length, sinks, recent, position)
    # `keep if keep < c else c`, not min(keep, c): exported with c >= keep + 1 slots (compress runs on more
    # slots than it keeps) the branch resolves at export time, so ONNX's TopK gets the constant K = keep
    top = prio.topk(keep if keep < c else c, dim=-1).indices
    kept = torch.zeros_like(live).scatter(-1, top, True) & live
    short = n <= keep                                       # and/or, not a boolean where (onnxruntime has none)
    return (short & live) | (~short & kept)


def keep_priority(score: Tensor, length: Tensor, sinks: int, recent: int, position: Tensor | None = None) -> Tensor:
    """What a row keeps first: +inf for its sinks [0, sinks) and its recent window, ``score`` for its other
    live slots, -inf for empty slots. The recent window is the entries of the ``recent`` newest positions
    (position > the row's newest - recent) where ``position`` is given: the in-place compression
    (``keep_top_into``) fills holes, so slots need not be in sequence order; without it, the slots
    [length - recent, length) (a cache in sequence order: the prompt's). A row keeps its top ``keep`` of this
    (``select_kept``); head-adaptive budgets compare it across the heads of a layer (``head_budgets``).
    score: [B, Hkv, C]; length: [B, Hkv] int64; position: [B, Hkv, C] int64 or None -> [B, Hkv, C] fp64."""
    j = torch.arange(score.shape[-1], device=score.device)
    n = length[..., None]
    live = j < n
    if position is None:
        newest = j >= n - recent
    else:
        top = torch.where(live, position, -1).amax(-1, keepdim=True)
        newest = position > top - recent
    forced = live & ((j < sinks) | newest)
    return torch.where(forced, float("inf"), torch.where(live, score.double(), float("-inf")))


def slot_places(mask: Tensor) -> Tensor:
    """Where each slot goes when a row's set slots are packed first, ascending, and its unset slots after
    them, ascending: mask [B, Hkv, C] bool -> place [B, Hkv, C] int64, a permutation of each row.
    Slot j goes to cumsum(mask)[j] - 1 if set, n_set + (j - cumsum(mask)[j]) if not: one CumSum, no sort."""
    set_rank = mask.long().cumsum(-1) - 1
    j = torch.arange(mask.shape[-1], device=mask.device)
    return torch.where(mask, set_rank, set_rank[..., -1:] + j - set_rank)


def ordered_slots(mask: Tensor, count: int) -> Tensor:
    """The first ``count`` slots of each row with ``mask`` set, ascending, then the unset slots
    ascending (so rows with fewer set slots continue with slots the caller treats as invalid).
    mask: [B, Hkv, C] bool -> [B, Hkv, count] int64."""
    # No sort: the inverse of ``slot_places`` is one scatter. O(C), and in ONNX a CumSum and a
    # ScatterElements without reduction instead of a TopK over all C slots (which TensorRT caps at K < 3840).
    place = slot_places(mask)
    j = torch.arange(mask.shape[-1], device=mask.device).expand_as(place)
    return torch.empty_like(place).scatter(-1, place, j)[..., :count]


def kept_slots(kept: Tensor, keep: int) -> Tensor:
    """Indices for ``keep_slots``: kept slots ascending, then empty ones. kept: [B, Hkv, C] bool whose
    rows have at most ``keep`` slots set, kept slots of a short row being all its live slots."""
    return ordered_slots(kept, min(keep, kept.shape[-1]))


def priority_key(priority: Tensor, position: Tensor, live: Tensor) -> Tensor:
    """int64 keys in the order of (priority as fp32, position), empty slots last: the fp32 bits made monotone
    (a negative's magnitude bits flipped) in the high 32 bits, the position (>= 0, < 2^32) in the low ones, so
    that on equal priority the older entry comes first. priority: [B, Hkv, C] (fp32-exact values: the
    statistics are fp32); position, live: [B, Hkv, C] -> [B, Hkv, C] int64."""
    bits = (priority.float() + 0.0).view(torch.int32)                  # + 0.0: -0.0 becomes 0.0, its equal
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    key = ordered.long() * (1 << 32) + position.clamp(min=0)
    return torch.where(live, key, torch.iinfo(torch.long).max)


def fills_in_place(policy, owner: type, cache: LayerCache) -> bool:
    """Whether ``policy``'s in-place ``compress_into`` (``fill_evicted_slots``) applies: its ``compress`` is
    ``owner``'s own (a subclass with a ``compress`` of its own takes the general path, ``load_into(cache,
    compress(...))``) and the cache's tensors are contiguous (not views)."""
    return type(policy).compress is owner.compress and all(t.is_contiguous() for t in cache.tensors())


def fill_evicted_slots(cache: LayerCache, candidates: Tensor, keep: int) -> None:
    """In place, O(C - keep) moves: each row over ``keep`` evicts its first n = length - keep ``candidates``
    (slots in eviction order), the live entries of slots [keep, C) that stay move into the evicted slots below
    ``keep`` (lowest mover into lowest hole), slots [keep, C) are emptied and each length is clamped to
    ``keep``. The slots' sequence order is not kept (positions say it). No host sync.
    cache: [B, Hkv, C, ...]; candidates: [B, Hkv, E] int64, n <= E <= C - keep."""
    b, h = cache.length.shape
    c = cache.capacity
    extra = c - keep
    device = cache.k.device
    big = torch.iinfo(torch.long).max
    n = (cache.length - keep).clamp(min=0)                                   # [B, Hkv] entries to evict
    evicted = torch.arange(candidates.shape[-1], device=device) < n[..., None]
    gone = torch.zeros(b, h, c, dtype=torch.bool, device=device).scatter_(2, candidates, evicted)
    # holes: evicted slots below keep; movers: live slots from keep on that stay. As many of each.
    holes = torch.where(evicted & (candidates < keep), candidates, big).sort(-1).values
    tail = torch.arange(keep, c, device=device)
    stays = cache.live[..., keep:] & ~gone[..., keep:]
    movers = torch.where(stays, tail, big).sort(-1).values                  # [B, Hkv, extra]
    pairs = min(holes.shape[-1], extra)
    holes, movers = holes[..., :pairs], movers[..., :pairs]
    real = movers < big                                                      # a real (hole, mover) pair
    dst = torch.where(real, holes, tail[:pairs])                             # else a tail slot onto itself
    src = torch.where(real, movers, tail[:pairs])
    for t in (cache.k, cache.v, cache.log_weight, cache.position, *cache.slot_meta.values()):
        put_slots(t, dst, gather_slots(t, src))
    cache.log_weight[..., keep:] = EMPTY
    cache.position[..., keep:] = -1
    for t in cache.slot_meta.values():
        t[:, :, keep:] = 0
    cache.length.clamp_(max=keep)


def fill_evicted_rows(cache: LayerCache, candidates: Tensor, keep: Tensor, interval: int) -> None:
    """``fill_evicted_slots`` with a budget per batch row: each due row (holding keep[b] + ``interval`` entries)
    evicts its first n = length - keep[b] = interval ``candidates`` and gets exactly what it gets alone in a layer of
    capacity keep[b] + interval (the same holes, movers and pairs); every other row is left as it is, even where it
    holds more than its budget. Static shapes, no host sync (a CUDA graph captures it). cache: [B, Hkv, C, ...];
    candidates: [B, Hkv, E] int64, E >= interval; keep: [B] int64. A cache of views (not contiguous) is worked on in
    a copy, then loaded back."""
    if not all(t.is_contiguous() for t in cache.tensors()):
        work = keep_slots(cache, torch.arange(cache.capacity, device=cache.k.device).expand(*cache.length.shape, -1))
        fill_evicted_rows(work, candidates, keep, interval)
        load_into(cache, work)
        return
    c, e = cache.capacity, candidates.shape[-1]
    device = cache.k.device
    big = torch.iinfo(torch.long).max
    keep = keep.to(device=device, dtype=torch.long)
    kb = keep.view(-1, 1, 1)
    due = cache.length >= (keep + interval)[:, None]                         # [B, Hkv]
    n = torch.where(due, cache.length - keep[:, None], 0).clamp(min=0)      # [B, Hkv] entries to evict
    evicted = torch.arange(e, device=device) < n[..., None]                  # [B, Hkv, E]
    gone = torch.zeros(*cache.length.shape, c, dtype=torch.bool, device=device).scatter_(2, candidates, evicted)
    holes = torch.where(evicted & (candidates < kb), candidates, big).sort(-1).values
    raw = (kb + torch.arange(e, device=device)).expand(*cache.length.shape, e)          # slots [keep, keep + E)
    tail = raw.clamp(max=c - 1)                        # clamped ones are no slot of the row: they pair with themselves
    stays = due[..., None] & (raw < cache.length[..., None]) & ~gone.gather(2, tail)
    movers = torch.where(stays, tail, big).sort(-1).values                  # the alone case's tail [keep, C_alone)
    real = movers < big
    dst, src = torch.where(real, holes, tail), torch.where(real, movers, tail)
    for t in (cache.k, cache.v, cache.log_weight, cache.position, *cache.slot_meta.values()):
        put_slots(t, dst, gather_slots(t, src))
    clear = due[..., None] & (torch.arange(c, device=device) >= kb)         # [B, Hkv, C]
    cache.log_weight.masked_fill_(clear, EMPTY)
    cache.position.masked_fill_(clear, -1)
    for t in cache.slot_meta.values():
        t.masked_fill_(clear.view(*clear.shape, *([1] * (t.dim() - 3))), 0)
    torch.minimum(cache.length, torch.where(due, keep[:, None], cache.length), out=cache.length)


def rows_in_one_call_in_place(policy, owner: type, budgets: Sequence[int], capacities: Sequence[int]) -> bool:
    """``RaggedRows.rows_in_one_call`` of a policy that evicts in place (``fill_evicted_rows``) with ``owner``'s own
    ``compress`` (as ``fills_in_place``): rows of budgets of their own (more than one; rows of one budget keep
    ``compress_into``), each compressed when it holds its budget + ``policy.interval`` entries, or never (a
    capacity within its budget: a short row)."""
    return (type(policy).compress is owner.compress and len(set(budgets)) > 1
            and all(1 <= cap <= keep or cap == keep + policy.interval
                    for keep, cap in zip(budgets, capacities, strict=True)))


def compress_rows_into_top(policy, cache: LayerCache, keep: Tensor) -> None:
    """``compress_rows_into`` of a policy whose ``compress`` keeps each row's top ``keep`` of ``policy.priority``
    (``compress_into_top``'s, with keep [B] int64: each row's own protected entries): a row holding keep[b] +
    interval entries (due) evicts its ``interval`` live entries of lowest priority as it would alone in a layer of
    capacity keep[b] + interval, every other row is left as it is (``fill_evicted_rows``). No host sync."""
    keep = keep.to(device=cache.k.device, dtype=torch.long)
    key = priority_key(policy.priority(cache, keep), cache.position, cache.live)
    fill_evicted_rows(cache, lowest_slots(key, min(policy.interval, cache.capacity)), keep, policy.interval)


def keep_top_into(cache: LayerCache, priority: Tensor, keep: int) -> None:
    """In place, the entries ``keep_slots(cache, kept_slots(kept, keep))`` + ``load_into`` hold where ``kept`` is
    each row's top ``keep`` of ``priority`` (``select_kept``'s rule): a row holding n > 0 entries over ``keep``
    evicts its n live entries of lowest priority (ties: the older entry first, ``priority_key``) and its
    surviving entries from slot ``keep`` on move into the freed slots (``fill_evicted_slots``): the C - keep
    lowest keys of each row (``lowest_slots``, one Triton launch on CUDA) and at most C - keep entries moved,
    instead of a top-k of ``keep`` of C and a gather of the whole layer. No host sync. Empty slots keep stale
    K, V (never read: log-weight -inf).

    cache: [B, Hkv, C, ...] with live slots [0, length); priority: [B, Hkv, C] (``keep_priority`` with the
    cache's positions: +inf for the protected entries, at most ``keep`` of them, -inf empty)."""
    c = cache.capacity
    if c <= keep:
        return
    lowest = lowest_slots(priority_key(priority, cache.position, cache.live), c - keep)   # [B, Hkv, C - keep]
    fill_evicted_slots(cache, lowest, keep)


def compress_into_top(policy, owner: type, cache: LayerCache, keep: int) -> None:
    """``compress_into`` of a policy whose ``owner.compress`` keeps each row's top ``keep`` of
    ``policy.priority(cache, keep)``: in place (``keep_top_into``; ties: the older entry leaves first) where
    ``fills_in_place``, else the general path (``load_into(cache, compress(...))``)."""
    if fills_in_place(policy, owner, cache):
        keep_top_into(cache, policy.priority(cache, keep), keep)
    else:
        load_into(cache, policy.compress(cache, keep))


def cosine(a: Tensor, b: Tensor, eps: float = 1e-6) -> Tensor:
    """cos(a_i, b_j) = a_i . b_j / (||a_i|| ||b_j|| + eps) in fp32 (docs/policies.md §0.1, §0.7).
    a: [B, Hkv, E, D], b: [B, Hkv, K, D] -> [B, Hkv, E, K] fp32."""
    a, b = a.float(), b.float()
    dots = torch.matmul(a, b.transpose(-1, -2))
    norms = a.norm(dim=-1)[..., :, None] * b.norm(dim=-1)[..., None, :]
    return dots / (norms + eps)
