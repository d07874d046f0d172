"""D2O's decode-time one-in-one-out compression of one layer, in place (docs/policies.md §5.5-5.6, §5.8).

A layer of capacity C = keep + 1: every (b, g) row holding keep + 1 entries evicts one, the others
(length <= keep) evict nothing and are left unchanged. Per evicting row, with live slots j < length:

    newest  = position[C - 1]    (the entry this decode step wrote at slot length: an evicting row is full)
    e       = argmin col_sum[j] over j >= sinks, position[j] <= newest - recent   (ties: lowest j)
    nearest = argmax cos(k_e, k_j) over live j != e,   u = that cosine             (ties: lowest j)
              cos(x, y) = x . y / (max(|x|, eps) max(|y|, eps)), eps = 1e-12, in fp32 (fp64 inputs: fp64)
Per batch row b (the EMA threshold of §5.6 step 2), over its n evicting heads:
    current = sum_g u_g / max(n, 1)
    tau     = current (first time), beta current + (1 - beta) tau (after), unchanged if n = 0
    tau_set = tau_set or n > 0
Merge decision and weights (§5.6 steps 3-4), per evicting head:
    "paper": merged = u >= tau,       w_e = exp(u), w_self = e, norm = e + w_e
    "code":  merged = current >= tau, w_e = u,      w_self = 1, norm = 1 + 1
    k_nearest <- (w_self k_nearest + w_e k_e) / norm   (fp32, stored in the cache dtype; v likewise)
Options (D2O's merge guard and merge bias, docs/d2o.md; defaults: off):
    target_from:  nearest is sought among live j >= target_from only (sinks never absorb a token)
    min_cos:      merged = merged and u >= min_cos (a cosine floor; NO_FLOOR = -2: none, NO_MERGE = 2: nothing merges)
    bias:         log_weight[nearest] <- logaddexp(log_weight[nearest], log_weight[e]) where merged, so
                  an entry standing for n tokens gets the additive attention logit log n
Then the newest entry (slot C - 1) moves into slot e (k, v, col_sum, position, log_weight and any
other slot metadata), slot C - 1 is emptied (log_weight -inf, position -1, metadata 0; its K, V are
left) and length -= 1. The merge comes first: nearest may be slot C - 1. So the live slots stay
[0, length) but not in sequence order, which is why the recent window is found by position.

Shapes: k, v [B, Hkv, C, D] (fp16/bf16/fp32/fp64); col_sum [B, Hkv, C] fp32; position [B, Hkv, C]
int64 (-1 empty); log_weight [B, Hkv, C] fp32 (-inf empty); length [B, Hkv] int64; tau [B] fp32,
tau_set [B] bool (the layer's threshold state); others: more slot metadata [B, Hkv, C, ...]. All are
updated in place; nothing is returned and nothing synchronises with the host.

Cost per evicting row: reads of C positions, C scores and C keys (C D elements), writes of at most
three slots. Rows that evict nothing read nothing beyond their length.

Rows of budgets of their own (D2O's per-row layer budgets): kvpass/kernels/d2o_evict_one_ragged.py, the
same step with keep, sinks, recent, target_from per batch row (the references share ``evict_one_in_place``,
the kernels their RAGGED form); there the newest entry of an evicting row is at slot length - 1.

Two more of D2O's merge guards exist in the plain-torch step alone (``evict_one_in_place``'s ``protect`` and
``score_weights``; the Triton kernels have neither, D2O runs this step for them on CUDA too, batched and
capturable in a CUDA graph):
    protect:       nearest is sought outside the floor(protect * keep) live j != e of highest col_sum
                   (ties: the lower slot), per row with its own keep; a row left with no target evicts e
                   without merging, and its head does not enter the threshold (not counted in n)
    score_weights: w_nearest = col_sum[nearest] + SCORE_EPS, w_e = col_sum[e] + SCORE_EPS,
                   k_nearest <- (w_nearest k_nearest + w_e k_e) / (w_nearest + w_e) where merged (the merge
                   decision is the variant's, as above)

Triton path (CUDA; on CPU under TRITON_INTERPRET=1 for the tests), three kernels. A and B run one
program per (row, split of its slots): A the chunk's lowest candidate score, B the row's e from A's
minima and the chunk's most similar key. C, one program per batch row: combines the splits' maxima,
the EMA threshold, merges and moves. Splitting keeps the GPU busy at B = 1 (Hkv programs alone would
use a few SMs), and each program's work is one short scan (the op is latency-bound).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Generator
from typing import NamedTuple

import torch
from torch import Tensor

from kvpass.head_group import SINGLE_PROCESS, HeadGroup
from kvpass.kernels._triton import HAS_TRITON, check_device, next_pow2, require_triton, tl, triton
from kvpass.kernels.cosine_match import cosine_match_reference
from kvpass.kernels.decode_attention_nearest import NEAREST_INPUTS, check_nearest_inputs, fuses_at

_EPS = 1e-12
SCORE_EPS = 1e-6       # score_weights: added to every weight (entries of zero score average)
EMPTY = float("-inf")
NO_FLOOR = -2.0        # min_cos that lets every merge through (a cosine is >= -1)
NO_MERGE = 2.0         # min_cos that lets none through (a cosine is <= 1)


class OneEviction(NamedTuple):
    """What ``pick_one`` finds per row, each [B, Hkv, 1, ...]: the evicted slot e (C - 1 when the row
    evicts nothing), whether it evicts with a merge target (``valid``: the evictions that enter the
    threshold; without ``protect`` every eviction has one), the entry's K and V, its nearest allowed
    live slot and that cosine similarity (0 where not valid)."""

    e: Tensor
    valid: Tensor
    k_e: Tensor
    v_e: Tensor
    nearest: Tensor
    u_star: Tensor


def _rows(x: int | Tensor, b: int, dims: int) -> int | Tensor:
    """An int as it is, or a per batch row [B] tensor viewed [B, 1, ...] (``dims`` ones) to broadcast."""
    return x if isinstance(x, int) else x.view(b, *([1] * dims))


def newest_slot(length: Tensor, evict: Tensor, c: int) -> Tensor:
    """[B, Hkv] slot of the newest entry of an evicting row, ``length - 1`` (the slot the decode step just
    wrote), and C - 1 for the others (then the move of the newest entry is a move of slot C - 1 onto itself)."""
    return torch.where(evict, length - 1, c - 1)


def protected_count(protect: float, keep: int | Tensor) -> int | Tensor:
    """floor(protect * keep): an int for an int ``keep``, else [B] int64 on keep's device, computed there in
    fp64 (the same product and floor as the int's, with no host sync)."""
    if isinstance(keep, int):
        return int(protect * keep)
    return (protect * keep.double()).floor().long()


def unprotected(score: Tensor, live: Tensor, n_protect: int | Tensor) -> Tensor:
    """[B, Hkv, C] bool: the ``live`` slots outside the ``n_protect`` (an int, or [B] int64: per batch row)
    highest ``score`` [B, Hkv, C] of their row (ties: the lower slot first; a stable sort, the same on every
    device). Sort, scatter and compare: no host sync."""
    order = torch.sort(score.float().masked_fill(~live, float("-inf")), dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(order.shape[-1], device=order.device)
                                            .expand_as(order).contiguous())
    return live & (rank >= _rows(n_protect, score.shape[0], 2))


def pick_one(k: Tensor, v: Tensor, col_sum: Tensor, position: Tensor, length: Tensor, keep: int | Tensor,
             sinks: int | Tensor, recent: int | Tensor, target_from: int | Tensor = 0, protect: float = 0.0
             ) -> OneEviction:
    """§5.5-5.6 for rows of at most keep + 1 entries (plain torch): the lowest ``col_sum`` outside the
    sinks (slots [0, sinks), where they stay) and the recent window (the ``recent`` newest positions),
    its K, V and its most cosine-similar other live key at a slot >= ``target_from``. A row holding at
    most keep entries evicts nothing (e = C - 1). A row's positions count its tokens and the window is never evicted, so the
    window is exactly the positions above newest - recent, wherever their slots are; newest is the
    position in slot length - 1, where the decode step wrote its entry (slot C - 1 with one ``keep`` for
    every row: a row that evicts is full).
    k, v: [B, Hkv, C, D]; col_sum, position: [B, Hkv, C]; length: [B, Hkv]; keep, sinks, recent,
    target_from: ints, or [B] int64 tensors (each batch row its own budget and split: ``d2o_evict_one_ragged``).
    ``protect`` > 0: the nearest key is sought outside the floor(protect * keep) live slots other than e of
    highest ``col_sum`` (``unprotected``); a row with none left is not valid (evicts without a merge)."""
    b, h, c, d = k.shape
    j = torch.arange(c, device=k.device)
    live = j < length[..., None]
    evict = length > _rows(keep, b, 1)                                     # [B, Hkv]
    if isinstance(keep, int):
        newest = position[..., c - 1:]                                     # [B, Hkv, 1]
    else:
        newest = position.gather(2, newest_slot(length, evict, c)[..., None])
    cand = live & (j >= _rows(sinks, b, 2)) & (position <= newest - _rows(recent, b, 2))
    prio = torch.where(cand, col_sum.double(), float("inf"))
    e = torch.where(evict, prio.argmin(-1), c - 1)[..., None]              # [B, Hkv, 1]
    flat_e = (e + torch.arange(b * h, device=e.device).view(b, h, 1) * c).reshape(-1)
    k_e = k.reshape(b * h * c, d).index_select(0, flat_e).view(b, h, 1, d)
    v_e = v.reshape(b * h * c, d).index_select(0, flat_e).view(b, h, 1, d)
    # one source row per (b, g): the plain torch matcher (one [1, C] product) beats a kernel launch
    others = live & (j != e)
    targets = others & (j >= _rows(target_from, b, 2))
    if protect > 0:
        targets = targets & unprotected(col_sum, others, protected_count(protect, keep))
    nearest, u_star = cosine_match_reference(k_e, k, targets)                               # [B, Hkv, 1]
    valid = evict[..., None] & (nearest >= 0) if protect > 0 else evict[..., None]
    return OneEviction(e, valid, k_e, v_e, nearest.clamp(min=0), torch.where(valid, u_star, 0.0))


def ema_threshold(u_star: Tensor, valid: Tensor, prev: Tensor, was_set: Tensor, beta: float
                  ) -> tuple[Tensor, Tensor]:
    """§5.6 step 2 per batch row: (tau [B] fp32, tau_set [B] bool) from u_star, valid [B, ...]
    (the best similarities of this step's evictions) and the previous tau, tau_set [B]."""
    has = valid.flatten(1).any(-1)                                         # [B]
    current = u_star.flatten(1).sum(-1) / valid.flatten(1).sum(-1).clamp(min=1)
    ema = beta * current + (1 - beta) * prev
    return torch.where(has, torch.where(was_set, ema, current), prev), was_set | has


def every_head(heads: HeadGroup, u_star: Tensor, valid: Tensor, dim: int = 1) -> tuple[Tensor, Tensor]:
    """(u_star, valid) [B, Hkv, E] of every KV head of the layer from this rank's [B, Hkv / N, E] (the heads along
    ``dim``: [L, B, Hkv] for L layers at once), in one all-gather (the two stacked as fp32: valid is 0 or 1,
    exact); the inputs as they are in one process."""
    if heads.world == 1:
        return u_star, valid
    both = heads.gather(torch.stack((u_star.float(), valid.float())), dim=dim + 1)
    return both[0], both[1] > 0


def merge_weights(u_star: Tensor, valid: Tensor, tau: Tensor, variant: str, min_cos: float = NO_FLOOR
                  ) -> tuple[Tensor, Tensor, float]:
    """(merged [B, Hkv, E] bool, w_e [B, Hkv, E] fp32, w_self) of §5.6 steps 3-4; u_star, valid
    [B, Hkv, E] (E evicted entries per row), tau [B]. ``min_cos``: an entry merges only where its own
    u >= min_cos as well (the merge guard's floor)."""
    floor = u_star >= min_cos
    if variant == "paper":
        merged = valid & (u_star >= tau[:, None, None]) & floor
        return merged, torch.where(merged, u_star.exp(), 0.0), math.e
    per_slot = u_star.sum(1) / valid.sum(1).clamp(min=1)                   # [B, E] mean over heads
    merged = valid & (per_slot >= tau[:, None])[:, None, :] & floor
    return merged, torch.where(merged, u_star, 0.0), 1.0


def threshold_and_merge(heads: HeadGroup, u_star: Tensor, valid: Tensor, prev: Tensor, was_set: Tensor, beta: float,
                        variant: str, min_cos: float) -> tuple[Tensor, Tensor, Tensor, Tensor, float]:
    """§5.6 steps 2-4 of a layer's evictions u_star, valid [B, Hkv / N, E] (this rank's heads), from the previous
    threshold ``prev``, ``was_set`` [B]: (tau, tau_set [B], the EMA over every rank's heads (``every_head``: one
    all-gather); merged, w_e [B, Hkv / N, E] contiguous, this rank's part; w_self), as one process decides them."""
    u_all, valid_all = every_head(heads, u_star, valid)
    tau, tau_set = ema_threshold(u_all, valid_all, prev, was_set, beta)
    merged, w_e, w_self = merge_weights(u_all, valid_all, tau, variant, min_cos)
    return tau, tau_set, heads.local(merged).contiguous(), heads.local(w_e).contiguous(), w_self


def threshold_and_merge_in_place(heads: HeadGroup, u_star: Tensor, valid: Tensor, tau: Tensor, tau_set: Tensor,
                                 beta: float, variant: str, min_cos: float) -> tuple[Tensor, Tensor, float]:
    """``threshold_and_merge`` with the layer's threshold state ``tau``, ``tau_set`` [B] read and written in place
    (the decode step's buffers): (merged, w_e, w_self)."""
    new_tau, new_set, merged, w_e, w_self = threshold_and_merge(heads, u_star, valid, tau, tau_set, beta, variant,
                                                                min_cos)
    tau.copy_(new_tau)
    tau_set.copy_(new_set)
    return merged, w_e, w_self


def merged_log_weight(into: Tensor, src: Tensor) -> Tensor:
    """log(exp(into) + exp(src)) in fp32, written out (max + log of the sum of shifted exps) so that the
    Triton kernel computes the same expression: the log-size of an entry that absorbed another."""
    m = torch.maximum(into, src)
    return m + torch.log(torch.exp(into - m) + torch.exp(src - m))


def merged_rows(into: Tensor, src: Tensor, merged: Tensor, w_e: Tensor, w_self: float, variant: str) -> Tensor:
    """(w_self * into + w_e * src) / norm where ``merged``, else ``into`` (§5.6 step 4, one evicted
    entry per row; norm = w_self + w_e ("paper") or w_self + 1 ("code")). into, src: [B, Hkv, 1, D];
    merged, w_e: [B, Hkv, 1]."""
    norm = w_self + (w_e if variant == "paper" else merged.float())
    new = (w_self * into.float() + w_e[..., None] * src.float()) / norm[..., None]
    return torch.where(merged[..., None], new.to(into.dtype), into)


def score_merged_rows(into: Tensor, src: Tensor, merged: Tensor, w_into: Tensor, w_e: Tensor) -> Tensor:
    """(w_into * into + w_e * src) / (w_into + w_e) where ``merged``, else ``into`` (the score weighting: each
    entry's weight its score + SCORE_EPS; one evicted entry per row). into, src: [B, Hkv, 1, D]; merged,
    w_into, w_e: [B, Hkv, 1]."""
    new = (w_into[..., None] * into.float() + w_e[..., None] * src.float()) / (w_into + w_e)[..., None]
    return torch.where(merged[..., None], new.to(into.dtype), into)


def next_candidates(col_sum: Tensor, position: Tensor, length: Tensor, e: Tensor, keep: int, sinks: int, recent: int,
                    m: int) -> Tensor:
    """[B, Hkv, m] int64: the m lowest-``col_sum`` entries the next step may evict (after this step's eviction of
    e [B, Hkv, 1] in a full row, before its moves: one more position has left the recent window, and the newest
    entry, slot C - 1, is named as e, where it moves), -1 for none and for rows that evict nothing. Which of equal
    scores are named is unspecified: only the set's lowest scores are defined."""
    b, h, c = col_sum.shape
    j = torch.arange(c, device=col_sum.device)
    evict = length > keep
    newest = position[..., c - 1:]
    ok = (j < length[..., None]) & (j >= sinks) & (position <= newest + 1 - recent) & (j != e) & evict[..., None]
    low = torch.where(ok, col_sum.double(), float("inf")).topk(min(m, c), dim=-1, largest=False)
    slot = torch.where(low.indices == c - 1, e, low.indices)
    picked = torch.where(low.values < float("inf"), slot, -1)
    return torch.nn.functional.pad(picked, (0, m - picked.shape[-1]), value=-1)


def d2o_evict_one_reference(k: Tensor, v: Tensor, col_sum: Tensor, position: Tensor, log_weight: Tensor,
                            length: Tensor, tau: Tensor, tau_set: Tensor, others: list[Tensor], nearest: list[Tensor],
                            keep: int, sinks: int, recent: int, beta: float, variant: str, min_cos: float = NO_FLOOR,
                            target_from: int = 0, bias: bool = False) -> None:
    """The in-place step in plain torch (the op's definition; CPU and export). O(C) reads of the
    scores and keys of a row, writes of two slots per row (index_select / index_copy_).

    ``nearest``: [] or the layer's six tensors of kvpass/kernels/decode_attention_nearest.py (next, from,
    inv_norm, cand, best, slot): the step also names the next step's candidates (``next_candidates``) and the
    first target slot. The decode attention's results for this step's candidates (cand, best, slot) are what the
    scan would find, so the reference scans (and keeps no norms: its attention reads none); the Triton step takes
    them where e is among the candidates, and keeps inv_norm for its attention."""
    if nearest:
        e = pick_one(k, v, col_sum, position, length, keep, sinks, recent, target_from).e
        nxt = next_candidates(col_sum, position, length, e, keep, sinks, recent, nearest[0].shape[-1])
    evict_one_in_place(k, v, col_sum, position, log_weight, length, tau, tau_set, others, keep, sinks, recent,
                       target_from, beta, variant, min_cos, bias)
    if nearest:
        nearest[0].copy_(nxt)
        nearest[1].fill_(target_from)


def evict_one_in_place(k: Tensor, v: Tensor, col_sum: Tensor, position: Tensor, log_weight: Tensor,
                       length: Tensor, tau: Tensor, tau_set: Tensor, others: list[Tensor], keep: int | Tensor,
                       sinks: int | Tensor, recent: int | Tensor, target_from: int | Tensor, beta: float,
                       variant: str, min_cos: float, bias: bool, protect: float = 0.0,
                       score_weights: bool = False, heads: HeadGroup = SINGLE_PROCESS) -> None:
    """Both references: one ``keep`` for every row (ints: an evicting row is full, its newest entry in slot
    C - 1) or one per batch row ([B] int64 tensors, ``d2o_evict_one_ragged``: the newest entry of an
    evicting row in slot length - 1; a row that evicts nothing is left as it is, even full).

    ``protect`` (a fraction in [0, 1)) and ``score_weights``: D2O's merge_protect and merge_weighting="score"
    (the module docstring), which no Triton kernel has; per batch row with its own keep, computed on the
    device (sort, scatter, gather, where: nothing synchronises, a CUDA graph captures it).

    ``heads``: the layer's KV heads under tensor parallelism (k, v, ... hold this rank's Hkv / N): the
    threshold and the "code" merge decision, statistics over every head of the layer, are computed from
    every rank's evictions (one all-gather, ``every_head``), so each rank decides as one process does."""
    b, h, c, d = k.shape
    evict = length > _rows(keep, b, 1)                                     # [B, Hkv]
    pick = pick_one(k, v, col_sum, position, length, keep, sinks, recent, target_from, protect)
    merged, w_e, w_self = threshold_and_merge_in_place(heads, pick.u_star, pick.valid, tau, tau_set, beta, variant,
                                                       min_cos)                            # [B, Hkv, 1]
    ragged = not isinstance(keep, int)
    row0 = torch.arange(b * h, device=k.device).view(b, h, 1) * c
    last = newest_slot(length, evict, c)[..., None] if ragged else c - 1
    flat_n, flat_e = (pick.nearest + row0).reshape(-1), (pick.e + row0).reshape(-1)
    flat_last = (row0 + last).reshape(-1)
    if score_weights:                                  # the two entries' scores, before anything moves
        score = col_sum.float()
        w_e = torch.where(merged, torch.gather(score, 2, pick.e) + SCORE_EPS, 0.0)
        w_into = torch.gather(score, 2, pick.nearest) + SCORE_EPS
    for buf, src in ((k, pick.k_e), (v, pick.v_e)):
        rows = buf.view(b * h * c, d)
        into = rows.index_select(0, flat_n).view(b, h, 1, d)
        new = (score_merged_rows(into, src, merged, w_into, w_e) if score_weights
               else merged_rows(into, src, merged, w_e, w_self, variant))
        rows.index_copy_(0, flat_n, new.view(b * h, d))
    if bias:                                           # before the move: nearest may be the newest entry
        lw = log_weight.view(-1)
        into, src = lw.index_select(0, flat_n), lw.index_select(0, flat_e)
        lw.index_copy_(0, flat_n, torch.where(merged.reshape(-1), merged_log_weight(into, src), into))
    # the newest entry (slot last) moves into the evicted slot; a row that evicted nothing has
    # e = last = c - 1, so the move is of that slot onto itself
    for t in (k, v, log_weight, position, col_sum, *others):
        rows = t.view(b * h * c, *t.shape[3:])
        rows.index_copy_(0, flat_e, rows.index_select(0, flat_last))
    for t, empty in ((log_weight, EMPTY), (position, -1), (col_sum, 0), *((m, 0) for m in others)):
        if not ragged:                                 # one keep: slot c - 1 of a row that evicts nothing is empty
            t[:, :, c - 1] = empty
            continue
        rows = t.view(b * h * c, *t.shape[3:])         # a row of its own keep may be full and evict nothing
        gone = evict.reshape(-1, *([1] * (t.dim() - 3)))
        rows.index_copy_(0, flat_last, torch.where(gone, empty, rows.index_select(0, flat_last)))
    length.sub_(evict.long())


# --------------------------------------------------------------------------------------- Triton
# Three kernels; the first two split every row's C slots into chunks [s CHUNK, (s + 1) CHUNK), one
# program a (row = b Hkv + g, split s), so a row's scans run side by side (B Hkv programs alone would
# leave most SMs idle at B = 1). n = length if length > keep else 0 (a row that evicts nothing scans nothing).
# RAGGED: keep, sinks, recent and target_from are row b's, loaded from [B] tensors; else the same for all.
# last = n - 1 if the row evicts, else C - 1: the newest entry's slot (C - 1 with one keep: the row is full).
# Kernel A, the candidates of the chunk:
#     newest = position[last]           (the entry this step wrote)
#     low[row, s], arg[row, s] = first (min, argmin) over j < n of the chunk of
#              (col_sum[j] if j >= sinks and position[j] <= newest - recent else inf)     (arg = s CHUNK if none)
#     fp32 comparisons give the order of the reference's fp64 ones (an exact cast)
# Kernel B, the nearest key in the chunk:
#     e      = arg[row, first argmin_s low[row, s]]   (C - 1 if n = 0)
#     xn     = k_e / max(|k_e|, eps)
#     over j < n of the chunk, j != e, j >= target_from:  s_j = xn . k_j / max(|k_j|, eps)
#     best[row, s], nearest[row, s] = running (max, first argmax); a later block wins only if greater
# With ``nearest`` (M candidates): where e is one the attention searched for, split 0 takes its (best, slot)
# and the newest entry's s_{n-1} if greater (the attention left it out), and no split scans; a scanning split
# writes inv_norm[j] = 1 / max(|k_j|, eps) of its keys; split 0 names the next step's candidates.
# Split s = 0 writes e. In ACC (fp32; fp64 for fp64 keys) with IEEE sqrt and division, as the reference's
# F.normalize; k_j's norm divides the dot product, not each of its D elements first (the reference's
# order), and the dot's summation order is not torch's: last-bit differences.

@triton.jit
def _unit(x, norm_sq, eps, F64: tl.constexpr):
    """x / max(sqrt(norm_sq), eps) with IEEE sqrt and division (fp32's defaults on CUDA are approximate)."""
    if F64:
        return x / tl.maximum(tl.sqrt(norm_sq), eps)
    else:
        return tl.div_rn(x, tl.maximum(tl.sqrt_rn(norm_sq), eps))


@triton.jit
def _row_scan_bounds(LENGTH, row, split, CHUNK, KEEP):
    """(evict, n, lo, hi): whether the row evicts, its live slots to scan and the split's chunk [lo, hi)."""
    length = tl.load(LENGTH + row)
    evict = length > KEEP
    n = tl.where(evict, length, 0)
    lo = split * CHUNK
    return evict, n, lo, tl.minimum(lo + CHUNK, n)


@triton.jit
def _of_row(SCALAR, ROWS, b, RAGGED: tl.constexpr):
    """ROWS[b] (a [B] int64 tensor: each batch row its own value) if RAGGED, else SCALAR (every row's)."""
    if RAGGED:
        return tl.load(ROWS + b)
    else:
        return SCALAR


# The row lengths, budget and splits are plain integers, not specialised on (Triton would compile again for
# each new divisibility by 16, and these change with every budget: a new max_new_tokens, a new layer budget).
_LENGTHS = ("C", "CHUNK", "KEEP", "SPLITS")


@triton.jit
def _lowest_into(score, c0, vals, slots, NPICK: tl.constexpr, BLOCK_SCAN: tl.constexpr, BLOCK_K: tl.constexpr):
    """The running NPICK lowest (vals, slots) [BLOCK_K] (inf, -1: none yet) with the NPICK lowest of ``score``
    [BLOCK_SCAN] of slots c0.. (inf: not a candidate) put in: each pick replaces the list's largest if lower."""
    offs_k = tl.arange(0, BLOCK_K)
    lanes = tl.arange(0, BLOCK_SCAN)
    for _ in tl.static_range(NPICK):
        low = tl.min(score, 0)
        at = tl.argmin(score, 0)
        held = tl.where(offs_k < NPICK, vals, float("-inf"))
        take = (offs_k == tl.argmax(held, 0)) & (held > low)          # the largest held, where low is lower
        vals = tl.where(take, low, vals)
        slots = tl.where(take, c0 + at.to(tl.int64), slots)
        score = tl.where(lanes == at, float("inf"), score)
    return vals, slots


@triton.jit(do_not_specialize=(*_LENGTHS, "SINKS", "RECENT", "HKV"))
def _candidate_kernel(
    COL, POS, LENGTH, LOW, ARG, NXV, NXS, C, CHUNK, KEEP, SINKS, RECENT, SPLITS, HKV, KEEPS, SINKSS, RECENTS,
    BLOCK_SCAN: tl.constexpr, RAGGED: tl.constexpr, NPICK: tl.constexpr, BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    b = (row // HKV).to(tl.int64)
    base = row.to(tl.int64) * C                          # COL, POS: contiguous [B Hkv, C]
    evict, n, lo, hi = _row_scan_bounds(LENGTH, row, split, CHUNK, _of_row(KEEP, KEEPS, b, RAGGED))
    sinks = _of_row(SINKS, SINKSS, b, RAGGED)
    recent = _of_row(RECENT, RECENTS, b, RAGGED)
    newest = tl.load(POS + base + tl.where(evict, n - 1, C - 1))
    low = tl.full([], float("inf"), tl.float32)
    e = lo.to(tl.int64)
    next_vals = tl.full([BLOCK_K], float("inf"), tl.float32)
    next_slots = tl.full([BLOCK_K], -1, tl.int64)
    for c0 in range(lo, hi, BLOCK_SCAN):
        offs = c0 + tl.arange(0, BLOCK_SCAN)
        m = offs < hi
        pos = tl.load(POS + base + offs, mask=m, other=-1)
        col = tl.load(COL + base + offs, mask=m, other=0.0)
        score = tl.where(m & (offs >= sinks) & (pos <= newest - recent), col, float("inf"))
        blk_low = tl.min(score, 0)
        blk_e = tl.argmin(score, 0).to(tl.int64) + c0
        e = tl.where(blk_low < low, blk_e, e)
        low = tl.minimum(blk_low, low)
        if NPICK > 0:                 # the next step's candidates: one more position leaves the recent window
            nxt = tl.where(m & (offs >= sinks) & (pos <= newest + 1 - recent), col, float("inf"))
            next_vals, next_slots = _lowest_into(nxt, c0, next_vals, next_slots, NPICK, BLOCK_SCAN, BLOCK_K)
    out = row.to(tl.int64) * SPLITS + split
    tl.store(LOW + out, low)
    tl.store(ARG + out, e)
    if NPICK > 0:
        offs_k = tl.arange(0, BLOCK_K)
        tl.store(NXV + out * BLOCK_K + offs_k, next_vals)
        tl.store(NXS + out * BLOCK_K + offs_k, next_slots)


@triton.jit(do_not_specialize=(*_LENGTHS, "TARGET_FROM"))
def _nearest_key_kernel(
    K, LENGTH, LOW, ARG, E, BEST, NEAREST, NXV, NXS, NEXT, FROM, NEAR_CAND, NEAR_BEST, NEAR_SLOT, INV_NORM,
    skb, skh, skc, skd,
    HKV, C, CHUNK, KEEP, SPLITS, TARGET_FROM, KEEPS, TARGETS,
    HEAD_DIM: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr, ACC: tl.constexpr, F64: tl.constexpr, RAGGED: tl.constexpr,
    M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    b = (row // HKV).to(tl.int64)
    g = (row % HKV).to(tl.int64)
    evict, n, lo, hi = _row_scan_bounds(LENGTH, row, split, CHUNK, _of_row(KEEP, KEEPS, b, RAGGED))
    target_from = _of_row(TARGET_FROM, TARGETS, b, RAGGED)
    offs_s = tl.arange(0, BLOCK_SPLITS)
    parts = row.to(tl.int64) * SPLITS + offs_s
    low = tl.load(LOW + parts, mask=offs_s < SPLITS, other=float("inf"))
    arg = tl.load(ARG + parts, mask=offs_s < SPLITS, other=0)
    first = tl.argmin(low, 0, tie_break_left=True)
    e = tl.where(evict, tl.sum(tl.where(offs_s == first, arg, 0), 0), C - 1)
    if M > 0:                          # e's nearest key from the decode attention, where e was its candidate
        offs_r = tl.arange(0, M)
        hit = evict & (tl.load(NEAR_CAND + row.to(tl.int64) * M + offs_r) == e)
        known = tl.max(hit.to(tl.int32), 0) > 0
        hi = tl.where(known, lo, hi)                                # then nothing to scan
        at = tl.argmax(hit.to(tl.int32), 0)
        known_best = tl.sum(tl.where(offs_r == at, tl.load(NEAR_BEST + row.to(tl.int64) * M + offs_r), 0.0), 0)
        known_slot = tl.sum(tl.where(offs_r == at, tl.load(NEAR_SLOT + row.to(tl.int64) * M + offs_r), 0), 0)
        if split == 0:
            _next_candidates(NXV, NXS, NEXT, FROM, row, e, n - 1, target_from, SPLITS, M, BLOCK_SPLITS, BLOCK_K)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    k_row = K + b * skb + g * skh
    eps = tl.full([], 1e-12, ACC)
    x = tl.load(k_row + e * skc + offs_d * skd, mask=d_mask, other=0.0).to(ACC)
    x = _unit(x, tl.sum(x * x, 0), eps, F64)
    best = tl.full([], float("-inf"), ACC)
    nearest = tl.full([], 0, tl.int64)
    for c0 in range(lo, hi, BLOCK_C):
        offs = c0 + tl.arange(0, BLOCK_C)
        m = offs < hi
        y = tl.load(k_row + offs[:, None] * skc + offs_d[None, :] * skd, mask=m[:, None] & d_mask[None, :],
                    other=0.0).to(ACC)
        norm_sq = tl.sum(y * y, 1)
        s = _unit(tl.sum(x[None, :] * y, 1), norm_sq, eps, F64)                # one division a key, not D
        s = tl.where(m & (offs != e) & (offs >= target_from), s, float("-inf"))
        if M > 0:                      # the row's norms, for the next step's attention
            inv = _unit(tl.full([BLOCK_C], 1.0, ACC), norm_sq, eps, F64)
            tl.store(INV_NORM + row.to(tl.int64) * C + offs, inv.to(tl.float32), mask=m)
        blk_best = tl.max(s, 0)
        blk_j = tl.argmax(s, 0).to(tl.int64) + c0
        nearest = tl.where(blk_best > best, blk_j, nearest)
        best = tl.maximum(blk_best, best)
    if M > 0:                          # the attention left out the newest entry (its norm unknown): e against it
        newest = tl.maximum(n - 1, 0)
        y = tl.load(k_row + newest * skc + offs_d * skd, mask=d_mask, other=0.0).to(ACC)
        s_new = _unit(tl.sum(x * y, 0), tl.sum(y * y, 0), eps, F64)
        newer = known & (newest != e) & (newest >= target_from) & (s_new > known_best.to(ACC))
        known_best = tl.where(newer, s_new, known_best.to(ACC))
        known_slot = tl.where(newer, newest.to(tl.int64), known_slot)
        best = tl.where(known & (split == 0), known_best, best)
        nearest = tl.where(known & (split == 0), known_slot, nearest)
    out = row.to(tl.int64) * SPLITS + split
    tl.store(BEST + out, best)
    tl.store(NEAREST + out, nearest)
    tl.store(E + row, e, mask=split == 0)


@triton.jit
def _next_candidates(NXV, NXS, NEXT, FROM, row, e, last, target_from, SPLITS, M: tl.constexpr,
                     BLOCK_SPLITS: tl.constexpr, BLOCK_K: tl.constexpr):
    """The next step's M candidates of ``row`` from kernel A's lists: the M lowest other than e (slot ``last``,
    the newest entry, named as e, where kernel C moves it; -1 for none), and the row's first target slot."""
    offs = tl.arange(0, BLOCK_SPLITS * BLOCK_K)
    flat = row.to(tl.int64) * SPLITS * BLOCK_K + offs
    ok = offs < SPLITS * BLOCK_K
    slots = tl.load(NXS + flat, mask=ok, other=-1)
    vals = tl.where(ok & (slots >= 0) & (slots != e), tl.load(NXV + flat, mask=ok, other=float("inf")), float("inf"))
    offs_r = tl.arange(0, M)
    picked = tl.full([M], -1, tl.int64)
    for r in tl.static_range(M):
        low = tl.min(vals, 0)
        at = tl.argmin(vals, 0)
        slot = tl.sum(tl.where(offs == at, slots, 0), 0)
        slot = tl.where(slot == last, e, slot)
        picked = tl.where(offs_r == r, tl.where(low < float("inf"), slot, -1), picked)
        vals = tl.where(offs == at, float("inf"), vals)
    tl.store(NEXT + row.to(tl.int64) * M + offs_r, picked)
    tl.store(FROM + row, target_from)


# Kernel C, program b over its heads g (vectors of BLOCK_H):
#     nearest_g, u_g = first max over the splits of (best, nearest) (an earlier split wins ties)
#     ev_g = length_g > keep;  last_g = length_g - 1 if ev_g else C - 1;  u_g = 0 unless ev_g;  n = sum_g ev_g
#     current = sum_g u_g / max(n, 1);  tau, tau_set as in the module docstring (beta, 1 - beta fp32)
#     merged_g, w_e, norm per the variant, and u_g >= min_cos;  per block of D:
#         new  = (w_self k[nearest_g] + w_e k[e_g]) / norm   (fp32, IEEE division, no FMA contraction,
#                                                            as torch's separate elementwise kernels)
#         k[nearest_g] <- new where merged_g;  k[e_g] <- (new if merged_g and nearest_g = last_g else
#                                                         k[last_g]) where ev_g          (v likewise)
#     BIAS: lw[nearest_g] <- max + log(exp(lw_n - max) + exp(lw_e - max)) where merged_g (before the move)
#     slot e_g <- slot last_g's col_sum, position, log_weight; slot last_g <- empty; length_g -= 1 (where ev_g)
# All loads of a block come before its stores (with a barrier), so no program reads what it writes.
# SHARDED (tensor parallelism, this rank holds Hkv of the layer's H_ALL heads): current and n come from every
# rank's u_g and ev_g (U_ALL, EV_ALL [B, H_ALL], gathered between kernels B and C), summed over a vector of
# BLOCK_H_ALL = next_pow2(H_ALL) lanes as one process sums its BLOCK_H: the same tau, bit for bit.
# NORMS (``nearest`` given: the decode attention's search reads them): inv_norm[nearest_g] <- 1 / max(|k|, eps) of
# the merged row where merged_g, inv_norm[e_g] <- that of the row now in e_g, inv_norm[last_g] <- NaN (emptied: the
# next step writes there, and its attention leaves the slot out), each where ev_g, in that order.

@triton.jit
def _update_threshold(TAU, TAU_SET, b, current, n_evict, beta, one_minus_beta):
    """Batch row b's EMA threshold after n_evict evictions of mean best similarity ``current`` (``ema_threshold``):
    stored in TAU, TAU_SET and returned."""
    prev = tl.load(TAU + b)
    was_set = tl.load(TAU_SET + b) != 0
    tau = tl.where(n_evict > 0, tl.where(was_set, beta * current + one_minus_beta * prev, current), prev)
    tl.store(TAU + b, tau)
    tl.store(TAU_SET + b, (was_set | (n_evict > 0)).to(tl.uint8))
    return tau


@triton.jit
def _merge_and_move(X, batch_off, head_off, sc, sd, e, nearest, evict, merged, take_new, w_e, norm, w_self, last,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Kernel C's K (or V) part for the BLOCK_H heads of one batch row (see the comment above it)."""
    offs_d = tl.arange(0, BLOCK_D)
    for d0 in range(0, HEAD_DIM, BLOCK_D):
        d_mask = (d0 + offs_d) < HEAD_DIM
        head = X + batch_off + head_off[:, None] + (d0 + offs_d)[None, :] * sd
        m_ev = evict[:, None] & d_mask[None, :]
        m_merge = merged[:, None] & d_mask[None, :]
        src = tl.load(head + e[:, None] * sc, mask=m_ev, other=0.0)
        newest = tl.load(head + last[:, None] * sc, mask=m_ev, other=0.0)
        into = tl.load(head + nearest[:, None] * sc, mask=m_merge, other=0.0)
        new = tl.div_rn(w_self * into.to(tl.float32) + w_e[:, None] * src.to(tl.float32), norm[:, None])
        new = new.to(X.dtype.element_ty)
        tl.debug_barrier()
        tl.store(head + nearest[:, None] * sc, new, mask=m_merge)
        tl.store(head + e[:, None] * sc, tl.where(take_new[:, None], new, newest), mask=m_ev)


@triton.jit
def _inverse_norms(X, batch_off, head_off, sc, sd, slot, mask, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_H: tl.constexpr):
    """1 / max(|x|, eps) of each head's row ``slot`` [BLOCK_H] (fp32, IEEE sqrt and division)."""
    offs_d = tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_H], tl.float32)
    for d0 in range(0, HEAD_DIM, BLOCK_D):
        d_mask = (d0 + offs_d) < HEAD_DIM
        x = tl.load(X + batch_off + head_off[:, None] + slot[:, None] * sc + (d0 + offs_d)[None, :] * sd,
                    mask=mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(x * x, 1)
    return tl.div_rn(1.0, tl.maximum(tl.sqrt_rn(acc), 1e-12))


@triton.jit(do_not_specialize=("C", "KEEP", "SPLITS"))
def _merge_move_kernel(
    K, V, COL, POS, LW, LENGTH, TAU, TAU_SET, E, BEST, NEAREST, U_ALL, EV_ALL, INV_NORM,
    skb, skh, skc, skd, svb, svh, svc, svd,
    HKV, C, KEEP, SPLITS, beta, one_minus_beta, w_self, min_cos, KEEPS, H_ALL,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr, ACC: tl.constexpr, PAPER: tl.constexpr, BIAS: tl.constexpr, RAGGED: tl.constexpr,
    SHARDED: tl.constexpr, BLOCK_H_ALL: tl.constexpr, NORMS: tl.constexpr = False,
):
    b = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H).to(tl.int64)
    h_mask = offs_h < HKV
    rows = b * HKV + offs_h
    length = tl.load(LENGTH + rows, mask=h_mask, other=0)
    evict = h_mask & (length > _of_row(KEEP, KEEPS, b, RAGGED))
    last = tl.where(evict, length - 1, C - 1)            # the newest entry's slot (C - 1: nothing moves)
    offs_s = tl.arange(0, BLOCK_SPLITS)
    parts = rows[:, None] * SPLITS + offs_s[None, :]                       # [BLOCK_H, BLOCK_SPLITS], one load
    m_parts = h_mask[:, None] & (offs_s < SPLITS)[None, :]
    part = tl.load(BEST + parts, mask=m_parts, other=float("-inf"))
    first = tl.argmax(part, 1, tie_break_left=True)
    best = tl.max(part, 1)
    nearest = tl.sum(tl.where(offs_s[None, :] == first[:, None], tl.load(NEAREST + parts, mask=m_parts, other=0), 0), 1)
    u = tl.where(evict, best.to(tl.float32), 0.0)
    e = tl.load(E + rows, mask=h_mask, other=0)
    if SHARDED:                      # every rank's heads of row b (u of each, 0 where it does not evict)
        offs_a = tl.arange(0, BLOCK_H_ALL)
        a_mask = offs_a < H_ALL
        u_all = tl.load(U_ALL + b * H_ALL + offs_a, mask=a_mask, other=0.0)
        n_evict = tl.sum((tl.load(EV_ALL + b * H_ALL + offs_a, mask=a_mask, other=0) != 0).to(tl.int32), 0)
        current = tl.div_rn(tl.sum(u_all, 0), tl.maximum(n_evict, 1).to(tl.float32))
    else:
        n_evict = tl.sum(evict.to(tl.int32), 0)
        current = tl.div_rn(tl.sum(u, 0), tl.maximum(n_evict, 1).to(tl.float32))
    tau = _update_threshold(TAU, TAU_SET, b, current, n_evict, beta, one_minus_beta)
    floor = u >= min_cos
    if PAPER:
        merged = evict & (u >= tau) & floor
        w_e = tl.where(merged, tl.exp(u), 0.0)
        norm = w_self + w_e
    else:
        merged = evict & ((tl.zeros([BLOCK_H], tl.float32) + current) >= tau) & floor   # one decision for all heads
        w_e = tl.where(merged, u, 0.0)
        norm = w_self + merged.to(tl.float32)
    take_new = merged & (nearest == last)
    _merge_and_move(K, b * skb, offs_h * skh, skc, skd, e, nearest, evict, merged, take_new, w_e, norm, w_self, last,
                    HEAD_DIM, BLOCK_D)
    _merge_and_move(V, b * svb, offs_h * svh, svc, svd, e, nearest, evict, merged, take_new, w_e, norm, w_self, last,
                    HEAD_DIM, BLOCK_D)
    if NORMS:                        # the changed slots' norms; the emptied slot's unknown (the next write's)
        tl.debug_barrier()
        inv_n = _inverse_norms(K, b * skb, offs_h * skh, skc, skd, nearest, merged, HEAD_DIM, BLOCK_D, BLOCK_H)
        inv_e = _inverse_norms(K, b * skb, offs_h * skh, skc, skd, e, evict, HEAD_DIM, BLOCK_D, BLOCK_H)
        tl.store(INV_NORM + rows * C + nearest, inv_n, mask=merged)
        tl.store(INV_NORM + rows * C + e, inv_e, mask=evict)
        tl.store(INV_NORM + rows * C + last, tl.full([BLOCK_H], float("nan"), tl.float32), mask=evict)
    slot_e = rows * C + e
    slot_last = rows * C + last
    is_last = e == last                                   # recent = 0 can evict the newest entry itself
    col = tl.load(COL + slot_last, mask=evict, other=0.0)
    pos = tl.load(POS + slot_last, mask=evict, other=-1)
    lw = tl.load(LW + slot_last, mask=evict, other=float("-inf"))
    if BIAS:                                 # the merged entry's log-size; moved with it if it is the newest
        slot_n = rows * C + nearest
        lw_n = tl.load(LW + slot_n, mask=merged, other=0.0)
        lw_e = tl.load(LW + slot_e, mask=merged, other=0.0)
        top = tl.maximum(lw_n, lw_e)
        lw_new = top + tl.log(tl.exp(lw_n - top) + tl.exp(lw_e - top))
        lw = tl.where(take_new, lw_new, lw)
    tl.debug_barrier()
    if BIAS:
        tl.store(LW + slot_n, lw_new, mask=merged)
    tl.store(COL + slot_e, tl.where(is_last, 0.0, col), mask=evict)
    tl.store(POS + slot_e, tl.where(is_last, -1, pos), mask=evict)
    tl.store(LW + slot_e, tl.where(is_last, float("-inf"), lw), mask=evict)
    tl.store(COL + slot_last, tl.zeros([BLOCK_H], tl.float32), mask=evict)
    tl.store(POS + slot_last, tl.full([BLOCK_H], -1, tl.int64), mask=evict)
    tl.store(LW + slot_last, tl.full([BLOCK_H], float("-inf"), tl.float32), mask=evict)
    tl.store(LENGTH + rows, length - 1, mask=evict)


def check_evict_one_inputs(k: Tensor, v: Tensor, col_sum: Tensor, position: Tensor, log_weight: Tensor,
                           length: Tensor, tau: Tensor, tau_set: Tensor, others: list[Tensor], keep: int,
                           sinks: int, recent: int, variant: str, target_from: int = 0) -> None:
    """ValueError naming the tensor, the expected and the actual shape/dtype (or the bad split of keep)."""
    check_layer_tensors(k, v)
    c = k.shape[2]
    if c != keep + 1 or keep < 1:
        raise ValueError(f"capacity C must be keep + 1 with keep >= 1, got C = {c}, keep = {keep}")
    if sinks < 0 or recent < 0 or sinks + recent > keep:        # else an evicting row could have no candidate
        raise ValueError(f"sinks ({sinks}) + recent ({recent}) must be at most keep ({keep}), both >= 0")
    if not 0 <= target_from < keep:                       # else an evicting row could have no merge target
        raise ValueError(f"target_from must lie in [0, keep = {keep}), got {target_from}")
    check_layer_metadata(k, v, col_sum, position, log_weight, length, tau, tau_set, others, variant)


def check_layer_tensors(k: Tensor, v: Tensor) -> None:
    """ValueError unless k, v are one float [B, Hkv, C, D] shape and dtype."""
    if k.dim() != 4 or v.shape != k.shape or v.dtype != k.dtype or not k.dtype.is_floating_point:
        raise ValueError(f"k, v must be one float [B, Hkv, C, D] shape, got {k.dtype} {tuple(k.shape)}, "
                         f"{v.dtype} {tuple(v.shape)}")


def check_layer_metadata(k: Tensor, v: Tensor, col_sum: Tensor, position: Tensor, log_weight: Tensor,
                         length: Tensor, tau: Tensor, tau_set: Tensor, others: list[Tensor], variant: str) -> None:
    """ValueError naming the tensor where the variant, or a metadata tensor's dtype, shape, layout or
    device, is not what the step takes."""
    b, h, c, _ = k.shape
    if variant not in ("paper", "code"):
        raise ValueError(f"variant must be 'paper' or 'code', got {variant!r}")
    for name, t, dtype, shape in (("col_sum", col_sum, torch.float32, (b, h, c)),
                                  ("position", position, torch.int64, (b, h, c)),
                                  ("log_weight", log_weight, torch.float32, (b, h, c)),
                                  ("length", length, torch.int64, (b, h)), ("tau", tau, torch.float32, (b,)),
                                  ("tau_set", tau_set, torch.bool, (b,))):
        if t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous {dtype} {shape}, got {t.dtype} {tuple(t.shape)}")
    for name, t in (("col_sum", col_sum), ("position", position), ("log_weight", log_weight), ("length", length),
                    ("tau", tau), ("tau_set", tau_set), ("v", v)):       # devices after shapes: same errors anywhere
        check_device(name, t, k.device)
    for t in others:
        check_device("others", t, k.device)
        if tuple(t.shape[:3]) != (b, h, c):
            raise ValueError(f"other slot metadata must be [B, Hkv, C, ...] = {(b, h, c)}, got {tuple(t.shape)}")


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def default_splits(rows: int, c: int, device: torch.device) -> int:
    """Splits per row: up to eight programs per SM, at least 128 slots per split (the sweep's best at
    B = 1 and 4: many short programs, as each program's scan is a chain of dependent loads)."""
    if device.type != "cuda":
        return 1
    return max(1, min(triton.cdiv(8 * _sm_count(device.index or 0), rows), triton.cdiv(c, 128)))


# The step is latency-bound (one layer's row is a few thousand slots): short, wide programs. Kernel A reads
# up to BLOCK_SCAN slots an iteration (one iteration for a chunk of C / splits <= 1024 slots), kernel B 32
# keys; these and the splits are what benchmarks/probes/d2o_evict_one_sweep.py compares on a GPU (H200,
# C = 6555: 23.6 us a layer at B = 1 and 54 at B = 4, from 26.8 and 85.5 with 64-key blocks and 2 programs
# an SM; the two-kernel version before: 32.2 at B = 1).
def d2o_evict_one_triton(k: Tensor, v: Tensor, col_sum: Tensor, position: Tensor, log_weight: Tensor,
                         length: Tensor, tau: Tensor, tau_set: Tensor, others: list[Tensor], nearest: list[Tensor],
                         keep: int, sinks: int, recent: int, beta: float, variant: str, min_cos: float = NO_FLOOR,
                         target_from: int = 0, bias: bool = False, *, splits: int | None = None,
                         block_c: int = 32, block_scan: int = 1024, num_warps: int = 8,
                         heads: HeadGroup = SINGLE_PROCESS) -> None:
    """The three Triton kernels (same contract as ``d2o_evict_one_reference``; with ``heads``, as
    ``evict_one_in_place``'s: the threshold over every rank's heads); scratch: 5 tensors of B Hkv (splits)
    elements, and with ``nearest`` the candidate lists, 2 of B Hkv splits 8."""
    run_layers([d2o_evict_one_steps(k, v, col_sum, position, log_weight, length, tau, tau_set, others, nearest, keep,
                                    sinks, recent, beta, variant, min_cos, target_from, bias, splits=splits,
                                    block_c=block_c, block_scan=block_scan, num_warps=num_warps, heads=heads)], heads)


def d2o_evict_one_steps(k: Tensor, v: Tensor, col_sum: Tensor, position: Tensor, log_weight: Tensor,
                        length: Tensor, tau: Tensor, tau_set: Tensor, others: list[Tensor], nearest: list[Tensor],
                        keep: int, sinks: int, recent: int, beta: float, variant: str, min_cos: float = NO_FLOOR,
                        target_from: int = 0, bias: bool = False, *, splits: int | None = None,
                        block_c: int = 32, block_scan: int = 1024, num_warps: int = 8,
                        heads: HeadGroup = SINGLE_PROCESS) -> Generator[Gathered, Gathered, None]:
    """``d2o_evict_one_triton``'s checked inputs as ``evict_one_steps`` (one layer of ``run_layers``)."""
    require_triton()
    check_evict_one_inputs(k, v, col_sum, position, log_weight, length, tau, tau_set, others, keep, sinks, recent,
                           variant, target_from)
    check_nearest_state(k, nearest)
    return evict_one_steps(k, v, col_sum, position, log_weight, length, tau, tau_set, others,
                           (keep, sinks, recent, target_from), None, beta, variant, min_cos, bias, splits, block_c,
                           block_scan, num_warps, heads, nearest)


def check_nearest_state(k: Tensor, nearest: list[Tensor]) -> None:
    """ValueError unless ``nearest`` is [] or the six tensors of ``NEAREST_INPUTS`` for k's [B, Hkv, C] rows (the
    decode attention's own check of them, ``check_nearest_inputs``)."""
    if not nearest:
        return
    if len(nearest) != len(NEAREST_INPUTS):
        raise ValueError(f"nearest must be [] or the {len(NEAREST_INPUTS)} tensors {NEAREST_INPUTS}, got "
                         f"{len(nearest)}")
    check_nearest_inputs(k, *nearest, op="d2o_evict_one")


Gathered = tuple[Tensor, Tensor] | None          # every rank's (u, ev) [B, H_ALL] of one layer; None in one process


def run_layers(steps: list[Generator[Gathered, Gathered, None]], heads: HeadGroup) -> None:
    """Several layers' ``evict_one_steps`` (each on checked inputs): kernels A and B of every layer, then, under
    tensor parallelism, one all-gather of every layer's per-head (u, ev) (layers of one [B, Hkv] stacked; one
    gather per shape), then kernel C and the moves of every layer. The gathered values are those of each
    layer's own gather, so each layer ends as it does alone; the ranks' collectives come in one order as long
    as every rank passes its layers in one order."""
    wanted = [next(step) for step in steps]
    got: list[Gathered] = [None] * len(steps)
    if heads.world > 1:
        by_shape: dict[tuple, list[int]] = {}
        for i, (u, _) in enumerate(wanted):
            by_shape.setdefault(tuple(u.shape), []).append(i)
        for members in by_shape.values():
            u_all, ev_all = every_head(heads, torch.stack([wanted[i][0] for i in members]),
                                       torch.stack([wanted[i][1] for i in members]), dim=2)     # [L, B, H_ALL]
            for j, i in enumerate(members):
                got[i] = (u_all[j].contiguous(), ev_all[j].contiguous().view(torch.uint8))
    for step, gathered in zip(steps, got, strict=True):
        try:
            step.send(gathered)
        except StopIteration:
            continue
        raise RuntimeError("evict_one_steps yielded twice")


def evict_one_steps(k: Tensor, v: Tensor, col_sum: Tensor, position: Tensor, log_weight: Tensor, length: Tensor,
                    tau: Tensor, tau_set: Tensor, others: list[Tensor], split: tuple[int, int, int, int],
                    row_split: tuple[Tensor, Tensor, Tensor, Tensor] | None, beta: float, variant: str,
                    min_cos: float, bias: bool, splits: int | None, block_c: int, block_scan: int,
                    num_warps: int, heads: HeadGroup = SINGLE_PROCESS, nearest: list[Tensor] | None = None
                    ) -> Generator[Gathered, Gathered, None]:
    """Kernels A, B, C on checked inputs, in two halves for ``run_layers``: launches kernels A and B, yields
    this rank's (u [B, Hkv] fp32: each head's best similarity where it evicts, else 0; ev [B, Hkv] bool: whether
    it evicts) under tensor parallelism (None in one process), takes back every rank's (u, ev as uint8)
    [B, H_ALL], whose sum kernel C's threshold takes as one process does, then launches kernel C and moves the
    other metadata. ``split``: (keep, sinks, recent, target_from) of every row; ``row_split``: the same as [B]
    int64 tensors, one value per batch row (``d2o_evict_one_ragged``; then ``split`` is ignored), or None.
    ``nearest``: the layer's (next, from, cand, best, slot) of kvpass/kernels/decode_attention_nearest.py, or None:
    kernel A also lists each split's lowest entries for the next step, kernel B takes e's nearest key from the
    decode attention where e was one of its candidates (else it scans) and names the next step's candidates; below
    ``FUSE_FROM_BATCH`` rows (``fuses_at``) as None, since the attention searched nothing there."""
    b, h, c, d = k.shape
    keep, sinks, recent, target_from = split
    ragged = row_split is not None
    keeps, sinkss, recents, targets = row_split if ragged else (length,) * 4      # not read unless ragged
    splits = splits or default_splits(b * h, c, k.device)
    chunk = triton.cdiv(c, splits)
    acc = torch.float64 if k.dtype == torch.float64 else torch.float32
    e = torch.empty(b * h, dtype=torch.int64, device=k.device)
    low = torch.empty(b * h * splits, dtype=torch.float32, device=k.device)
    arg = torch.empty(b * h * splits, dtype=torch.int64, device=k.device)
    best = torch.empty(b * h * splits, dtype=acc, device=k.device)
    nearest_slot = torch.empty(b * h * splits, dtype=torch.int64, device=k.device)
    if others:                                                        # before kernel C shortens rows
        evict = length > (keeps[:, None] if ragged else keep)
        last = newest_slot(length, evict, c) if ragged else c - 1
    block_d = max(16, next_pow2(d))
    tl_acc = tl.float64 if acc == torch.float64 else tl.float32
    if not fuses_at(b):                      # the attention searched nothing: name nothing, keep no norms
        nearest = None
    m = nearest[0].shape[-1] if nearest else 0
    block_k = next_pow2(m + 1) if m else 1
    nx_val = torch.empty(b * h * splits * block_k if m else 1, dtype=torch.float32, device=k.device)
    nx_slot = torch.empty(nx_val.numel(), dtype=torch.int64, device=k.device)
    nxt, c_from, inv_norm, n_cand, n_best, n_slot = nearest if nearest else (e, e, low, e, low, e)  # unread
    _candidate_kernel[(b * h, splits)](
        col_sum, position, length, low, arg, nx_val, nx_slot, c, chunk, keep, sinks, recent, splits, h, keeps, sinkss,
        recents, BLOCK_SCAN=min(block_scan, next_pow2(chunk)), RAGGED=ragged, NPICK=m + 1 if m else 0, BLOCK_K=block_k,
        num_warps=4)
    _nearest_key_kernel[(b * h, splits)](
        k, length, low, arg, e, best, nearest_slot, nx_val, nx_slot, nxt, c_from, n_cand, n_best, n_slot, inv_norm,
        *k.stride(), h, c, chunk, keep, splits, target_from, keeps, targets,
        HEAD_DIM=d, BLOCK_C=block_c, BLOCK_D=block_d, BLOCK_SPLITS=next_pow2(splits),
        ACC=tl_acc, F64=acc == torch.float64, RAGGED=ragged, M=m, BLOCK_K=block_k, num_warps=num_warps)
    mine: Gathered = None
    if heads.world > 1:                                 # what kernel C computes per head, for every rank's
        ev = length > (keeps[:, None] if ragged else keep)                                    # [B, Hkv]
        mine = (torch.where(ev, best.view(b, h, splits).amax(-1).float(), 0.0), ev)
    every = yield mine                                  # every rank's, from run_layers' all-gather
    u_all, ev_all = every if every is not None else (best, e)        # not read unless sharded
    _merge_move_kernel[(b,)](
        k, v, col_sum, position, log_weight, length, tau, tau_set.view(torch.uint8), e, best, nearest_slot, u_all, ev_all,
        inv_norm, *k.stride(), *v.stride(), h, c, keep, splits, float(beta), 1.0 - float(beta),
        math.e if variant == "paper" else 1.0, float(min_cos), keeps, h * heads.world,
        HEAD_DIM=d, BLOCK_H=next_pow2(h), BLOCK_D=min(block_d, 128),
        BLOCK_SPLITS=next_pow2(splits), ACC=tl_acc, PAPER=variant == "paper", BIAS=bool(bias), RAGGED=ragged,
        SHARDED=heads.world > 1, BLOCK_H_ALL=next_pow2(h * heads.world), NORMS=m > 0, num_warps=4,
        enable_fp_fusion=False)
    if others:                                       # a row that evicts nothing has e = last = C - 1: no move
        row0 = torch.arange(b * h, device=k.device) * c
        flat_e, flat_last = e + row0, (row0 + last.view(-1)) if ragged else row0 + c - 1
        for t in others:
            rows = t.view(b * h * c, *t.shape[3:])
            rows.index_copy_(0, flat_e, rows.index_select(0, flat_last))
            gone = evict.view(b * h, *([1] * (t.dim() - 3)))
            rows.index_copy_(0, flat_last, torch.where(gone, 0, rows.index_select(0, flat_last)))


@torch.library.custom_op("kvpass::d2o_evict_one", mutates_args=(
    "k", "v", "col_sum", "position", "log_weight", "length", "tau", "tau_set", "others", "nearest"))
def d2o_evict_one(k: Tensor, v: Tensor, col_sum: Tensor, position: Tensor, log_weight: Tensor, length: Tensor,
                  tau: Tensor, tau_set: Tensor, others: list[Tensor], nearest: list[Tensor], keep: int, sinks: int,
                  recent: int, beta: float, variant: str, min_cos: float = NO_FLOOR, target_from: int = 0,
                  bias: bool = False) -> None:
    d2o_evict_one_reference(k, v, col_sum, position, log_weight, length, tau, tau_set, others, nearest, keep, sinks,
                            recent, beta, variant, min_cos, target_from, bias)


@d2o_evict_one.register_fake
def _(k, v, col_sum, position, log_weight, length, tau, tau_set, others, nearest, keep, sinks, recent, beta, variant,
      min_cos=NO_FLOOR, target_from=0, bias=False):
    return None


if HAS_TRITON:
    @d2o_evict_one.register_kernel("cuda")
    def _(k, v, col_sum, position, log_weight, length, tau, tau_set, others, nearest, keep, sinks, recent, beta,
          variant, min_cos=NO_FLOOR, target_from=0, bias=False):
        d2o_evict_one_triton(k, v, col_sum, position, log_weight, length, tau, tau_set, others, nearest, keep, sinks,
                             recent, beta, variant, min_cos, target_from, bias)
