"""D2O's decode-time compression of one layer with ``interval`` m > 1, in place (docs/policies.md §5.5-5.6).

A row that is due (its batch row holds ``due`` entries in some KV head: the runtime compresses a row when it
reaches its own capacity keep + m: ``D2O.compress_rows_into``; due = keep + 1, every row over its budget:
``D2O.compress_into``) evicts its ``length - keep`` (at most m) lowest-scored entries outside the
sinks and the recent window, merges them into their nearest kept keys and compacts its live entries into
slots [0, new length). The other rows are left as they are. The same kept set, merged K, V and EMA threshold as
``D2O._compress_general`` (tests/kernels/test_d2o_evict_many.py) except for the slot order: like the
one-in-one-out op (d2o_evict_one.py) the live slots stay [0, length) but not in sequence order, so the sinks
(the ``sinks`` lowest positions) and the recent window (the ``recent`` highest positions) are found by
``position``, never by slot index. Per evicting (b, g) row, with live slots j < length and n = length - keep:

    forced   = the sinks lowest and the recent highest positions among the live slots
    evicted  = the n lowest ``score`` among the live slots not forced (the general path keeps the top
               keep - sinks - recent of them), ordered by ascending position (the general path's order: the
               "code" variant's decision averages the i-th eviction over heads)
    nearest  = argmax cos(k_e, k_j) over kept live j whose position rank is >= target_from (sinks excluded
               when merge_into_sinks=False), u = that cosine (``cosine_match``, ties: the lowest slot)
    tau      = one EMA step per batch row with the mean u over every eviction of the call (``ema_threshold``)
    merged, w_e, w_self = ``merge_weights`` (variant "paper" or "code", cosine floor ``min_cos``)
    k_t     <- (w_self k_t + sum_{e -> t, merged} w_e k_e) / (w_self + sum w_e ("paper") or + count ("code"))
               for each kept t that absorbed something (fp32, stored in the cache dtype; v likewise)

Then compaction: the kept live entries at slots >= new length move into the evicted slots below it (both lists
ascending), for k, v, position, log_weight, score and every tensor of ``others``; the freed slots
[new length, length) are emptied (position -1, log_weight -inf, score and others 0; K, V left) and length is set.

What it touches: O(C) per-slot metadata (one sort of the positions, one top-m of the scores, masks), a read of
every live key for the nearest-key search (as the one-in-one-out op), the m evicted keys and values, their merge
targets (m rows, each written once with its final value) and the moved
entries (at most m rows). No whole-cache copy, no fp32 copy of K or V, no host synchronisation: a CUDA graph
captures it. The [m, m] assignment (evicted e -> the target of evicted f) sums the merges without a scatter.

Shapes: k, v [B, Hkv, C, D] (fp16/bf16/fp32/fp64); score [B, Hkv, C] fp32; position [B, Hkv, C] int64 (-1
empty); log_weight [B, Hkv, C] fp32 (-inf empty); length [B, Hkv] int64; tau [B] fp32, tau_set [B] bool; others:
more slot metadata [B, Hkv, C, ...]. keep, due, sinks, recent, target_from: ints or [B] int64 tensors (each batch
row its own budget); m: a static int >= every evicting row's length - keep (C - min keep). All updated in place.

``bias`` (merge_bias): log_weight_t <- log(exp(log_weight_t) + sum_{e -> t, merged} exp(log_weight_e)).
``protect`` (merge_protect): the floor(protect * keep) kept entries of highest score (ties: the lower slot) are no
targets (equal scores may break ties otherwise than the general path, whose slots are in sequence order);
an evicted entry with no target left is evicted without merging and does not enter the threshold.
``score_weights`` (merge_weighting="score"): w_e = score_e + SCORE_EPS, w_self = score_t + SCORE_EPS, norm =
w_self + sum w_e.

Tensor parallelism (``heads``): the threshold's statistics and the "code" decision are gathered from every rank's
heads, as the one-in-one-out step's are (tests/rewrites/test_shard_tensor_parallel.py's ``interval`` cases).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvpass.cache import EMPTY, gather_slots, put_slots
from kvpass.head_group import SINGLE_PROCESS, HeadGroup
from kvpass.kernels.cosine_match import cosine_match_reference
from kvpass.kernels.d2o_evict_one import (
    SCORE_EPS,
    _rows,
    protected_count,
    threshold_and_merge_in_place,
    unprotected,
)


def evict_many_in_place(k: Tensor, v: Tensor, score: Tensor, position: Tensor, log_weight: Tensor, length: Tensor,
                        tau: Tensor, tau_set: Tensor, others: list[Tensor], keep: int | Tensor, due: int | Tensor,
                        m: int, sinks: int | Tensor, recent: int | Tensor, target_from: int | Tensor, beta: float,
                        variant: str, min_cos: float, bias: bool = False, protect: float = 0.0,
                        score_weights: bool = False, heads: HeadGroup = SINGLE_PROCESS) -> None:
    """The module docstring's step (plain torch; on CUDA the nearest keys by ``torch.ops.kvpass.cosine_match``).
    A (b, g) row evicts iff its batch row b holds at least ``due`` entries in some head and it holds more than
    ``keep``; callers ensure its length - keep <= ``m``. ``bias`` (D2O's merge_bias): a target's log_weight becomes
    the log of its size plus the sizes of the entries merged into it (log_weight: the log-size). ``protect`` and
    ``score_weights``: D2O's merge_protect and merge_weighting="score" (the module docstring). ``heads``: the
    layer's KV heads under tensor parallelism (k, v, ... hold this rank's Hkv / N): whether a batch row is due
    (its longest head over every rank, ``heads.max``), the threshold and the "code" merge decision come from
    every rank's heads (one all-gather, ``every_head``), so each rank decides as one process does."""
    b, c = k.shape[0], k.shape[2]
    if m <= 0:
        return
    m = min(m, c)
    j = torch.arange(c, device=k.device)
    live = j < length[..., None]                                            # [B, Hkv, C]
    keep_r = _rows(keep, b, 1)
    due_row = heads.max(length.amax(1, keepdim=True)) >= _rows(due, b, 1)   # [B, 1], over every rank's heads
    # at most m (callers ensure length - keep <= m; more would be left, never overwritten)
    n_evict = torch.where(due_row & (length > keep_r), length - keep_r, 0).clamp(max=m)   # [B, Hkv]
    new_length = length - n_evict
    # position ranks among the live slots (0 = oldest): the sinks and the recent window, wherever their slots are
    big = torch.iinfo(torch.long).max
    # sorted as int32 (positions < 2^31 - 1: half the radix passes of int64; live positions are distinct, so
    # the ranks below length are those of the int64 sort)
    top = torch.iinfo(torch.int32).max
    order = torch.sort(torch.where(live, position, top).to(torch.int32), dim=-1, stable=True).indices
    rank = torch.empty_like(order).scatter_(-1, order, j.expand_as(order).contiguous())
    forced = (rank < _rows(sinks, b, 2)) | (rank >= length[..., None] - _rows(recent, b, 2))
    prio = torch.where(live & ~forced, score.double(), float("inf"))
    cand = prio.topk(m, dim=-1, largest=False, sorted=True).indices         # [B, Hkv, m], the m lowest, ascending
    i = torch.arange(m, device=k.device)
    # the n lowest of them, then ordered by position: the general path's eviction order
    valid = i < n_evict[..., None]                                          # [B, Hkv, m]
    by_pos = torch.where(valid, torch.gather(position, 2, cand), big).argsort(dim=-1, stable=True)
    e_idx = torch.gather(cand, 2, by_pos)
    evicted = torch.zeros_like(live).scatter_(2, e_idx, valid)              # [B, Hkv, C]
    k_e, v_e = gather_slots(k, e_idx), gather_slots(v, e_idx)              # [B, Hkv, m, D]
    # nearest kept key per evicted entry, against the cache in place
    kept = live & ~evicted
    targets = kept & (rank >= _rows(target_from, b, 2))
    if protect > 0:
        targets = targets & unprotected(score, kept, protected_count(protect, keep))
    match = torch.ops.kvpass.cosine_match if k.is_cuda else cosine_match_reference
    nearest, u_star = match(k_e, k, targets)                                # [B, Hkv, m]
    matched = valid & (nearest >= 0) if protect > 0 else valid              # no target left: evicted without trace
    nearest = nearest.clamp(min=0)
    u_star = torch.where(matched, u_star, 0.0)
    merged, w_e, w_self = threshold_and_merge_in_place(heads, u_star, matched, tau, tau_set, beta, variant,
                                                       min_cos)                            # [B, Hkv, m]
    if score_weights:                       # each entry weighs its score + SCORE_EPS (the target's: per evicted f)
        w_e = torch.where(merged, torch.gather(score.float(), 2, e_idx) + SCORE_EPS, 0.0)
        w_self = (torch.gather(score.float(), 2, nearest) + SCORE_EPS)[..., None]          # [B, Hkv, m, 1]
    # assign[f, e] = evicted e merges into the target of evicted f: each f computes its target's final value,
    # so every write of one target slot carries the same value
    assign = ((nearest[..., :, None] == nearest[..., None, :]) & merged[..., None, :]).float()   # [B, Hkv, m, m]
    count = assign @ merged.float()[..., None]                              # [B, Hkv, m, 1]
    w_sum = assign @ w_e[..., None]
    norm = w_self + (w_sum if variant == "paper" or score_weights else count)
    absorbed = count > 0
    for buf, src in ((k, k_e), (v, v_e)):
        into = gather_slots(buf, nearest)
        acc = w_self * into.float() + assign @ (w_e[..., None] * src.float())
        put_slots(buf, nearest, torch.where(absorbed, (acc / norm).to(buf.dtype), into))
    if bias:                                # sizes add, before anything moves (fp32, as the general path)
        into = gather_slots(log_weight, nearest)
        size_e = torch.where(merged, gather_slots(log_weight, e_idx).exp(), 0.0)
        size = into.exp() + (assign @ size_e[..., None])[..., 0]
        put_slots(log_weight, nearest, torch.where(absorbed[..., 0], size.log(), into))
    # compaction: kept entries at slots >= new length fill the evicted slots below it, both ascending
    hole = valid & (e_idx < new_length[..., None])
    holes = torch.where(hole, e_idx, c).sort(-1).values                     # [B, Hkv, m]
    above = new_length[..., None] + i                                       # the slots [new length, length)
    above_c = above.clamp(max=c - 1)
    mover = (above < length[..., None]) & ~torch.gather(evicted, 2, above_c)
    movers = torch.where(mover, above_c, c).sort(-1).values
    pair = holes < c                                                        # as many holes as movers per row
    # unpaired: slot C - 1 onto itself (never a hole: holes lie below new length <= C - 1)
    dst = torch.where(pair, holes, c - 1)
    src_slots = torch.where(pair, movers.clamp(max=c - 1), c - 1)
    for t in (k, v, log_weight, position, score, *others):
        put_slots(t, dst, gather_slots(t, src_slots))
    freed = (j >= new_length[..., None]) & live                             # [B, Hkv, C]
    for t, empty in ((log_weight, EMPTY), (position, -1), (score, 0), *((x, 0) for x in others)):
        t.masked_fill_(freed.view(*freed.shape, *([1] * (t.dim() - 3))), empty)
    length.copy_(new_length)
