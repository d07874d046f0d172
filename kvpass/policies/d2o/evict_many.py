"""``kvpass::d2o_evict_many``: D2O's decode-time compression with ``interval`` m > 1, in the layer's own buffers.

The step of ``in_place.evict_in_place`` (the op's CPU kernel, and the CUDA one for merge_protect, score weights,
fp64 caches and tensor parallelism) as three Triton kernels plus the nearest-key search (``kvpass::cosine_match``)
and the merge chains (``chains.py``): each due row evicts its length - keep (at most m) lowest-scored entries
outside the sinks and the recent window (ties: the lowest slot), merges them and compacts its live entries into
slots [0, new length). ``split`` [5, B]: each batch row's (keep, due, sinks, recent, target_from). What it must
equal: ``reference.compress_reference`` for each due row (tests/policies/d2o/).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvpass.cache import gather_slots, put_slots
from kvpass.kernels import add_references
from kvpass.kernels._triton import HAS_TRITON, next_pow2, require_triton
from kvpass.kernels.cosine_match import cosine_match_reference
from kvpass.policies.d2o.chains import chain_similarities, fold_chains
from kvpass.policies.d2o.evict_many_kernels import _merge_compact_kernel, _select_kernel, _threshold_kernel
from kvpass.policies.d2o.evict_one import check_layer
from kvpass.policies.d2o.in_place import StepTensors, evict_in_place
from kvpass.policies.d2o.merge import StepOptions


def evict_many_triton(t: StepTensors, split: Tensor, m: int, opts: StepOptions, *, block: int = 4096,
                      count_block: int = 1024, ways: int = 16, resident_max: int = 8192, num_warps: int = 8) -> None:
    """The three kernels (the comments above them) for one process, without ``protect`` or ``score_weights``, for
    16/32-bit k, v. Scratch: O(B Hkv (m D + C)). Nothing synchronises with the host."""
    require_triton()
    check_layer(t, opts.variant, split)
    if t.k.dtype == torch.float64:
        raise ValueError("the Triton step takes 16/32-bit caches; fp64 ones take evict_in_place")
    k, v = t.k, t.v
    b, h, c, d = k.shape
    m = min(m, c)
    if m <= 0:
        return
    dev = k.device
    block_m, block_d, block_h = max(16, next_pow2(m)), min(64, max(16, next_pow2(d))), next_pow2(h)
    e_idx = torch.empty(b * h * m, dtype=torch.int64, device=dev)
    n_ev = torch.empty(b * h, dtype=torch.int64, device=dev)
    k_e, v_e = torch.empty(b, h, m, d, dtype=k.dtype, device=dev), torch.empty(b, h, m, d, dtype=v.dtype, device=dev)
    targets = torch.empty(b, h, c, dtype=torch.bool, device=dev)
    keys = torch.empty(b * h * c, dtype=torch.int32, device=dev)
    resident = next_pow2(c) <= resident_max                  # a row's keys fit the select kernel's registers
    _select_kernel[(b * h,)](
        k, v, t.score, t.position, t.length, split, e_idx, n_ev, k_e, v_e, targets.view(torch.int8), keys,
        *k.stride(), *v.stride(), b, h, c,
        M=m, HEAD_DIM=d, BLOCK=min(block, next_pow2(c)), BLOCK_H=block_h, BLOCK_M=block_m, BLOCK_D=block_d,
        COUNT_BLOCK=next_pow2(c) if resident else min(count_block, next_pow2(c)), WAYS=ways, RESIDENT=resident,
        num_warps=num_warps)
    match = torch.ops.kvpass.cosine_match if k.is_cuda else cosine_match_reference
    nearest, u = match(k_e, k, targets)                                      # [B, Hkv, m]
    valid = torch.arange(m, device=dev) < n_ev.view(b, h, 1)
    if opts.chains:                         # a later evicted entry may be the better target (chains.py)
        u, chained, parent = chain_similarities(k_e, valid, u)
    merged = torch.empty(b * h * m, dtype=torch.int8, device=dev)
    w_e = torch.empty(b * h * m, dtype=torch.float32, device=dev)
    _threshold_kernel[(b,)](
        u.contiguous(), n_ev, t.tau, t.tau_set.view(torch.uint8), merged, w_e, h, float(opts.beta),
        1.0 - float(opts.beta), float(opts.min_cos), M=m, BLOCK_H=block_h, BLOCK_M=block_m,
        PAPER=opts.variant == "paper", num_warps=4, enable_fp_fusion=False)
    if opts.chains:                         # fold the linked entries into their parents; they merge nowhere else
        e_slots = e_idx.view(b, h, m)
        lw_e = torch.gather(t.log_weight, 2, e_slots) if opts.bias else None
        k_f, v_f, sizes = fold_chains(k_e, v_e, parent, chained & (merged.view(b, h, m) != 0), w_e.view(b, h, m),
                                      opts.w_self, opts.by_count, None if lw_e is None else lw_e.exp())
        k_e.copy_(k_f)
        v_e.copy_(v_f)
        merged.masked_fill_(chained.view(-1), 0)
        if opts.bias:                       # the merge kernel reads the evicted entries' sizes from their slots
            t.log_weight.scatter_(2, e_slots, torch.where(valid, sizes.log(), lw_e))
    before = t.length.clone() if t.others else None
    move_dst = torch.empty(b * h, m, dtype=torch.int64, device=dev)
    move_src = torch.empty(b * h, m, dtype=torch.int64, device=dev)
    _merge_compact_kernel[(b * h,)](
        k, v, t.score, t.position, t.log_weight, t.length, e_idx, n_ev, k_e, v_e, nearest.contiguous(), merged, w_e,
        move_dst, move_src, *k.stride(), *v.stride(), h, c, opts.w_self,
        M=m, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_D=block_d, PAPER=opts.variant == "paper", BIAS=bool(opts.bias),
        num_warps=4, enable_fp_fusion=False)
    if t.others:                            # the kernel's (dst, src) pairs; unpaired: slot C - 1 onto itself
        dst, src = move_dst.view(b, h, m), move_src.view(b, h, m)
        j = torch.arange(c, device=dev)
        freed = (j >= t.length[..., None]) & (j < before[..., None])            # [B, Hkv, C]
        for x in t.others:
            put_slots(x, dst, gather_slots(x, src))
            x.masked_fill_(freed.view(*freed.shape, *([1] * (x.dim() - 3))), 0)


@torch.library.custom_op("kvpass::d2o_evict_many", mutates_args=(
    "k", "v", "score", "position", "log_weight", "length", "tau", "tau_set", "others"))
def d2o_evict_many(k: Tensor, v: Tensor, score: Tensor, position: Tensor, log_weight: Tensor, length: Tensor,
                   tau: Tensor, tau_set: Tensor, others: list[Tensor], split: Tensor, m: int, beta: float,
                   variant: str, min_cos: float, bias: bool = False, chains: int = 0) -> None:
    d2o_evict_many_reference(k, v, score, position, log_weight, length, tau, tau_set, others, split, m, beta,
                             variant, min_cos, bias, chains)


def d2o_evict_many_reference(k: Tensor, v: Tensor, score: Tensor, position: Tensor, log_weight: Tensor,
                             length: Tensor, tau: Tensor, tau_set: Tensor, others: list[Tensor], split: Tensor,
                             m: int, beta: float, variant: str, min_cos: float, bias: bool = False,
                             chains: int = 0) -> None:
    """The op's plain-torch definition: ``evict_in_place`` with each batch row's split."""
    keep, due, sinks, recent, target_from = split.unbind(0)
    evict_in_place(StepTensors(k, v, score, position, log_weight, length, tau, tau_set, others), keep, due, m, sinks,
                   recent, target_from, StepOptions(beta=beta, variant=variant, min_cos=min_cos, bias=bias, chains=chains))


@d2o_evict_many.register_fake
def _(k, v, score, position, log_weight, length, tau, tau_set, others, split, m, beta, variant, min_cos, bias=False,
      chains=0):
    return None


if HAS_TRITON:
    @d2o_evict_many.register_kernel("cuda")
    def _(k, v, score, position, log_weight, length, tau, tau_set, others, split, m, beta, variant, min_cos,
          bias=False, chains=0):
        evict_many_triton(StepTensors(k, v, score, position, log_weight, length, tau, tau_set, others), split, m,
                          StepOptions(beta=beta, variant=variant, min_cos=min_cos, bias=bias, chains=chains))

add_references({"d2o_evict_many": d2o_evict_many_reference})
