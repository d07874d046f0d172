"""D2O's compression of one layer in its own buffers, in plain torch: the step of every decode-time form.

A (b, g) row evicts iff its batch row b is due (holds at least ``due`` entries in some head) and it holds more than
``keep``: its n = length - keep (at most m) lowest-scored live entries outside the sinks (the ``sinks`` lowest
positions) and the recent window (the ``recent`` highest), ties to the lower slot, in ascending position. Each
merges into its most cosine-similar kept key at position rank >= ``target_from`` (or a later evicted one, with
chains) under the EMA threshold, as ``reference.compress_reference`` merges; then the kept entries at slots >= the
new length fill the evicted slots below it, the freed slots are emptied and length is set. So the live slots stay
[0, length) but not in sequence order: sinks and window are found by position. The same entries as the reference
(tests/policies/d2o/), no whole-cache copy, no host sync (a CUDA graph captures it).

keep, due, sinks, recent, target_from: ints or [B] int64 tensors (each batch row its own budget); m: a static int
>= every evicting row's length - keep. ``heads``: the threshold over every rank's heads (tensor parallel), and a
row is due where its longest head over every rank is. This function is the CPU kernel of the decode ops
(``d2o_evict_one``: m = 1; ``d2o_evict_many``) and the CUDA step for the options their kernels lack.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

import kvpass.kernels  # noqa: F401  (registers torch.ops.kvpass)
from kvpass.cache import EMPTY, LayerCache, gather_slots, put_slots
from kvpass.head_group import SINGLE_PROCESS, HeadGroup
from kvpass.kernels.cosine_match import cosine_match_reference
from kvpass.policies.d2o.chains import chain_similarities, fold_chains
from kvpass.policies.d2o.merge import (
    SCORE_EPS,
    StepOptions,
    averaged,
    per_row,
    protected_count,
    threshold_and_merge,
    unprotected,
)
from kvpass.policies.d2o.reference import threshold_state


class StepTensors(NamedTuple):
    """The layer's tensors an in-place step mutates, in the ops' argument order: k, v [B, Hkv, C, D]; score (the
    ranked slot metadata), position, log_weight [B, Hkv, C]; length [B, Hkv]; tau [B] fp32, tau_set [B] bool; the
    other slot metadata [B, Hkv, C, ...], which follows the entries' moves."""

    k: Tensor
    v: Tensor
    score: Tensor
    position: Tensor
    log_weight: Tensor
    length: Tensor
    tau: Tensor
    tau_set: Tensor
    others: list[Tensor]

    @classmethod
    def of(cls, cache: LayerCache, score: str) -> StepTensors:
        """``cache``'s tensors, ranked by ``slot_meta[score]``; the threshold state made where missing."""
        tau, tau_set = threshold_state(cache)
        return cls(cache.k, cache.v, cache.slot_meta[score], cache.position, cache.log_weight, cache.length, tau,
                   tau_set, [t for n, t in cache.slot_meta.items() if n != score])


def evicted_slots(t: StepTensors, keep: int | Tensor, due: int | Tensor, m: int, sinks: int | Tensor,
                  recent: int | Tensor, heads: HeadGroup) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(e_idx [B, Hkv, m] in ascending position, valid [B, Hkv, m], the evicting rows' new length [B, Hkv], the
    position rank of every slot [B, Hkv, C]) of the module docstring's selection."""
    b, c = t.k.shape[0], t.k.shape[2]
    j = torch.arange(c, device=t.k.device)
    live = j < t.length[..., None]
    keep_r = per_row(keep, b, 1)
    due_row = heads.max(t.length.amax(1, keepdim=True)) >= per_row(due, b, 1)     # [B, 1], over every rank's heads
    n_evict = torch.where(due_row & (t.length > keep_r), t.length - keep_r, 0).clamp(max=m)
    # position ranks among the live slots (0 = oldest), sorted as int32 (positions < 2^31 - 1; live ones distinct)
    top = torch.iinfo(torch.int32).max
    order = torch.sort(torch.where(live, t.position, top).to(torch.int32), dim=-1, stable=True).indices
    rank = torch.empty_like(order).scatter_(-1, order, j.expand_as(order).contiguous())
    forced = (rank < per_row(sinks, b, 2)) | (rank >= t.length[..., None] - per_row(recent, b, 2))
    prio = torch.where(live & ~forced, t.score.double(), float("inf"))
    cand = torch.sort(prio, dim=-1, stable=True).indices[..., :m]            # the m lowest, ties: the lower slot
    valid = torch.arange(m, device=t.k.device) < n_evict[..., None]
    by_pos = torch.where(valid, torch.gather(t.position, 2, cand), torch.iinfo(torch.long).max)
    return torch.gather(cand, 2, by_pos.argsort(dim=-1, stable=True)), valid, t.length - n_evict, rank


def evict_in_place(t: StepTensors, keep: int | Tensor, due: int | Tensor, m: int, sinks: int | Tensor,
                   recent: int | Tensor, target_from: int | Tensor, opts: StepOptions,
                   heads: HeadGroup = SINGLE_PROCESS) -> None:
    """The module docstring's step on the layer ``t``, in place."""
    b, c = t.k.shape[0], t.k.shape[2]
    m = min(m, c)
    if m <= 0:
        return
    e_idx, valid, new_length, rank = evicted_slots(t, keep, due, m, sinks, recent, heads)
    live = torch.arange(c, device=t.k.device) < t.length[..., None]
    evicted = torch.zeros_like(live).scatter_(2, e_idx, valid)
    k_e, v_e = gather_slots(t.k, e_idx), gather_slots(t.v, e_idx)              # [B, Hkv, m, D]
    kept = live & ~evicted
    targets = kept & (rank >= per_row(target_from, b, 2))
    if opts.protect > 0:
        targets = targets & unprotected(t.score, kept, protected_count(opts.protect, keep))
    match = torch.ops.kvpass.cosine_match if t.k.is_cuda else cosine_match_reference
    nearest, u = match(k_e, t.k, targets)                                       # [B, Hkv, m]
    matched = valid & (nearest >= 0) if opts.protect > 0 else valid   # no target left: evicted without trace
    nearest = nearest.clamp(min=0)
    if opts.chains:                        # a later evicted entry may be the better target (chains.py)
        u, chained, parent = chain_similarities(k_e, valid, torch.where(matched, u, float("-inf")))
        matched = matched | chained
    merged, w_e = threshold_and_merge(heads, torch.where(matched, u, 0.0), matched, t.tau, t.tau_set, opts)
    score_e = torch.gather(t.score.float(), 2, e_idx) + SCORE_EPS if opts.score_weights else None
    w_self: float | Tensor = opts.w_self
    if score_e is not None:
        w_e = torch.where(merged, score_e, 0.0)
    lw_e = torch.gather(t.log_weight, 2, e_idx) if opts.bias else None
    sizes = None if lw_e is None else lw_e.exp()
    if opts.chains:                        # the linked entries fold into their evicted parents, children first
        k_e, v_e, sizes = fold_chains(k_e, v_e, parent, chained & merged, w_e,
                                      score_e if score_e is not None else w_self, opts.by_count, sizes)
        merged, w_e = merged & ~chained, torch.where(chained, 0.0, w_e)
    if opts.score_weights:
        w_self = (torch.gather(t.score.float(), 2, nearest) + SCORE_EPS)[..., None]          # [B, Hkv, m, 1]
    merge_into(t, nearest, merged, w_e, w_self, k_e, v_e, (lw_e, sizes), opts)
    compact(t, e_idx, valid, evicted, new_length)


def merge_into(t: StepTensors, nearest: Tensor, merged: Tensor, w_e: Tensor, w_self: float | Tensor, k_e: Tensor,
               v_e: Tensor, bias: tuple[Tensor | None, Tensor | None], opts: StepOptions) -> None:
    """Each target's final average, written once per evicted entry f that merges into it: assign[f, e] = evicted e
    merges into f's target ([B, Hkv, m, m]), so every write of one slot carries the same value (no scatter-add).
    ``bias`` (merge_bias): the evicted entries' (log-weights, sizes after chains); a target's log-size becomes
    log(exp(log_weight) + the merged entries' sizes)."""
    lw_e, sizes = bias
    assign = ((nearest[..., :, None] == nearest[..., None, :]) & merged[..., None, :]).float()
    count = assign @ merged.float()[..., None]                                 # [B, Hkv, m, 1]
    w_sum = assign @ w_e[..., None]
    for buf, src in ((t.k, k_e), (t.v, v_e)):
        into = gather_slots(buf, nearest)
        acc = w_self * into.float() + assign @ (w_e[..., None] * src.float())
        put_slots(buf, nearest, averaged(into, acc, w_self, w_sum, count, opts))
    if sizes is not None:                  # before anything moves (fp32, as the reference)
        into = gather_slots(t.log_weight, nearest)
        if nearest.shape[-1] == 1:         # one eviction: log(e^a + e^b) shifted by the max, as the Triton step
            top = torch.maximum(into, lw_e)
            new = top + torch.log(torch.exp(into - top) + torch.exp(lw_e - top))
        else:
            new = (into.exp() + (assign @ torch.where(merged, sizes, 0.0)[..., None])[..., 0]).log()
        put_slots(t.log_weight, nearest, torch.where(count[..., 0] > 0, new, into))


def compact(t: StepTensors, e_idx: Tensor, valid: Tensor, evicted: Tensor, new_length: Tensor) -> None:
    """The kept entries at slots >= new length fill the evicted slots below it (both ascending; unpaired: slot C - 1
    onto itself, never a hole), for every tensor of the layer; the freed slots are emptied; length is set."""
    c, m = t.k.shape[2], e_idx.shape[-1]
    j = torch.arange(c, device=t.k.device)
    hole = valid & (e_idx < new_length[..., None])
    holes = torch.where(hole, e_idx, c).sort(-1).values                        # [B, Hkv, m]
    above = new_length[..., None] + torch.arange(m, device=t.k.device)         # the slots [new length, length)
    above_c = above.clamp(max=c - 1)
    mover = (above < t.length[..., None]) & ~torch.gather(evicted, 2, above_c)
    movers = torch.where(mover, above_c, c).sort(-1).values
    pair = holes < c                                                           # as many holes as movers per row
    dst, src = torch.where(pair, holes, c - 1), torch.where(pair, movers.clamp(max=c - 1), c - 1)
    for x in (t.k, t.v, t.log_weight, t.position, t.score, *t.others):
        put_slots(x, dst, gather_slots(x, src))
    freed = (j >= new_length[..., None]) & (j < t.length[..., None])
    for x, empty in ((t.log_weight, EMPTY), (t.position, -1), (t.score, 0), *((o, 0) for o in t.others)):
        x.masked_fill_(freed.view(*freed.shape, *([1] * (x.dim() - 3))), empty)
    t.length.copy_(new_length)
