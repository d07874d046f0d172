"""The plain-torch reference of D2O's compression (docs/policies.md §5.5-5.6): what every form defines itself by.

``compress_reference`` compresses one layer to ``keep`` live entries per (b, g) row, for any capacity and number
of evictions (the prompt's, a decode step's one, an interval's m) and every option, as a pure function: the kept
entries in sequence order, each evicted entry merged into its most cosine-similar allowed kept key (or, with chains,
a later evicted one) under the EMA threshold. ``compress_rows_reference``: per-row budgets, each due row as alone.
The fast forms (``in_place.py``; the Triton ops ``kvpass::d2o_evict_one``, ``kvpass::d2o_evict_many``; the fused
nearest-key search of ``kvpass::decode_attention_nearest``) must hold the same entries as sets (tests/policies/d2o/).
The runtime's prefill compression is this function itself; it synchronises with nothing and exports.
"""

from __future__ import annotations

import torch
from torch import Tensor

import kvpass.kernels  # noqa: F401  (registers torch.ops.kvpass)
from kvpass.cache import LayerCache, gather_slots, keep_slots
from kvpass.head_group import SINGLE_PROCESS, HeadGroup
from kvpass.kernels.cosine_match import cosine_match_reference
from kvpass.policies.d2o.chains import chain_similarities, chain_window, fold_chains, put
from kvpass.policies.d2o.merge import SCORE_EPS, StepOptions, averaged, threshold_and_merge, unprotected
from kvpass.policies.selection import kept_slots, ordered_slots, select_kept

TAU, TAU_SET = "d2o_tau", "d2o_tau_set"     # LayerCache.state: the EMA threshold [B] fp32, initialised [B] bool


def threshold_state(cache: LayerCache) -> tuple[Tensor, Tensor]:
    """The layer's (tau, tau_set) [B], made (unset) where the cache has none yet."""
    b, device = cache.k.shape[0], cache.k.device
    for name, dtype in ((TAU, torch.float32), (TAU_SET, torch.bool)):
        if name not in cache.state:
            cache.state[name] = torch.zeros(b, dtype=dtype, device=device)
    return cache.state[TAU], cache.state[TAU_SET]


def compress_reference(cache: LayerCache, score: str, keep: int, sinks: int, recent: int, target_from: int,
                       opts: StepOptions, heads: HeadGroup = SINGLE_PROCESS) -> LayerCache:
    """cache: k, v [B, Hkv, C, D] in sequence order, ``slot_meta[score]`` [B, Hkv, C] fp32 the eviction's ranking.
    Returns capacity min(keep, C): per row the sinks, the ``recent`` newest and the top-scored rest, merged; the
    threshold state (``TAU``, ``TAU_SET``) updated in new tensors. ``target_from``: the first slot that may absorb
    (``sinks`` for merge_into_sinks=False). ``heads``: the threshold over every rank's heads (tensor parallel)."""
    rank = cache.slot_meta[score]
    kept = select_kept(rank, cache.length, keep, sinks, recent)
    out = keep_slots(cache, kept_slots(kept, keep))
    n_evicted = cache.capacity - out.capacity          # a static upper bound: no device sync
    if n_evicted <= 0:
        return out
    b, device = cache.k.shape[0], cache.k.device
    tau = cache.state[TAU].clone() if TAU in cache.state else torch.zeros(b, device=device)
    tau_set = cache.state[TAU_SET].clone() if TAU_SET in cache.state else torch.zeros(b, dtype=torch.bool,
                                                                                        device=device)
    out.state[TAU], out.state[TAU_SET] = tau, tau_set
    evicted = cache.live & ~kept
    e_idx = ordered_slots(evicted, n_evicted)                                  # [B, Hkv, E], ascending
    valid = torch.gather(evicted, 2, e_idx)
    k_e, v_e = gather_slots(cache.k, e_idx), gather_slots(cache.v, e_idx)
    match = torch.ops.kvpass.cosine_match if k_e.is_cuda else cosine_match_reference    # CPU, export: plain torch
    targets = out.live & (torch.arange(out.capacity, device=out.k.device) >= target_from)
    if opts.protect > 0:
        targets = targets & unprotected(out.slot_meta[score], out.live, int(opts.protect * keep))
    nearest, u = match(k_e, out.k, targets)                                    # [B, Hkv, E]
    matched = valid & (nearest >= 0) if opts.protect > 0 else valid   # no target left: evicted without trace
    nearest = nearest.clamp(min=0)
    if opts.chains:                         # a later evicted entry may be the better target (chains.py)
        index, ok = chain_window(valid, opts.chains)
        k_w, v_w = gather_slots(k_e, index), gather_slots(v_e, index)
        u_m = torch.where(matched, u, float("-inf"))
        u_w, chained_w, parent = chain_similarities(k_w, ok & gather_slots(valid, index), gather_slots(u_m, index))
        u, chained = put(u_m, index, ok, u_w), put(torch.zeros_like(valid), index, ok, chained_w)
        matched = matched | chained
    u = torch.where(matched, u, 0.0)
    merged, w_e = threshold_and_merge(heads, u, matched, tau, tau_set, opts)
    w_self: float | Tensor = opts.w_self
    score_e = None
    if opts.score_weights:                  # each entry weighs its score + SCORE_EPS
        score_e = torch.gather(rank.float(), 2, e_idx) + SCORE_EPS
        w_e = torch.where(merged, score_e, 0.0)
    sizes = torch.gather(cache.log_weight, 2, e_idx).exp() if opts.bias else None
    if opts.chains:                         # the linked entries fold into their evicted parents, children first
        link = ok & gather_slots(chained & merged, index)
        k_w, v_w, s_w = fold_chains(k_w, v_w, parent, link, gather_slots(w_e, index),
                                    gather_slots(score_e, index) if opts.score_weights else w_self, opts.by_count,
                                    None if sizes is None else gather_slots(sizes, index))
        k_e, v_e = put(k_e, index, ok, k_w), put(v_e, index, ok, v_w)
        sizes = None if sizes is None else put(sizes, index, ok, s_w)
        merged, w_e = merged & ~chained, torch.where(chained, 0.0, w_e)
    if opts.score_weights:
        w_self = out.slot_meta[score].float()[..., None] + SCORE_EPS          # [B, Hkv, K, 1]
    if opts.bias:                           # sizes add: log_weight = log(sum of the members' sizes)
        size = out.log_weight.exp().scatter_add(2, nearest, torch.where(merged, sizes, 0.0))
        out.log_weight = torch.where(out.live, size.log(), out.log_weight)
    count, w_sum, (k_acc, v_acc) = sums_into(nearest, merged.float(), w_e, (k_e, v_e),
                                             (w_self * out.k.float(), w_self * out.v.float()))
    out.k = averaged(out.k, k_acc, w_self, w_sum[..., None], count[..., None], opts)
    out.v = averaged(out.v, v_acc, w_self, w_sum[..., None], count[..., None], opts)
    return out


def sums_into(nearest: Tensor, merged: Tensor, w_e: Tensor, srcs: tuple[Tensor, ...], accs: tuple[Tensor, ...]
              ) -> tuple[Tensor, Tensor, list[Tensor]]:
    """Per kept entry t: the count of ``merged`` over the evicted e with nearest[e] = t, the same sum of ``w_e``,
    and each acc plus the sum of w_e * src[e]. nearest, merged, w_e: [B, Hkv, E]; srcs [B, Hkv, E, D]; accs
    [B, Hkv, K, D] fp32. Scatter-adds at run time; under ``torch.export`` (ONNX) dense assignment matmuls
    A[e, t] = (nearest[e] == t), since TensorRT's core layers have no scatter-add (docs/deploy.md)."""
    capacity = accs[0].shape[2]
    if torch.compiler.is_exporting():
        assign = (nearest[..., None] == torch.arange(capacity, device=nearest.device)).float()   # [B, Hkv, E, K]
        weighted = assign * w_e[..., None]
        return ((assign * merged[..., None]).sum(2), weighted.sum(2),
                [acc + weighted.transpose(-1, -2) @ src.float() for src, acc in zip(srcs, accs, strict=True)])
    zeros = torch.zeros(*nearest.shape[:2], capacity, dtype=torch.float32, device=nearest.device)
    idx = nearest[..., None].expand(*nearest.shape, accs[0].shape[-1])
    return (zeros.scatter_add(2, nearest, merged), zeros.scatter_add(2, nearest, w_e),
            [acc.scatter_add(2, idx, w_e[..., None] * src.float()) for src, acc in zip(srcs, accs, strict=True)])
