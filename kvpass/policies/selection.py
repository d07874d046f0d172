"""Shared eviction mechanics: which slots to keep (sinks + recent window + top scores), the slot
indices for ``keep_slots``, and the evicted slots. Used by H2O, D2O, SnapKV, PyramidKV and CaM.

All functions are per (batch row, KV head) and vectorised over both; rows may hold different
numbers of live entries (left-padded batches).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvpass.cache import EMPTY, LayerCache, gather_slots, load_into
from kvpass.kernels.lowest_slots import lowest_slots


def sort_rank(x: Tensor, descending: bool = False) -> Tensor:
    """[..., C] int64: each element's place in a stable sort of ``x`` [..., C] along its last dimension
    (0 = first; ties: the lower index first)."""
    order = torch.sort(x, dim=-1, descending=descending, stable=True).indices
    return torch.empty_like(order).scatter_(-1, order, torch.arange(x.shape[-1], device=x.device).expand_as(order))


def select_kept(score: Tensor, length: Tensor, keep: int, sinks: int, recent: int) -> Tensor:
    """The slots a row keeps: every live slot when ``length <= keep``; otherwise the sinks
    [0, sinks), the recent window [length - recent, length) and the top ``keep - sinks - recent``
    of ``score`` among the other live slots. Callers ensure ``sinks + recent <= keep``.

    score: [B, Hkv, C] (any real dtype); length: [B, Hkv] int64. Returns kept: [B, Hkv, C] bool."""
    if sinks + recent > keep:
        raise ValueError(f"sinks ({sinks}) + recent ({recent}) exceed the budget of {keep} entries")
    c = score.shape[-1]
    j = torch.arange(c, device=score.device)
    n = length[..., None]
    live = j < n
    prio = keep_priority(score, length, sinks, recent)
    # `keep if keep < c else c`, not min(keep, c): exported with c >= keep + 1 slots (compress runs on more
    # slots than it keeps) the branch resolves at export time, so ONNX's TopK gets the constant K = keep
    top = prio.topk(keep if keep < c else c, dim=-1).indices
    kept = torch.zeros_like(live).scatter(-1, top, True) & live
    short = n <= keep                                       # and/or, not a boolean where (onnxruntime has none)
    return (short & live) | (~short & kept)


def keep_priority(score: Tensor, length: Tensor, sinks: int, recent: int) -> Tensor:
    """What a row keeps first: +inf for its sinks [0, sinks) and recent window [length - recent, length),
    ``score`` for its other live slots, -inf for empty slots. A row keeps its top ``keep`` of this
    (``select_kept``); head-adaptive budgets compare it across the heads of a layer (``head_budgets``).
    score: [B, Hkv, C]; length: [B, Hkv] int64 -> [B, Hkv, C] fp64."""
    j = torch.arange(score.shape[-1], device=score.device)
    n = length[..., None]
    live = j < n
    forced = live & ((j < sinks) | (j >= n - recent))
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


def keep_top_into(cache: LayerCache, priority: Tensor, keep: int) -> None:
    """In place, what ``keep_slots(cache, kept_slots(kept, keep))`` + ``load_into`` do where ``kept`` is each row's
    top ``keep`` of ``priority`` (``select_kept``'s rule): a row holding n > 0 entries over ``keep`` evicts its n
    live entries of lowest priority (ties: the lower slot, the older entry, first) and its other entries close
    the gaps, in sequence order, in the same buffers: the C - keep lowest slots of the row (``lowest_slots``, one
    Triton launch on CUDA) instead of a top-k of ``keep`` of C (~150 us a layer on an H200), no new K, V buffers
    (the out-of-place path copies the layer's K and V four times), no host sync. Priorities are compared in fp32
    (exact for the fp32 statistics they come from). Empty slots keep stale K, V (never read: log-weight -inf).

    cache: [B, Hkv, C, ...] with live slots [0, length); priority: [B, Hkv, C] (``keep_priority``: +inf for
    the protected entries, at most ``keep`` of them, -inf empty)."""
    c = cache.capacity
    if c <= keep:
        return
    live = cache.live
    n = (cache.length - keep).clamp(min=0)                                          # [B, Hkv] entries to evict
    key = torch.where(live, priority, float("inf")).float()                        # empty slots sort last
    lowest = lowest_slots(key, c - keep)                                            # [B, Hkv, C - keep]
    evict = torch.arange(c - keep, device=key.device) < n[..., None]
    gone = torch.zeros_like(live).scatter_(-1, lowest, evict)
    src = ordered_slots(live & ~gone, c)               # kept slots ascending, then the evicted and empty ones
    for t in (cache.k, cache.v, cache.log_weight, cache.position, *cache.slot_meta.values()):
        t.copy_(gather_slots(t, src))
    cache.length.sub_(n)
    empty = torch.arange(c, device=key.device) >= cache.length[..., None]         # [B, Hkv, C]
    cache.log_weight.masked_fill_(empty, EMPTY)
    cache.position.masked_fill_(empty, -1)
    for t in cache.slot_meta.values():
        t.masked_fill_(empty.view(*empty.shape, *([1] * (t.dim() - 3))), 0)


def compress_into_top(policy, owner: type, cache: LayerCache, keep: int) -> None:
    """``compress_into`` of a policy whose ``owner.compress`` keeps each row's top ``keep`` of
    ``policy.priority(cache, keep)``: in place (``keep_top_into``; ties: the older entry leaves first). A
    subclass with a ``compress`` of its own takes the general path (``load_into(cache, compress(...))``)."""
    if type(policy).compress is not owner.compress:
        load_into(cache, policy.compress(cache, keep))
    else:
        keep_top_into(cache, policy.priority(cache, keep), keep)


def cosine(a: Tensor, b: Tensor, eps: float = 1e-6) -> Tensor:
    """cos(a_i, b_j) = a_i . b_j / (||a_i|| ||b_j|| + eps) in fp32 (docs/policies.md §0.1, §0.7).
    a: [B, Hkv, E, D], b: [B, Hkv, K, D] -> [B, Hkv, E, K] fp32."""
    a, b = a.float(), b.float()
    dots = torch.matmul(a, b.transpose(-1, -2))
    norms = a.norm(dim=-1)[..., :, None] * b.norm(dim=-1)[..., None, :]
    return dots / (norms + eps)
