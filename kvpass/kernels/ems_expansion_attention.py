"""EMS decode attention over shared entries expanded through the slot table (docs/policies.md §4.7).

The cache holds entries e < C (a key direction and a value each) and a table of token slots t < S,
each naming the entry it reads (``slot_entry[t]``, -1 = free / zero class) and its own key norm
(``slot_knorm[t]``). For batch b, query head h (KV head g = h // G) and new query token i:

    khat_e  = k_e / ||k_e||                       (entries may hold any positive multiple of a direction)
    s_t     = scale * knorm_t * (q_h . khat_{entry[t]})      (softcap c: s_t = c * tanh(s_t / c))
    p_t     = softmax_t(s_t + log_weight_{entry[t]})        over the live slots of the table and
              the entries no slot names ("implicit slots": the token written this step, attended
              as a plain token, knorm = ||k_e||, i.e. s_e = scale * q_h . k_e)
    o_h     = sum_t p_t v_{entry[t]}  =  sum_e P_e v_e,   P_e = sum_{t : entry[t] = e} p_t

This is plain attention over the expanded cache K_exp[t] = knorm_t * khat_{entry[t]},
V_exp[t] = v_{entry[t]} (§4.7), computed without materialising it: one dot product per entry, a
gather per slot, a scatter-add of the probabilities back onto the entries. With an empty table it
is exactly ``decode_attention``.

Side outputs: ``slot_prob`` [B, Hkv, S] fp32 is overwritten (mutated) with this step's probability of
every table slot, averaged over the G query heads of the group and summed over the T new tokens
(§0.5, §4.8 step 2; 0 for free slots), which the EMS policy accumulates into its scores. With
``want_scores`` the op also returns the step's probability mass per entry, P_e averaged over the
group and summed over the tokens, [B, Hkv, C] fp32 (for an implicit slot: its own probability);
otherwise an empty tensor.

Shapes: q: [B, Hq, T, D]; k, v: [B, Hkv, C, D]; log_weight: [B, Hkv, C] fp32 (-inf = empty entry);
slot_entry: [B, Hkv, S] int64; slot_knorm, slot_prob: [B, Hkv, S] fp32. o: [B, Hq, T, D].
Traffic: reads the C entries once (2*B*Hkv*C*D elements) plus 2 scalars per slot.
"""

from __future__ import annotations

import torch
from torch import Tensor

_NEG = float("-inf")


def ems_expansion_attention_reference(q: Tensor, k: Tensor, v: Tensor, log_weight: Tensor, slot_entry: Tensor,
                                      slot_knorm: Tensor, slot_prob: Tensor, scale: float,
                                      softcap: float | None = None, want_scores: bool = False) -> tuple[Tensor, Tensor]:
    b, hq, t, d = q.shape
    hkv, c = k.shape[1], k.shape[2]
    group = hq // hkv
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32    # float64 inputs: a float64 reference
    kf = k.to(acc)
    knorm_e = kf.norm(dim=-1)                                              # [B, Hkv, C]
    live = log_weight > _NEG                                               # [B, Hkv, C]
    qg = q.reshape(b, hkv, group * t, d).to(acc)
    z = torch.matmul(qg, kf.transpose(-1, -2)) * scale                     # [B, Hkv, G*T, C]  scale * q . k_e
    ratio_e = 1.0 / knorm_e.clamp(min=torch.finfo(acc).tiny)              # 1 / ||k_e||
    entry = slot_entry.clamp(min=0)                                        # [B, Hkv, S]
    active = (slot_entry >= 0) & torch.gather(live, -1, entry)            # a slot naming a live entry
    gidx = entry[:, :, None, :].expand(b, hkv, group * t, -1)
    s_slot = torch.gather(z, -1, gidx) * (slot_knorm.to(acc) * torch.gather(ratio_e, -1, entry))[:, :, None, :]
    referenced = torch.zeros_like(entry[..., :1].expand_as(live)).scatter_add(-1, entry, active.long()) > 0
    implicit = live & ~referenced                                          # [B, Hkv, C]
    s_impl = z
    if softcap is not None:
        s_slot = softcap * torch.tanh(s_slot / softcap)
        s_impl = softcap * torch.tanh(s_impl / softcap)
    lw = log_weight.to(acc)
    s_slot = (s_slot + torch.gather(lw, -1, entry)[:, :, None, :]).masked_fill(~active[:, :, None, :], _NEG)
    s_impl = (s_impl + lw[:, :, None, :]).masked_fill(~implicit[:, :, None, :], _NEG)
    p = torch.softmax(torch.cat([s_slot, s_impl], dim=-1), dim=-1)         # [B, Hkv, G*T, S + C]
    p = torch.nan_to_num(p, nan=0.0)                                       # a row without any live slot
    s = slot_entry.shape[-1]
    p_slot, p_impl = p[..., :s], p[..., s:]
    mass = p_impl.scatter_add(-1, gidx, p_slot)                            # P_e: [B, Hkv, G*T, C]
    o = torch.matmul(mass, v.to(acc)).reshape(b, hq, t, d).to(q.dtype)
    slot_prob.copy_(p_slot.reshape(b, hkv, group, t, s).sum(dim=3).mean(dim=2).to(slot_prob.dtype))
    if want_scores:
        scores = mass.reshape(b, hkv, group, t, c).sum(dim=3).mean(dim=2)
        scores = scores if acc == torch.float64 else scores.float()
    else:
        scores = q.new_empty(0, dtype=torch.float32)
    return o, scores


@torch.library.custom_op("kvpass::ems_expansion_attention", mutates_args=("slot_prob",))
def ems_expansion_attention(q: Tensor, k: Tensor, v: Tensor, log_weight: Tensor, slot_entry: Tensor,
                            slot_knorm: Tensor, slot_prob: Tensor, scale: float, softcap: float | None = None,
                            want_scores: bool = False) -> tuple[Tensor, Tensor]:
    return ems_expansion_attention_reference(q, k, v, log_weight, slot_entry, slot_knorm, slot_prob, scale,
                                             softcap, want_scores)


@ems_expansion_attention.register_fake
def _(q, k, v, log_weight, slot_entry, slot_knorm, slot_prob, scale, softcap=None, want_scores=False):
    scores = q.new_empty(k.shape[0], k.shape[1], k.shape[2], dtype=torch.float32) if want_scores \
        else q.new_empty(0, dtype=torch.float32)
    return torch.empty_like(q), scores
