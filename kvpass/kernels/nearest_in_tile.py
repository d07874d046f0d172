"""The nearest-key search that rides in ``decode_attention``'s query tile (``kvpass::decode_attention_nearest``):
its Triton helpers, inlined into the split and merge kernels of kvpass/kernels/decode_attention.py."""

from __future__ import annotations

from kvpass.kernels._triton import tl, triton

# Nearest keys of candidate slots (``decode_attention_nearest``: D2O's next eviction, docs/policies.md §5.5). For
# each of the NCAND candidate slots c_r of KV row (b, g) (-1: none), over the live slots j of the split (log-weight
# > -inf) with a known norm (inv_j = 1 / max(|k_j|, eps) stored per slot; NaN: not known, the newest entry), j != c_r,
# j >= from[b, g]:
#     cos_rj = (k_c . k_j) inv_j / max(|k_c|, eps)                     (eps = 1e-12; fp32)
#     best_r, slot_r = the max over the split and its lowest slot
# k_c rides in row G*T + r of the query tile (rows G*T.. are otherwise zero padding), so the tile's one dot gives
# k_c . k_j beside q . k_j and K is read once for both. Each lane of the [BM, BN] tile keeps its own running
# (max, slot) (a later tile wins only if greater; a NaN never does), reduced once after the loop: no reduction per
# tile. The merge launch combines the splits (an earlier split wins ties), so slot_r is the lowest slot of the
# maximum, as a scan of the whole row finds it.

@triton.jit
def _candidate_rows(CAND, FROM, k_base, pid_bg, offs_m, offs_d, d_mask, skc, skd, GT, NCAND: tl.constexpr):
    """Per query-tile row m: the candidate slot of row m (rows GT..GT+NCAND-1; -1 elsewhere or for none), its key
    (zeros where none), the key's norm max(|k_c|, eps) and the split's first target slot from[b, g]."""
    r = offs_m - GT
    is_c = (offs_m >= GT) & (r < NCAND)
    cand = tl.load(CAND + pid_bg.to(tl.int64) * NCAND + tl.where(is_c, r, 0), mask=is_c, other=-1)
    kc = tl.load(k_base + cand[:, None] * skc + offs_d[None, :] * skd, mask=(cand >= 0)[:, None] & d_mask[None, :],
                 other=0.0)
    c32 = kc.to(tl.float32)
    c_norm = tl.maximum(tl.sqrt_rn(tl.sum(c32 * c32, 1)), 1e-12)
    return cand, kc, c_norm, tl.load(FROM + pid_bg)


@triton.jit
def _nearest_in_tile(raw, inv_k, lw, offs_n, cand, c_from, lane_best, lane_slot):
    """Every lane's running (best, slot) after the tile of slots offs_n: raw = the tile's dot products [BM, BN],
    inv_k [BN] the keys' stored inverse norms (NaN: unknown), lw their log-weights (-inf: empty or past the cache)."""
    col = tl.where((lw > float("-inf")) & (offs_n >= c_from), 0.0, float("-inf"))
    cos = raw * inv_k[None, :] + col[None, :]
    n32 = offs_n.to(tl.int32)
    cos = tl.where(n32[None, :] == cand.to(tl.int32)[:, None], float("-inf"), cos)
    better = cos > lane_best
    return tl.where(better, cos, lane_best), tl.where(better, n32[None, :], lane_slot)


@triton.jit
def _combine_nearest(CAND, PBEST, PARG, NEAR_CAND, NEAR_BEST, NEAR_SLOT, pid_bg, NUM_SPLITS,
                     NCAND: tl.constexpr, BLOCK_SC: tl.constexpr):
    """Row (b, g)'s candidates over its splits: the first maximum (an earlier split wins ties) and its slot."""
    offs_s = tl.arange(0, BLOCK_SC)
    offs_r = tl.arange(0, NCAND)
    parts = (pid_bg.to(tl.int64) * NUM_SPLITS + offs_s)[:, None] * NCAND + offs_r[None, :]
    m = (offs_s < NUM_SPLITS)[:, None]
    part = tl.load(PBEST + parts, mask=m, other=float("-inf"))
    first = tl.argmax(part, 0, tie_break_left=True)
    slot = tl.sum(tl.where(offs_s[:, None] == first[None, :], tl.load(PARG + parts, mask=m, other=0), 0), 0)
    out = pid_bg.to(tl.int64) * NCAND + offs_r
    tl.store(NEAR_BEST + out, tl.max(part, 0))
    tl.store(NEAR_SLOT + out, slot)
    tl.store(NEAR_CAND + out, tl.load(CAND + out))

@triton.jit
def _store_nearest(PBEST, PARG, NEAR_CAND, NEAR_BEST, NEAR_SLOT, lane_best, lane_slot, cand, c_norm, offs_m, pid_bg,
                   pid_s, NUM_SPLITS, GT, NCAND: tl.constexpr, DIRECT: tl.constexpr):
    """The split's (best, slot) of each candidate from the lanes' running maxima: the results where one split
    covers the row (DIRECT), else the split's part for the merge launch (``_combine_nearest``)."""
    top = tl.max(lane_best, 1)
    c_best = tl.where(cand >= 0, top / c_norm, float("-inf"))
    first = tl.min(tl.where(lane_best == top[:, None], lane_slot, 2147483647), 1)
    c_arg = tl.where(top > float("-inf"), first, 0).to(tl.int64)
    r = offs_m - GT                                          # candidate r's row
    is_c = (offs_m >= GT) & (r < NCAND)
    if DIRECT:
        out = pid_bg.to(tl.int64) * NCAND + r
        tl.store(NEAR_CAND + out, cand, mask=is_c)
        tl.store(NEAR_BEST + out, c_best, mask=is_c)
        tl.store(NEAR_SLOT + out, c_arg, mask=is_c)
    else:
        out = (pid_bg.to(tl.int64) * NUM_SPLITS + pid_s) * NCAND + r
        tl.store(PBEST + out, c_best, mask=is_c)
        tl.store(PARG + out, c_arg, mask=is_c)
