"""Weighted segment merge of cache entries into target slots (Chelsea §1.6, D2O, KVMerger, CaM).

For each (b, g), every slot i is either kept (target[i] = -1) or merged into the kept slot
j = target[i]. With sources I_j = {i : target[i] = j}:

    k'_j = (w_j k_j + sum_{i in I_j} w_i k_i) / (w_j + sum_{i in I_j} w_i)      (same for v)
    log_weight'_j = log(w_j + sum_{i in I_j} w_i)
    merged-away slots i (target[i] >= 0): k'_i = k_i, v'_i = v_i, log_weight'_i = -inf (empty)

so a kept slot with no sources keeps its K/V and gets log(w_j); a kept slot whose total weight is 0
keeps its K/V (and log_weight' = -inf). ``w`` is the merge weight of each slot (Chelsea: the
degree N = exp(log_weight); D2O: its similarity weights; an empty slot: 0). The caller then drops
the emptied slots with ``cache.keep_slots``, or passes ``place``, a permutation of each row's slots:
slot j's output row is written to row place[j] (Chelsea packs the live entries first, in order, in
the same pass). Precondition (not checked: it would synchronise): every target t >= 0 is < C and is
itself kept (target[t] = -1); place, where given, is a permutation of [0, C) in every row.

Shapes: k, v: [B, Hkv, C, D] (any float dtype); w: [B, Hkv, C] float32; target: [B, Hkv, C] int32 or
int64, -1 = keep; place: [B, Hkv, C] int64 or None (= the identity). Returns k', v' (dtype of k, v)
and log_weight' [B, Hkv, C] float32, each row j of them at place[j].
Traffic: reads 2*B*Hkv*C*D elements, writes the same; compute is negligible.

Triton path: a stable sort of the targets (torch) gives each kept slot its sources as one
contiguous segment of the sorted order, found by ``searchsorted``; one program per
(b, g, block of BLOCK_J target slots, block of D) gathers its segments' rows and reduces them in
registers. No atomics and no scatter: every output row is written by exactly one program, so the
result is deterministic.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvpass.kernels._triton import HAS_TRITON, check_device, next_pow2, require_triton, tl, triton


def merge_weighted_reference(k: Tensor, v: Tensor, w: Tensor, target: Tensor,
                             place: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    acc = torch.float64 if k.dtype == torch.float64 else torch.float32
    keep = target < 0
    dst = torch.where(keep, torch.arange(k.shape[2], device=k.device), target.long())   # a kept slot is its own target
    wf = w.to(acc)
    idx = dst[..., None].expand(*dst.shape, k.shape[-1])
    total = torch.zeros_like(wf).scatter_add_(2, dst, wf)
    ks = torch.zeros_like(k, dtype=acc).scatter_add_(2, idx, wf[..., None] * k.to(acc))
    vs = torch.zeros_like(v, dtype=acc).scatter_add_(2, idx, wf[..., None] * v.to(acc))
    ok = (keep & (total > 0))[..., None]
    denom = total.clamp(min=torch.finfo(acc).tiny)[..., None]
    k_out = torch.where(ok, ks / denom, k.to(acc)).to(k.dtype)
    v_out = torch.where(ok, vs / denom, v.to(acc)).to(v.dtype)
    log_weight = torch.where(keep, total.log(), float("-inf")).float()
    if place is None:
        return k_out, v_out, log_weight
    rows = place[..., None].expand_as(k_out)
    return (torch.empty_like(k_out).scatter_(2, rows, k_out), torch.empty_like(v_out).scatter_(2, rows, v_out),
            torch.empty_like(log_weight).scatter_(2, place, log_weight))


# --------------------------------------------------------------------------------------- Triton
# Program (b, g, block J of target slots, block of D). order: the slots sorted by target (stable,
# kept slots last since their key is C), so the sources of target j are order[seg_lo[j]:seg_hi[j]].
#     acc_j = w_j x_j + sum_{r < seg_hi[j] - seg_lo[j]} w_{order[seg_lo[j] + r]} x_{order[seg_lo[j] + r]}
#     tot_j = w_j + sum_r w_{...};   x'_j = acc_j / tot_j  (x_j if tot_j = 0);   lw'_j = log tot_j
# stored at row place[j] (j without PLACE). The loop runs to the longest segment of the block; shorter
# segments are masked.

@triton.jit
def _merge_weighted_kernel(
    K, V, W, TGT, ORDER, LO, HI, PLACE, KO, VO, LWO,
    skb, skh, skc, skd, svb, svh, svc, svd, sob, soh, soc, sod,
    HKV, C,
    HEAD_DIM: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_D: tl.constexpr, HAS_PLACE: tl.constexpr,
):
    pid_bg = tl.program_id(0)
    b = (pid_bg // HKV).to(tl.int64)
    g = pid_bg % HKV
    offs_j = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    j_mask = offs_j < C
    d_mask = offs_d < HEAD_DIM
    row = pid_bg.to(tl.int64) * C                       # W, TGT, ORDER, LO, HI, LWO are contiguous [B*Hkv, C]
    tgt = tl.load(TGT + row + offs_j, mask=j_mask, other=0)
    keep = tgt < 0
    w = tl.load(W + row + offs_j, mask=j_mask, other=0.0)
    lo = tl.load(LO + row + offs_j, mask=j_mask, other=0)
    hi = tl.load(HI + row + offs_j, mask=j_mask & keep, other=0)
    hi = tl.where(keep, hi, lo)                          # merged-away slots gather nothing
    mask2 = j_mask[:, None] & d_mask[None, :]
    k_self = tl.load(K + b * skb + g * skh + offs_j[:, None] * skc + offs_d[None, :] * skd, mask=mask2, other=0.0)
    v_self = tl.load(V + b * svb + g * svh + offs_j[:, None] * svc + offs_d[None, :] * svd, mask=mask2, other=0.0)
    k_acc = w[:, None] * k_self.to(tl.float32)
    v_acc = w[:, None] * v_self.to(tl.float32)
    tot = w
    seg_max = tl.max(hi - lo, 0).to(tl.int32)
    for r in range(0, seg_max):
        live = (lo + r) < hi
        src = tl.load(ORDER + row + lo + r, mask=live, other=0)
        ws = tl.load(W + row + src, mask=live, other=0.0)
        lmask = live[:, None] & d_mask[None, :]
        ks = tl.load(K + b * skb + g * skh + src[:, None] * skc + offs_d[None, :] * skd, mask=lmask, other=0.0)
        vs = tl.load(V + b * svb + g * svh + src[:, None] * svc + offs_d[None, :] * svd, mask=lmask, other=0.0)
        k_acc += ws[:, None] * ks.to(tl.float32)
        v_acc += ws[:, None] * vs.to(tl.float32)
        tot += ws
    ok = keep & (tot > 0.0)
    denom = tl.where(ok, tot, 1.0)[:, None]
    k_out = tl.where(ok[:, None], k_acc / denom, k_self.to(tl.float32))
    v_out = tl.where(ok[:, None], v_acc / denom, v_self.to(tl.float32))
    out_j = offs_j
    if HAS_PLACE:
        out_j = tl.load(PLACE + row + offs_j, mask=j_mask, other=0)
    o_off = b * sob + g * soh + out_j[:, None] * soc + offs_d[None, :] * sod
    tl.store(KO + o_off, k_out.to(KO.dtype.element_ty), mask=mask2)
    tl.store(VO + o_off, v_out.to(VO.dtype.element_ty), mask=mask2)
    if tl.program_id(2) == 0:
        lw = tl.where(keep & (tot > 0.0), tl.log(tl.where(tot > 0.0, tot, 1.0)), float("-inf"))
        tl.store(LWO + row + out_j, lw, mask=j_mask)


def check_merge_inputs(k: Tensor, v: Tensor, w: Tensor, target: Tensor, place: Tensor | None = None) -> None:
    """ValueError naming the tensor, the expected and the actual shape/dtype."""
    if k.dim() != 4:
        raise ValueError(f"k must be [B, Hkv, C, D], got shape {tuple(k.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if v.dtype != k.dtype or not k.dtype.is_floating_point:
        raise ValueError(f"k and v must share a floating dtype, got {k.dtype}, {v.dtype}")
    if tuple(w.shape) != tuple(k.shape[:3]) or w.dtype != torch.float32:
        raise ValueError(f"w must be float32 [B, Hkv, C] = {tuple(k.shape[:3])}, got {w.dtype} {tuple(w.shape)}")
    if tuple(target.shape) != tuple(k.shape[:3]) or target.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"target must be int32/int64 [B, Hkv, C] = {tuple(k.shape[:3])}, "
                         f"got {target.dtype} {tuple(target.shape)}")
    if place is not None and (tuple(place.shape) != tuple(k.shape[:3]) or place.dtype != torch.int64):
        raise ValueError(f"place must be int64 [B, Hkv, C] = {tuple(k.shape[:3])}, got {place.dtype} {tuple(place.shape)}")
    for name, x in (("k", k), ("v", v), ("w", w), ("target", target)) + ((("place", place),) if place is not None else ()):
        check_device(name, x, k.device)


def merge_weighted_triton(k: Tensor, v: Tensor, w: Tensor, target: Tensor, place: Tensor | None = None, *,
                          block_j: int = 32) -> tuple[Tensor, Tensor, Tensor]:
    """The Triton merge (same contract as ``merge_weighted_reference``); each program loops to the
    longest source segment among its BLOCK_J targets."""
    require_triton()
    check_merge_inputs(k, v, w, target, place)
    b, hkv, c, d = k.shape
    key = torch.where(target < 0, c, target.long())                       # kept slots sort last
    _, order = torch.sort(key, dim=-1, stable=True)
    sorted_key = torch.gather(key, -1, order)
    ar = torch.arange(c, device=k.device).expand(b, hkv, c).contiguous()
    lo = torch.searchsorted(sorted_key, ar, right=False)
    hi = torch.searchsorted(sorted_key, ar, right=True)
    k_out = torch.empty_like(k, memory_format=torch.contiguous_format)
    v_out = torch.empty_like(k_out)
    lw = torch.empty(b, hkv, c, device=k.device, dtype=torch.float32)
    block_d = min(128, max(16, next_pow2(d)))
    grid = (b * hkv, triton.cdiv(c, block_j), triton.cdiv(d, block_d))
    _merge_weighted_kernel[grid](
        k, v, w.contiguous(), target.contiguous(), order.contiguous(), lo, hi,
        place.contiguous() if place is not None else lo, k_out, v_out, lw,
        *k.stride(), *v.stride(), *k_out.stride(), hkv, c,
        HEAD_DIM=d, BLOCK_J=block_j, BLOCK_D=block_d, HAS_PLACE=place is not None, num_warps=4)
    return k_out, v_out, lw


@torch.library.custom_op("kvpass::merge_weighted", mutates_args=())
def merge_weighted(k: Tensor, v: Tensor, w: Tensor, target: Tensor,
                   place: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    return merge_weighted_reference(k, v, w, target, place)


@merge_weighted.register_fake
def _(k, v, w, target, place=None):
    return torch.empty_like(k), torch.empty_like(v), torch.empty_like(w)


if HAS_TRITON:
    @merge_weighted.register_kernel("cuda")
    def _(k, v, w, target, place=None):
        return merge_weighted_triton(k, v, w, target, place)
