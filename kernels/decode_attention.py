"""Decode attention over the compressed cache, with the per-entry additive log-weight.

For batch b, query head h (KV head g = h // G), new query token t and cache slot j < C:

    s_j = scale * q_{b,h,t} . k_{b,g,j}           (softcap c: s_j = c * tanh(s_j / c))
    p_j = softmax_j(s_j + log_weight_{b,g,j})      (log_weight: 0 for a plain entry, log N for a
                                                    merged one of N tokens, -inf for an empty slot)
    o_{b,h,t} = sum_j p_j v_{b,g,j}

Every live slot is in the past of the new tokens, so there is no causal mask. With
``want_scores`` the op also returns the step's attention row per KV head, averaged over the G
query heads of the group and summed over the T new tokens (policies.md §0.5): [B, Hkv, C] fp32,
which eviction policies accumulate. Otherwise ``scores`` is an empty tensor.

Shapes: q: [B, Hq, T, D]; k, v: [B, Hkv, C, D]; log_weight: [B, Hkv, C] fp32. o: [B, Hq, T, D].
Traffic: reads 2*B*Hkv*C*D cache elements once per step; this is what bounds decode speed.
"""

from __future__ import annotations

import torch
from torch import Tensor


def decode_attention_reference(q: Tensor, k: Tensor, v: Tensor, log_weight: Tensor, scale: float,
                               softcap: float | None = None, want_scores: bool = False) -> tuple[Tensor, Tensor]:
    b, hq, t, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    qg = q.reshape(b, hkv, group * t, d).float()                     # heads g*G..g*G+G-1 share KV head g
    s = torch.matmul(qg, k.float().transpose(-1, -2)) * scale         # [B, Hkv, G*T, C]
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    p = torch.softmax(s + log_weight[:, :, None, :].float(), dim=-1)
    o = torch.matmul(p, v.float()).reshape(b, hq, t, d).to(q.dtype)
    if want_scores:
        scores = p.reshape(b, hkv, group, t, -1).sum(dim=3).mean(dim=2)
    else:
        scores = q.new_empty(0, dtype=torch.float32)
    return o, scores


@torch.library.custom_op("kvpass::decode_attention", mutates_args=())
def decode_attention(q: Tensor, k: Tensor, v: Tensor, log_weight: Tensor, scale: float,
                     softcap: float | None = None, want_scores: bool = False) -> tuple[Tensor, Tensor]:
    return decode_attention_reference(q, k, v, log_weight, scale, softcap, want_scores)


@decode_attention.register_fake
def _(q, k, v, log_weight, scale, softcap=None, want_scores=False):
    scores = log_weight.new_empty(log_weight.shape if want_scores else (0,), dtype=torch.float32)
    return torch.empty_like(q), scores
