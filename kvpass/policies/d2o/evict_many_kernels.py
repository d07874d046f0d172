"""The Triton kernels of ``kvpass::d2o_evict_many`` (``evict_many.py`` launches them; docs/policies.md §5.8)."""

from __future__ import annotations

from kvpass.kernels._triton import HAS_TRITON, tl, triton
from kvpass.policies.d2o.evict_one_kernels import _update_threshold

# The plain-torch step launches some 150 kernels a layer (0.58 ms a layer at B = 1, m = 64, graphed, on an H100;
# the 32k step compressing all 32 layers took 7 ms more than a plain one): these three take 0.11 ms at m = 16.
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


@triton.jit
def _forced_bounds(POS, base, n, sinks, recent, target_from, BLOCK: tl.constexpr, COUNT_BLOCK: tl.constexpr,
                   WAYS: tl.constexpr, RESIDENT: tl.constexpr):
    """(t_s, t_r, t_t) of kernel S: position thresholds splitting off the sinks, the recent window and the target
    floor (``#{position < t} = k``): first the guess that those positions run without a gap (what decoding
    leaves), checked in one pass; a search only where it fails."""
    lo = tl.full([], _BIG, tl.int64)
    hi = tl.full([], -1, tl.int64)
    for c0 in range(0, n, BLOCK):
        offs = c0 + tl.arange(0, BLOCK)
        pos = tl.load(POS + base + offs, mask=offs < n, other=-1)
        lo = tl.minimum(lo, tl.min(tl.where(offs < n, pos, _BIG), 0))
        hi = tl.maximum(hi, tl.max(pos, 0))
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
    return t_s, t_r, t_t


@triton.jit
def _select_evicted(SCORE, POS, KEYS, E_IDX, TARGETS, row, base, n, n_ev, t_s, t_r, t_t, C,
                    M: tl.constexpr, BLOCK: tl.constexpr, COUNT_BLOCK: tl.constexpr, WAYS: tl.constexpr,
                    RESIDENT: tl.constexpr):
    """Kernel S's eviction: the n_ev lowest keys among the candidates (ties: slot order) into E_IDX in slot order,
    the targets row written; returns n_ev (at most the candidates: callers keep sinks + recent <= keep)."""
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
    n_ev = tl.minimum(n_ev, n_cand)
    tl.debug_barrier()
    # T: the smallest key with #{key <= T} >= n_ev (never past k_hi; the others' keys, _KEY_NONE, lie above it)
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
    return n_ev


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
    n = tl.load(LENGTH + row)
    n_ev = tl.where((tl.max(lengths, 0) >= tl.load(SPLIT + B + b)) & (n > keep), tl.minimum(n - keep, M), 0)
    if n_ev > 0:
        t_s, t_r, t_t = _forced_bounds(POS, base, n, tl.load(SPLIT + 2 * B + b), tl.load(SPLIT + 3 * B + b),
                                       tl.load(SPLIT + 4 * B + b), BLOCK, COUNT_BLOCK, WAYS, RESIDENT)
        n_ev = _select_evicted(SCORE, POS, KEYS, E_IDX, TARGETS, row, base, n, n_ev, t_s, t_r, t_t, C, M, BLOCK,
                               COUNT_BLOCK, WAYS, RESIDENT)
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
