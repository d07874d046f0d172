"""The Triton kernels of D2O's one-in-one-out decode step (``evict_one.py`` launches them; docs/policies.md §5.8).

Per (b, g) row holding more than keep entries: e = the lowest ``col_sum`` outside the sinks and the recent window
(ties: the lowest slot), its most cosine-similar other live key at a slot >= target_from, the EMA threshold over
the batch row's evicting heads, the merge ("paper" or "code", the cosine floor min_cos, merge_bias's log-sizes),
then the newest entry (slot length - 1) moves into slot e and length -= 1. What it must equal:
``kvpass.policies.d2o.reference.compress_reference`` at capacity keep + 1 (tests/policies/d2o/).
"""

from __future__ import annotations

from kvpass.kernels._triton import tl, triton

# The first two kernels split every row's C slots into chunks [s CHUNK, (s + 1) CHUNK), one
# program a (row = b Hkv + g, split s), so a row's scans run side by side (B Hkv programs alone would
# leave most SMs idle at B = 1). n = length if length > keep else 0 (a row that evicts nothing scans nothing).
# keep, sinks, recent and target_from are batch row b's, loaded from SPLIT [5, B] (rows 0, 2, 3, 4).
# last = n - 1 if the row evicts, else C - 1: the newest entry's slot (the one this decode step wrote).
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


# The row lengths, budget and splits are plain integers, not specialised on (Triton would compile again for
# each new divisibility by 16, and these change with every budget: a new max_new_tokens, a new layer budget).
_LENGTHS = ("C", "CHUNK", "SPLITS")


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


@triton.jit(do_not_specialize=(*_LENGTHS, "HKV", "B"))
def _candidate_kernel(
    COL, POS, LENGTH, LOW, ARG, NXV, NXS, SPLIT, C, CHUNK, SPLITS, HKV, B,
    BLOCK_SCAN: tl.constexpr, NPICK: tl.constexpr, BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    b = (row // HKV).to(tl.int64)
    base = row.to(tl.int64) * C                          # COL, POS: contiguous [B Hkv, C]
    evict, n, lo, hi = _row_scan_bounds(LENGTH, row, split, CHUNK, tl.load(SPLIT + b))
    sinks = tl.load(SPLIT + 2 * B + b)
    recent = tl.load(SPLIT + 3 * B + b)
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


@triton.jit(do_not_specialize=(*_LENGTHS, "HKV", "B"))
def _nearest_key_kernel(
    K, LENGTH, LOW, ARG, E, BEST, NEAREST, NXV, NXS, NEXT, FROM, NEAR_CAND, NEAR_BEST, NEAR_SLOT, INV_NORM, SPLIT,
    skb, skh, skc, skd,
    HKV, C, CHUNK, SPLITS, B,
    HEAD_DIM: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr, ACC: tl.constexpr, F64: tl.constexpr, M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    b = (row // HKV).to(tl.int64)
    g = (row % HKV).to(tl.int64)
    evict, n, lo, hi = _row_scan_bounds(LENGTH, row, split, CHUNK, tl.load(SPLIT + b))
    target_from = tl.load(SPLIT + 4 * B + b)
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


@triton.jit(do_not_specialize=("C", "SPLITS"))
def _merge_move_kernel(
    K, V, COL, POS, LW, LENGTH, TAU, TAU_SET, E, BEST, NEAREST, U_ALL, EV_ALL, INV_NORM, SPLIT,
    skb, skh, skc, skd, svb, svh, svc, svd,
    HKV, C, SPLITS, beta, one_minus_beta, w_self, min_cos, H_ALL,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr, ACC: tl.constexpr, PAPER: tl.constexpr, BIAS: tl.constexpr,
    SHARDED: tl.constexpr, BLOCK_H_ALL: tl.constexpr, NORMS: tl.constexpr = False,
):
    b = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H).to(tl.int64)
    h_mask = offs_h < HKV
    rows = b * HKV + offs_h
    length = tl.load(LENGTH + rows, mask=h_mask, other=0)
    evict = h_mask & (length > tl.load(SPLIT + b))
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
