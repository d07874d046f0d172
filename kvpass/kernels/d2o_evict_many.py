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

``evict_many_in_place`` (plain torch) defines the step; on CUDA the op ``kvpass::d2o_evict_many`` runs it as three
Triton kernels (``evict_many_triton``, below: one process, no ``protect`` / ``score_weights``, 16/32-bit caches),
with the batch rows' keep, due, sinks, recent and target_from in one [5, B] tensor (``split_tensor``). Where
scores tie at the eviction threshold the kernels evict the lowest slots (torch's top-k breaks ties its own way).
Tests: tests/kernels/test_d2o_evict_many.py (the step against the general path) and
tests/kernels/test_d2o_evict_many_triton.py (the kernels against the step).
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from kvpass.cache import EMPTY, gather_slots, put_slots
from kvpass.head_group import SINGLE_PROCESS, HeadGroup
from kvpass.kernels._triton import HAS_TRITON, check_device, next_pow2, require_triton, tl, triton
from kvpass.kernels.cosine_match import cosine_match_reference
from kvpass.kernels.d2o_evict_one import (
    SCORE_EPS,
    _rows,
    _update_threshold,
    check_layer_metadata,
    check_layer_tensors,
    protected_count,
    threshold_and_merge_in_place,
    unprotected,
)
from kvpass.kernels.d2o_merge_chains import chain_similarities, fold_chains


def evict_many_in_place(k: Tensor, v: Tensor, score: Tensor, position: Tensor, log_weight: Tensor, length: Tensor,
                        tau: Tensor, tau_set: Tensor, others: list[Tensor], keep: int | Tensor, due: int | Tensor,
                        m: int, sinks: int | Tensor, recent: int | Tensor, target_from: int | Tensor, beta: float,
                        variant: str, min_cos: float, bias: bool = False, protect: float = 0.0,
                        score_weights: bool = False, heads: HeadGroup = SINGLE_PROCESS, chains: bool = True) -> None:
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
    if chains:                              # a later evicted entry may be the better target (d2o_merge_chains)
        u_star, chained, parent = chain_similarities(k_e, valid, torch.where(matched, u_star, float("-inf")))
        matched = matched | chained
    u_star = torch.where(matched, u_star, 0.0)
    merged, w_e, w_self = threshold_and_merge_in_place(heads, u_star, matched, tau, tau_set, beta, variant,
                                                       min_cos)                            # [B, Hkv, m]
    score_e = None
    if score_weights:                       # each entry weighs its score + SCORE_EPS (the target's: per evicted f)
        score_e = torch.gather(score.float(), 2, e_idx) + SCORE_EPS
        w_e = torch.where(merged, score_e, 0.0)
    sizes = torch.gather(log_weight, 2, e_idx).exp() if bias else None
    if chains:                              # the linked entries fold into their evicted parents, children first
        k_e, v_e, sizes = fold_chains(k_e, v_e, parent, chained & merged, w_e, score_e if score_weights else w_self,
                                      variant == "code" and not score_weights, sizes)
        merged, w_e = merged & ~chained, torch.where(chained, 0.0, w_e)
    if score_weights:
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
        size_e = torch.where(merged, sizes, 0.0)
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


# ---------------------------------------------------------------------------------------------------- Triton
# The same step in three kernels (CUDA; on CPU under TRITON_INTERPRET=1 for the tests), for one process
# (``heads`` of one rank), without ``protect`` and ``score_weights`` and for 16/32-bit caches (the plain-torch
# step above takes the rest). The plain-torch step launches some 150 kernels a layer (sorts, top-k, masks,
# gathers), 0.58 ms a layer at B = 1, m = 64 in a CUDA graph on an H100: at 32k the step compressing all 32
# layers took 7 ms more than a plain one (benchmarks/results/d2o-evict-many-nvidia-h100-80gb-hbm3/).
#
# Kernel S (select), one program per (b, g) row, n = length, n_ev = min(length - keep, m) where b is due:
#     t_s = the sinks-th, t_r = the max(n - recent, 0)-th, t_t = the target_from-th smallest live position
#           (0-based; the largest position + 1 where there are fewer): any t with #{position < t} = k serves,
#           so first the guesses min + sinks, max + 1 - recent, min + target_from (no gap among those
#           positions, as decoding leaves them), counted in one pass; a search over the values where a
#           count is off
#     forced = position < t_s or position >= t_r     (the sinks and the recent window, wherever their slots are)
#     T = the (n_ev - 1)-th smallest key(score) outside the forced (key: the fp32 bits as an ordered int32,
#         written to a scratch row once), by a search (``_kth_smallest``: a bisection over the row in registers
#         where it fits, else 16-ary passes over blocks of it);
#         evicted = key < T, then the slots of key == T in slot order until there are n_ev
#     e_idx = the evicted slots by ascending position; k_e, v_e their rows; targets = live, kept and
#         position >= t_t (the nearest-key search's candidates)
# Then ``cosine_match`` (k_e against the layer, targets) gives nearest, u.
# Kernel T (threshold), one program per batch row: the EMA and the merge decisions of ``threshold_and_merge``
#     over the row's heads (u of the valid evictions, 0 elsewhere).
# Kernel M (merge and compact), one program per (b, g) row: assign[f, e] = (nearest_f = nearest_e) & merged_e;
#     k_t <- (w_self k_t + sum_e assign[f, e] w_e k_e) / norm_f for each absorbing f (one fp32 dot, IEEE);
#     then the kept entries at slots >= length - n_ev fill the evicted slots below it (both ascending), the
#     freed slots are emptied and length -= n_ev. Phases that read what another thread wrote are split by
#     barriers. Other slot metadata follows the moves in torch (the kernel writes each row's pairs).

_BIG = tl.constexpr(2**62) if HAS_TRITON else 2**62     # a jitted function reads globals only as constexprs
# a non-candidate's int32 key: above every score's (the fp32 bits of a NaN, which no score is)
_KEY_NONE = tl.constexpr(2**31 - 1) if HAS_TRITON else 2**31 - 1


@triton.jit
def _order_key(score):
    """fp32 -> int64 in the same order (the sign-magnitude bits made two's complement)."""
    bits = score.to(tl.int32, bitcast=True)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)


@triton.jit
def _candidates(SCORE, POS, base, offs, n, t_s, t_r):
    """(in range, position, order key, candidate) of slots ``offs``: live and neither sink nor recent."""
    m = offs < n
    pos = tl.load(POS + base + offs, mask=m, other=-1)
    key = _order_key(tl.load(SCORE + base + offs, mask=m, other=0.0))
    return m, pos, key, m & (pos >= t_s) & (pos < t_r)


@triton.jit
def _kth_smallest(VALS, base, n, k, lo, hi, BLOCK: tl.constexpr, WAYS: tl.constexpr, RESIDENT: tl.constexpr):
    """The k-th smallest (0-based) of the values VALS[base + j], j < n, that lie in [lo, hi] (the others must lie
    above hi): the smallest x with #{value <= x} > k; hi + 1 where k >= n. RESIDENT (n <= BLOCK): the row is
    loaded once into registers and bisected, each step one compare and one sum over it. Else a WAYS-ary search
    over blocks of BLOCK: each pass reads the row once and counts the values at or below WAYS evenly spaced
    pivots, keeping the stretch between the two around the k-th: log_WAYS(hi - lo) passes, where each pass is a
    serial chain of loads (a bisection's 31 passes over the row took 100 us at 6.6k slots on an H200)."""
    top = hi
    offs = tl.arange(0, BLOCK)
    if RESIDENT:
        row = tl.load(VALS + base + offs, mask=offs < n, other=0)
        while lo < hi:
            mid = lo + (hi - lo) // 2
            up = tl.sum(((offs < n) & (row <= mid.to(row.dtype))).to(tl.int32), 0) > k
            hi = tl.where(up, mid, hi)
            lo = tl.where(up, lo, mid + 1)
    else:
        ways = tl.arange(0, WAYS)
        while lo < hi:
            step = (hi - lo) // WAYS + 1                # ceil((hi - lo + 1) / WAYS): the last pivot is hi
            pivots = tl.minimum(lo + (ways + 1).to(tl.int64) * step - 1, hi)
            count = tl.zeros([WAYS], tl.int32)
            for c0 in range(0, n, BLOCK):
                x = tl.load(VALS + base + c0 + offs, mask=c0 + offs < n, other=0)
                count += tl.sum(((c0 + offs < n)[:, None] & (x[:, None] <= pivots[None, :])).to(tl.int32), 0)
            first = tl.min(tl.where(count > k, ways, WAYS), 0)     # WAYS: none (k >= n), then stop
            new_hi = tl.sum(tl.where(ways == first, pivots, 0), 0)
            below = tl.sum(tl.where(ways == first - 1, pivots + 1, 0), 0)
            hi = tl.where(first < WAYS, new_hi, lo)
            lo = tl.where(first > 0, below, lo)
            lo = tl.minimum(lo, hi)
    return tl.where(k >= n, top + 1, lo)


@triton.jit(do_not_specialize=("C", "HKV"))
def _select_kernel(
    K, V, SCORE, POS, LENGTH, SPLIT, E_IDX, N_EV, K_E, V_E, TARGETS, KEYS,
    skb, skh, skc, skd, svb, svh, svc, svd, B, HKV, C,
    M: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr, COUNT_BLOCK: tl.constexpr, WAYS: tl.constexpr, RESIDENT: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    b = row // HKV
    g = row % HKV
    base = row * C
    offs_h = tl.arange(0, BLOCK_H)
    lengths = tl.load(LENGTH + b * HKV + offs_h, mask=offs_h < HKV, other=0)
    keep = tl.load(SPLIT + b)
    due = tl.load(SPLIT + B + b)
    sinks = tl.load(SPLIT + 2 * B + b)
    recent = tl.load(SPLIT + 3 * B + b)
    target_from = tl.load(SPLIT + 4 * B + b)
    n = tl.load(LENGTH + row)
    n_ev = tl.where((tl.max(lengths, 0) >= due) & (n > keep), tl.minimum(n - keep, M), 0)
    if n_ev > 0:
        lo = tl.full([], _BIG, tl.int64)
        hi = tl.full([], -1, tl.int64)
        for c0 in range(0, n, BLOCK):
            offs = c0 + tl.arange(0, BLOCK)
            pos = tl.load(POS + base + offs, mask=offs < n, other=-1)
            lo = tl.minimum(lo, tl.min(tl.where(offs < n, pos, _BIG), 0))
            hi = tl.maximum(hi, tl.max(pos, 0))
        # a threshold t splits off the k lowest positions where #{position < t} = k: first the guess that the
        # sinks, the recent window and the target floor's positions run without a gap (what decoding leaves),
        # checked in one pass; a search only where it fails
        k_r = tl.maximum(n - recent, 0)
        t_s, t_r, t_t = lo + sinks, hi + 1 - recent, lo + target_from
        below_s = tl.zeros([], tl.int64)
        below_r = tl.zeros([], tl.int64)
        below_t = tl.zeros([], tl.int64)
        for c0 in range(0, n, BLOCK):
            offs = c0 + tl.arange(0, BLOCK)
            pos = tl.load(POS + base + offs, mask=offs < n, other=_BIG)
            below_s += tl.sum((pos < t_s).to(tl.int64), 0)
            below_r += tl.sum((pos < t_r).to(tl.int64), 0)
            below_t += tl.sum((pos < t_t).to(tl.int64), 0)
        if below_s != sinks:
            t_s = _kth_smallest(POS, base, n, sinks, lo, hi, COUNT_BLOCK, WAYS, RESIDENT)
        if below_r != k_r:
            t_r = _kth_smallest(POS, base, n, k_r, lo, hi, COUNT_BLOCK, WAYS, RESIDENT)
        if below_t != target_from:
            t_t = _kth_smallest(POS, base, n, target_from, lo, hi, COUNT_BLOCK, WAYS, RESIDENT)
        k_lo = tl.full([], _BIG, tl.int64)
        k_hi = tl.full([], -_BIG, tl.int64)
        n_cand = tl.zeros([], tl.int64)
        for c0 in range(0, n, BLOCK):
            offs = c0 + tl.arange(0, BLOCK)
            m, pos, key, cand = _candidates(SCORE, POS, base, offs, n, t_s, t_r)
            k_lo = tl.minimum(k_lo, tl.min(tl.where(cand, key, _BIG), 0))
            k_hi = tl.maximum(k_hi, tl.max(tl.where(cand, key, -_BIG), 0))
            n_cand += tl.sum(cand.to(tl.int64), 0)
            # the candidates' keys as int32 (4 bytes a slot for the search below, not a score and a position)
            tl.store(KEYS + base + offs, tl.where(cand, key, _KEY_NONE).to(tl.int32), mask=m)
        n_ev = tl.minimum(n_ev, n_cand)                 # callers keep sinks + recent <= keep: never lower
        tl.debug_barrier()
        # T: the smallest key with #{key <= T} >= n_ev (n_ev <= n_cand <= n: never past k_hi; the others' keys,
        # _KEY_NONE, lie above k_hi)
        k_lo = _kth_smallest(KEYS, base, n, n_ev - 1, k_lo, k_hi, COUNT_BLOCK, WAYS, RESIDENT)
        below = tl.zeros([], tl.int64)
        for c0 in range(0, n, BLOCK):
            offs = c0 + tl.arange(0, BLOCK)
            key = tl.load(KEYS + base + offs, mask=offs < n, other=_KEY_NONE).to(tl.int64)
            below += tl.sum((key < k_lo).to(tl.int64), 0)
        ties_left = n_ev - below
        taken = tl.zeros([], tl.int64)
        ties = tl.zeros([], tl.int64)
        for c0 in range(0, C, BLOCK):
            offs = c0 + tl.arange(0, BLOCK)
            m, pos, key, cand = _candidates(SCORE, POS, base, offs, n, t_s, t_r)
            tie = cand & (key == k_lo)
            tie_rank = ties + tl.cumsum(tie.to(tl.int32), 0).to(tl.int64) - 1
            sel = (cand & (key < k_lo)) | (tie & (tie_rank < ties_left))
            slot = taken + tl.cumsum(sel.to(tl.int32), 0).to(tl.int64) - 1
            tl.store(E_IDX + row * M + slot, offs.to(tl.int64), mask=sel)
            tl.store(TARGETS + base + offs, (m & ~sel & (pos >= t_t)).to(tl.int8), mask=offs < C)
            taken += tl.sum(sel.to(tl.int64), 0)
            ties += tl.sum(tie.to(tl.int64), 0)
    else:
        for c0 in range(0, C, BLOCK):
            offs = c0 + tl.arange(0, BLOCK)
            tl.store(TARGETS + base + offs, tl.zeros([BLOCK], tl.int8), mask=offs < C)
    tl.store(N_EV + row, n_ev)
    tl.debug_barrier()
    # the evicted slots (in slot order) by ascending position, and their K, V rows (zeros past n_ev)
    offs_m = tl.arange(0, BLOCK_M)
    valid = offs_m < n_ev
    slot = tl.load(E_IDX + row * M + offs_m, mask=valid, other=0)
    pos = tl.load(POS + base + slot, mask=valid, other=_BIG)
    rank = tl.sum((valid[None, :] & (pos[None, :] < pos[:, None])).to(tl.int64), 1)
    dest = tl.where(valid, rank, offs_m)
    slot = tl.where(valid, slot, 0)
    tl.debug_barrier()
    tl.store(E_IDX + row * M + dest, slot, mask=offs_m < M)
    offs_d = tl.arange(0, BLOCK_D)
    for d0 in range(0, HEAD_DIM, BLOCK_D):
        dm = (d0 + offs_d) < HEAD_DIM
        both = valid[:, None] & dm[None, :]
        out = (row * M + dest)[:, None] * HEAD_DIM + (d0 + offs_d)[None, :]
        k_e = tl.load(K + b * skb + g * skh + slot[:, None] * skc + (d0 + offs_d)[None, :] * skd, mask=both, other=0.0)
        tl.store(K_E + out, k_e, mask=(offs_m < M)[:, None] & dm[None, :])
        v_e = tl.load(V + b * svb + g * svh + slot[:, None] * svc + (d0 + offs_d)[None, :] * svd, mask=both, other=0.0)
        tl.store(V_E + out, v_e, mask=(offs_m < M)[:, None] & dm[None, :])


@triton.jit
def _threshold_kernel(
    U, N_EV, TAU, TAU_SET, MERGED, W_E, HKV, beta, one_minus_beta, min_cos,
    M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_M: tl.constexpr, PAPER: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_m = tl.arange(0, BLOCK_M)
    rows = b * HKV + offs_h
    n_ev = tl.load(N_EV + rows, mask=offs_h < HKV, other=0)
    valid = (offs_h < HKV)[:, None] & (offs_m[None, :] < n_ev[:, None])                # [BLOCK_H, BLOCK_M]
    at = rows[:, None] * M + offs_m[None, :]
    u = tl.where(valid, tl.load(U + at, mask=valid, other=0.0), 0.0)
    count = tl.sum(tl.sum(valid.to(tl.int32), 1), 0)
    current = tl.div_rn(tl.sum(tl.sum(u, 1), 0), tl.maximum(count, 1).to(tl.float32))
    tau = _update_threshold(TAU, TAU_SET, b, current, count, beta, one_minus_beta)
    floor = u >= min_cos
    if PAPER:
        merged = valid & (u >= tau) & floor
        w_e = tl.where(merged, tl.exp(u), 0.0)
    else:                                   # the i-th eviction's mean over the heads decides for every head
        per_slot = tl.div_rn(tl.sum(u, 0), tl.maximum(tl.sum(valid.to(tl.int32), 0), 1).to(tl.float32))
        merged = valid & (per_slot[None, :] >= tau) & floor
        w_e = tl.where(merged, u, 0.0)
    keep = (offs_h < HKV)[:, None] & (offs_m < M)[None, :]
    tl.store(MERGED + at, merged.to(tl.int8), mask=keep)
    tl.store(W_E + at, w_e, mask=keep)


@triton.jit
def _merge_rows(X, X_E, x_row, sc, sd, e_row, nearest, w, w_self, norm, absorbed,
                M: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """k_t <- (w_self k_t + sum_e w[f, e] k_e) / norm_f at the target t = nearest_f of each absorbing f (f's
    sharing a target write the same value; every load before the stores)."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    for d0 in range(0, HEAD_DIM, BLOCK_D):
        dm = (d0 + offs_d) < HEAD_DIM
        x_e = tl.load(X_E + (e_row + offs_m)[:, None] * HEAD_DIM + (d0 + offs_d)[None, :],
                      mask=(offs_m < M)[:, None] & dm[None, :], other=0.0).to(tl.float32)
        at = x_row + nearest[:, None] * sc + (d0 + offs_d)[None, :] * sd
        mask = absorbed[:, None] & dm[None, :]
        into = tl.load(X + at, mask=mask, other=0.0).to(tl.float32)
        acc = w_self * into + tl.dot(w, x_e, input_precision="ieee")
        tl.debug_barrier()
        tl.store(X + at, tl.div_rn(acc, norm[:, None]).to(X.dtype.element_ty), mask=mask)


@triton.jit
def _move_rows(X, x_row, sc, sd, dst, src, pair, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """X[dst_i] <- X[src_i] where ``pair`` (src slots lie above every dst slot: no row is both)."""
    offs_d = tl.arange(0, BLOCK_D)
    for d0 in range(0, HEAD_DIM, BLOCK_D):
        mask = pair[:, None] & ((d0 + offs_d) < HEAD_DIM)[None, :]
        cols = (d0 + offs_d)[None, :] * sd
        x = tl.load(X + x_row + src[:, None] * sc + cols, mask=mask, other=0.0)
        tl.store(X + x_row + dst[:, None] * sc + cols, x, mask=mask)


@triton.jit(do_not_specialize=("C", "HKV"))
def _merge_compact_kernel(
    K, V, SCORE, POS, LW, LENGTH, E_IDX, N_EV, K_E, V_E, NEAREST, MERGED, W_E, MOVE_DST, MOVE_SRC,
    skb, skh, skc, skd, svb, svh, svc, svd, HKV, C, w_self,
    M: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, PAPER: tl.constexpr,
    BIAS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    b = row // HKV
    g = row % HKV
    base = row * C
    n_ev = tl.load(N_EV + row)
    length = tl.load(LENGTH + row)
    offs_m = tl.arange(0, BLOCK_M)
    in_m = offs_m < M
    valid = offs_m < n_ev
    e = tl.load(E_IDX + row * M + offs_m, mask=valid, other=0)
    if n_ev > 0:
        nearest = tl.maximum(tl.load(NEAREST + row * M + offs_m, mask=valid, other=0), 0)
        merged = tl.load(MERGED + row * M + offs_m, mask=valid, other=0) != 0
        w_e = tl.load(W_E + row * M + offs_m, mask=valid, other=0.0)
        assign = (nearest[:, None] == nearest[None, :]) & merged[None, :]                  # [f, e]
        count = tl.sum(assign.to(tl.float32), 1)
        w = tl.where(assign, w_e[None, :], 0.0)
        if PAPER:
            norm = w_self + tl.sum(w, 1)
        else:
            norm = w_self + count
        absorbed = valid & (count > 0)
        _merge_rows(K, K_E, b * skb + g * skh, skc, skd, row * M, nearest, w, w_self, norm, absorbed,
                    M, HEAD_DIM, BLOCK_M, BLOCK_D)
        _merge_rows(V, V_E, b * svb + g * svh, svc, svd, row * M, nearest, w, w_self, norm, absorbed,
                    M, HEAD_DIM, BLOCK_M, BLOCK_D)
        if BIAS:                            # sizes add: log(exp(lw_t) + sum_e assign exp(lw_e))
            lw_e = tl.load(LW + base + e, mask=valid, other=0.0)
            size_e = tl.where(merged, tl.exp(lw_e), 0.0)
            lw_t = tl.load(LW + base + nearest, mask=absorbed, other=0.0)
            size = tl.exp(lw_t) + tl.sum(tl.where(assign, size_e[None, :], 0.0), 1)
            tl.debug_barrier()
            tl.store(LW + base + nearest, tl.log(size), mask=absorbed)
    tl.debug_barrier()
    # compaction: the kept entries at slots [new length, length) fill the evicted slots below new length
    new_length = length - n_ev
    hole = valid & (e < new_length)
    hole_rank = tl.sum((hole[None, :] & (e[None, :] < e[:, None])).to(tl.int64), 1)
    above = new_length + offs_m
    gone = tl.sum((valid[None, :] & (e[None, :] == above[:, None])).to(tl.int32), 1) > 0
    mover = (above < length) & ~gone & valid
    mover_rank = tl.cumsum(mover.to(tl.int32), 0).to(tl.int64) - 1
    src = tl.sum(tl.where(mover[None, :] & (mover_rank[None, :] == hole_rank[:, None]), above[None, :], 0), 1)
    _move_rows(K, b * skb + g * skh, skc, skd, e, src, hole, HEAD_DIM, BLOCK_D)
    _move_rows(V, b * svb + g * svh, svc, svd, e, src, hole, HEAD_DIM, BLOCK_D)
    score = tl.load(SCORE + base + src, mask=hole, other=0.0)
    pos = tl.load(POS + base + src, mask=hole, other=-1)
    lw = tl.load(LW + base + src, mask=hole, other=0.0)
    tl.debug_barrier()
    tl.store(SCORE + base + e, score, mask=hole)
    tl.store(POS + base + e, pos, mask=hole)
    tl.store(LW + base + e, lw, mask=hole)
    freed = valid & (above < length)                    # n_ev slots [new length, length)
    tl.store(SCORE + base + above, tl.zeros([BLOCK_M], tl.float32), mask=freed)
    tl.store(POS + base + above, tl.full([BLOCK_M], -1, tl.int64), mask=freed)
    tl.store(LW + base + above, tl.full([BLOCK_M], float("-inf"), tl.float32), mask=freed)
    tl.store(LENGTH + row, new_length)
    tl.store(MOVE_DST + row * M + offs_m, tl.where(hole, e, C - 1), mask=in_m)
    tl.store(MOVE_SRC + row * M + offs_m, tl.where(hole, src, C - 1), mask=in_m)


def evict_many_triton(k: Tensor, v: Tensor, score: Tensor, position: Tensor, log_weight: Tensor, length: Tensor,
                      tau: Tensor, tau_set: Tensor, others: list[Tensor], split: Tensor, m: int, beta: float,
                      variant: str, min_cos: float, bias: bool = False, chains: bool = True, *, block: int = 4096,
                      count_block: int = 1024, ways: int = 16, resident_max: int = 8192, num_warps: int = 8) -> None:
    """``evict_many_in_place`` as the three kernels (the comment above them), one process, no ``protect`` or
    ``score_weights``, 16/32-bit k, v. ``split``: [5, B] int64, each batch row's (keep, due, sinks, recent,
    target_from) (``split_tensor``). Scratch: O(B Hkv (m D + C)). Nothing synchronises with the host."""
    require_triton()
    check_layer_tensors(k, v)
    if k.dtype == torch.float64:
        raise ValueError("the Triton step takes 16/32-bit caches; fp64 ones take evict_many_in_place")
    check_layer_metadata(k, v, score, position, log_weight, length, tau, tau_set, others, variant)
    b, h, c, d = k.shape
    if tuple(split.shape) != (5, b) or split.dtype != torch.int64 or not split.is_contiguous():
        raise ValueError(f"split must be contiguous int64 [5, B] = [5, {b}], got {split.dtype} {tuple(split.shape)}")
    check_device("split", split, k.device)
    m = min(m, c)
    if m <= 0:
        return
    dev = k.device
    block_m, block_d, block_h = max(16, next_pow2(m)), min(64, max(16, next_pow2(d))), next_pow2(h)
    e_idx = torch.empty(b * h * m, dtype=torch.int64, device=dev)
    n_ev = torch.empty(b * h, dtype=torch.int64, device=dev)
    k_e = torch.empty(b, h, m, d, dtype=k.dtype, device=dev)
    v_e = torch.empty(b, h, m, d, dtype=v.dtype, device=dev)
    targets = torch.empty(b, h, c, dtype=torch.bool, device=dev)
    keys = torch.empty(b * h * c, dtype=torch.int32, device=dev)
    resident = next_pow2(c) <= resident_max                  # a row's keys fit the select kernel's registers
    _select_kernel[(b * h,)](
        k, v, score, position, length, split, e_idx, n_ev, k_e, v_e, targets.view(torch.int8), keys,
        *k.stride(), *v.stride(), b, h, c,
        M=m, HEAD_DIM=d, BLOCK=min(block, next_pow2(c)), BLOCK_H=block_h, BLOCK_M=block_m, BLOCK_D=block_d,
        COUNT_BLOCK=next_pow2(c) if resident else min(count_block, next_pow2(c)), WAYS=ways, RESIDENT=resident,
        num_warps=num_warps)
    match = torch.ops.kvpass.cosine_match if k.is_cuda else cosine_match_reference
    nearest, u = match(k_e, k, targets)                                      # [B, Hkv, m]
    if chains:                              # a later evicted entry may be the better target (d2o_merge_chains)
        valid = torch.arange(m, device=dev) < n_ev.view(b, h, 1)
        u, chained, parent = chain_similarities(k_e, valid, u)
    merged = torch.empty(b * h * m, dtype=torch.int8, device=dev)
    w_e = torch.empty(b * h * m, dtype=torch.float32, device=dev)
    _threshold_kernel[(b,)](
        u.contiguous(), n_ev, tau, tau_set.view(torch.uint8), merged, w_e, h, float(beta), 1.0 - float(beta),
        float(min_cos), M=m, BLOCK_H=block_h, BLOCK_M=block_m, PAPER=variant == "paper", num_warps=4,
        enable_fp_fusion=False)
    if chains:                              # fold the linked entries into their parents; they merge nowhere else
        link = chained & (merged.view(b, h, m) != 0)
        e_slots = e_idx.view(b, h, m)
        lw_e = torch.gather(log_weight, 2, e_slots) if bias else None
        k_f, v_f, sizes = fold_chains(k_e, v_e, parent, link, w_e.view(b, h, m),
                                      math.e if variant == "paper" else 1.0, variant == "code",
                                      None if lw_e is None else lw_e.exp())
        k_e.copy_(k_f)
        v_e.copy_(v_f)
        merged.masked_fill_(chained.view(-1), 0)
        if bias:                            # the merge kernel reads the evicted entries' sizes from their slots
            log_weight.scatter_(2, e_slots, torch.where(valid, sizes.log(), lw_e))
    before = length.clone() if others else None
    move_dst = torch.empty(b * h, m, dtype=torch.int64, device=dev)
    move_src = torch.empty(b * h, m, dtype=torch.int64, device=dev)
    _merge_compact_kernel[(b * h,)](
        k, v, score, position, log_weight, length, e_idx, n_ev, k_e, v_e, nearest.contiguous(), merged, w_e,
        move_dst, move_src, *k.stride(), *v.stride(), h, c, math.e if variant == "paper" else 1.0,
        M=m, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_D=block_d, PAPER=variant == "paper", BIAS=bool(bias),
        num_warps=4, enable_fp_fusion=False)
    if others:                                  # the kernel's (dst, src) pairs; unpaired: slot C - 1 onto itself
        dst, src = move_dst.view(b, h, m), move_src.view(b, h, m)
        j = torch.arange(c, device=dev)
        freed = (j >= length[..., None]) & (j < before[..., None])              # [B, Hkv, C]
        for t in others:
            put_slots(t, dst, gather_slots(t, src))
            t.masked_fill_(freed.view(*freed.shape, *([1] * (t.dim() - 3))), 0)


def split_tensor(b: int, device: torch.device, keep: int | Tensor, due: int | Tensor, sinks: int | Tensor,
                 recent: int | Tensor, target_from: int | Tensor) -> Tensor:
    """[5, B] int64 on ``device``: each batch row's (keep, due, sinks, recent, target_from), from ints (one
    tensor per distinct tuple, kept: a CUDA graph replays its address) or [B] tensors."""
    values = (keep, due, sinks, recent, target_from)
    if all(isinstance(x, int) for x in values):
        return _constant_split(b, str(device), values)
    return torch.stack([x.to(device=device, dtype=torch.long) if isinstance(x, Tensor)
                        else torch.full((b,), x, dtype=torch.long, device=device) for x in values])


@functools.lru_cache(maxsize=256)
def _constant_split(b: int, device: str, values: tuple[int, ...]) -> Tensor:
    # filled on the device (no copy from the host, which a CUDA graph's capture would refuse)
    return torch.stack([torch.full((b,), x, dtype=torch.long, device=device) for x in values])


@torch.library.custom_op("kvpass::d2o_evict_many", mutates_args=(
    "k", "v", "score", "position", "log_weight", "length", "tau", "tau_set", "others"))
def d2o_evict_many(k: Tensor, v: Tensor, score: Tensor, position: Tensor, log_weight: Tensor, length: Tensor,
                   tau: Tensor, tau_set: Tensor, others: list[Tensor], split: Tensor, m: int, beta: float,
                   variant: str, min_cos: float, bias: bool = False, chains: bool = True) -> None:
    d2o_evict_many_reference(k, v, score, position, log_weight, length, tau, tau_set, others, split, m, beta,
                             variant, min_cos, bias, chains)


def d2o_evict_many_reference(k: Tensor, v: Tensor, score: Tensor, position: Tensor, log_weight: Tensor,
                             length: Tensor, tau: Tensor, tau_set: Tensor, others: list[Tensor], split: Tensor,
                             m: int, beta: float, variant: str, min_cos: float, bias: bool = False,
                             chains: bool = True) -> None:
    """The op's definition: ``evict_many_in_place`` with each batch row's (keep, due, sinks, recent, target_from)
    from ``split`` [5, B]."""
    keep, due, sinks, recent, target_from = split.unbind(0)
    evict_many_in_place(k, v, score, position, log_weight, length, tau, tau_set, others, keep, due, m, sinks,
                        recent, target_from, beta, variant, min_cos, bias, chains=chains)


@d2o_evict_many.register_fake
def _(k, v, score, position, log_weight, length, tau, tau_set, others, split, m, beta, variant, min_cos, bias=False,
      chains=True):
    return None


if HAS_TRITON:
    @d2o_evict_many.register_kernel("cuda")
    def _(k, v, score, position, log_weight, length, tau, tau_set, others, split, m, beta, variant, min_cos,
          bias=False, chains=True):
        evict_many_triton(k, v, score, position, log_weight, length, tau, tau_set, others, split, m, beta, variant,
                          min_cos, bias, chains)
