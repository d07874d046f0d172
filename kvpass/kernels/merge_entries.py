"""Weighted merge of cache entries into target entries (docs/policies.md §1.6 Chelsea, §3.4 KVMerger).

For batch b, KV head g and slot j, the sources of j are ``S_j = {i : target[b, g, i] = j}`` (a slot
that keeps itself has ``target = j``, so it is its own source; ``target = -1`` means "no merge, drop
or leave alone"). For every slot j with a non-empty source set:

    k'_j = sum_{i in S_j} w_i k_i / sum_{i in S_j} w_i          (likewise v)
    log_weight'_j = log sum_{i in S_j} exp(log_weight_i)        (the merged entry's degree N)

Slots with no sources keep k, v and log_weight unchanged; merged-away sources are left as they are
(the caller drops them with ``keep_slots``). Empty slots (log_weight = -inf) must not be sources.
Sums are in fp32 (float64 inputs stay float64); k', v' are cast back to the input dtype (§0.7).

Shapes: k, v: [B, Hkv, C, D]; w: [B, Hkv, C] merge weights (> 0 for sources); log_weight:
[B, Hkv, C] fp32; target: [B, Hkv, C] int64 in [-1, C). Returns k', v', log_weight' of the same shapes.
Traffic: reads and writes 2*B*Hkv*C*D elements once.
"""

from __future__ import annotations

import torch
from torch import Tensor


def merge_entries_reference(k: Tensor, v: Tensor, w: Tensor, log_weight: Tensor,
                             target: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    acc = torch.float64 if k.dtype == torch.float64 else torch.float32
    src = target >= 0                                                    # [B, Hkv, C]
    tgt = target.clamp(min=0)
    wf = torch.where(src, w.to(acc), 0.0)                                # [B, Hkv, C]
    idx = tgt[..., None].expand_as(k)
    wsum = torch.zeros_like(wf).scatter_add_(2, tgt, wf)                 # [B, Hkv, C]
    ksum = torch.zeros(k.shape, dtype=acc, device=k.device).scatter_add_(2, idx, wf[..., None] * k.to(acc))
    vsum = torch.zeros(v.shape, dtype=acc, device=v.device).scatter_add_(2, idx, wf[..., None] * v.to(acc))
    deg = torch.where(src, log_weight.to(acc).exp(), 0.0)
    degsum = torch.zeros_like(deg).scatter_add_(2, tgt, deg)
    hit = torch.zeros_like(src).scatter_(2, tgt, src)                    # slot j has a source
    denom = wsum.clamp(min=torch.finfo(acc).tiny)[..., None]
    k_out = torch.where(hit[..., None], ksum / denom, k.to(acc)).to(k.dtype)
    v_out = torch.where(hit[..., None], vsum / denom, v.to(acc)).to(v.dtype)
    lw_out = torch.where(hit, degsum.log(), log_weight.to(acc)).to(log_weight.dtype)
    return k_out, v_out, lw_out


@torch.library.custom_op("kvpass::merge_entries", mutates_args=())
def merge_entries(k: Tensor, v: Tensor, w: Tensor, log_weight: Tensor,
                   target: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return merge_entries_reference(k, v, w, log_weight, target)


@merge_entries.register_fake
def _(k, v, w, log_weight, target):
    return torch.empty_like(k), torch.empty_like(v), torch.empty_like(log_weight)
