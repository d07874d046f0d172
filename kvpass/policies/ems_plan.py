"""EMS (Li et al. 2024) building blocks: the prefill evict-then-merge planning (docs/policies.md §4.3, §4.6 steps
2-6), the keys without RoPE (§4.9) and the decode-time slot scores (§4.8).

The EMS policy (``kvpass/policies/ems.py``) adds the slot look-up table, the decode op of §4.7 and the decode
bookkeeping of §4.8. Everything is vectorised over [B, Hkv] rows and works on ragged rows (live masks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from kvpass.cache import gather_slots
from kvpass.policies.selection import sort_rank

EVICTED, CENTER, TBM, LOCAL = 0, 1, 2, 3


def global_local_score(s_glo: Tensor, s_loc: Tensor, candidate: Tensor, live: Tensor, pool: int = 7) -> Tensor:
    """s_hat = mean_pool_7( max(s_Glo * (sum s_Loc / sum s_Glo), s_Loc) ) over the candidate slots (§4.3;
    sums over every live slot, pooling with zero padding, count_include_pad as SnapKV).
    s_glo, s_loc: [B, Hkv, C] fp32; candidate, live: [B, Hkv, C] bool (candidates are a prefix of the
    live slots). Returns [B, Hkv, C] fp32, -inf outside the candidates."""
    glo, loc = s_glo.float().masked_fill(~live, 0), s_loc.float().masked_fill(~live, 0)
    factor = loc.sum(-1, keepdim=True) / glo.sum(-1, keepdim=True).clamp(min=1e-30)
    gl = torch.maximum(glo * factor, loc).masked_fill(~candidate, 0)
    b, hkv, c = gl.shape
    pooled = torch.nn.functional.avg_pool1d(gl.reshape(b * hkv, 1, c), pool, stride=1, padding=pool // 2)
    return pooled.reshape(b, hkv, c).masked_fill(~candidate, float("-inf"))


def partition(s_hat: Tensor, candidate: Tensor, local: Tensor, n_imp: int, n_tbm: int) -> Tensor:
    """Level-1 partition (§4.6 step 4): the top ``n_imp`` candidates by s_hat are class centres, the
    next ``n_tbm`` are to be merged, the other candidates are evicted; ``local`` slots are LOCAL.
    Ties: lower slot first. Returns [B, Hkv, C] int64 of EVICTED / CENTER / TBM / LOCAL."""
    rank = sort_rank(s_hat, descending=True)
    cls = torch.where(rank < n_imp, CENTER, torch.where(rank < n_imp + n_tbm, TBM, EVICTED))
    cls = cls.masked_fill(~candidate, EVICTED)
    return cls.masked_fill(local, LOCAL)


def unit(x: Tensor) -> Tensor:
    """x / (||x|| + 1e-6) along the last dimension, in fp32 (fp64 for fp64 inputs)."""
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    return x / (x.norm(dim=-1, keepdim=True) + 1e-6)


def destinations(ks: Tensor, v: Tensor, cls: Tensor, tau: float, n_imp: int | None = None,
                 n_tbm: int | None = None, s_hat: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Merge destination of every TBM slot (§4.6 step 5): d_i = argmax_d R[i, d] over the centres,
    R = cos(ks_i, ks_d) * cos(v_i, v_d) (ties: lowest slot); -1 (the zero class) when R < tau or the slot
    is not TBM. ks: [B, Hkv, C, D] keys used for similarity; v: [B, Hkv, C, D]. Returns (dest [B, Hkv, C]
    int64, best R [B, Hkv, C] fp32, -inf off the TBM slots).

    With ``n_imp``, ``n_tbm`` and ``s_hat`` (the partition's sizes and scores) only the n_tbm x n_imp
    block of R between TBM tokens and centres is formed; otherwise the whole C x C matrix."""
    b, hkv, c, _ = ks.shape
    slot = torch.arange(c, device=ks.device)
    if s_hat is None:
        rows = cols = slot.expand(b, hkv, c)
    else:
        order = torch.sort(s_hat, dim=-1, descending=True, stable=True).indices
        cols = torch.sort(order[..., :n_imp], dim=-1).values                  # centres, by slot
        rows = order[..., n_imp:n_imp + n_tbm]                                # TBM tokens
    uk, uv = unit(ks), unit(v)
    r = (gather_slots(uk, rows) @ gather_slots(uk, cols).transpose(-1, -2)) * \
        (gather_slots(uv, rows) @ gather_slots(uv, cols).transpose(-1, -2))     # [B, Hkv, rows, cols]
    r = r.masked_fill((torch.gather(cls, -1, cols) != CENTER)[:, :, None, :], float("-inf"))
    best, arg = r.max(-1)
    is_tbm = torch.gather(cls, -1, rows) == TBM
    dest_rows = torch.where(is_tbm & (best >= tau), torch.gather(cols, -1, arg), -1)
    dest = torch.full_like(cls, -1).scatter(-1, rows, dest_rows)
    best_all = torch.full(cls.shape, float("-inf"), dtype=best.dtype, device=best.device)
    best_all = best_all.scatter(-1, rows, best.masked_fill(~is_tbm, float("-inf")))
    return dest, best_all


@dataclass(frozen=True)
class CenterMerge:
    """khat: [B, Hkv, C, D] unit key direction of every centre (members' unit keys, weighted, then
    renormalised); vent: [B, Hkv, C, D] weighted mean value; knorm: [B, Hkv, C] every slot's own
    ||k||; entry: [B, Hkv, C] int64 the centre slot each slot reads (itself for centres and locals,
    -1 for evicted and zero-class slots); members: [B, Hkv, C] int64 tokens merged into each centre
    besides itself; dirs: [B, Hkv, C, D] the extra directions (e.g. pre-RoPE keys) merged like the keys,
    or None."""

    khat: Tensor
    vent: Tensor
    knorm: Tensor
    entry: Tensor
    members: Tensor
    dirs: Tensor | None = None


def merge_into_centers(k: Tensor, v: Tensor, s_hat: Tensor, cls: Tensor, dest: Tensor,
                       dirs: Tensor | None = None) -> CenterMerge:
    """§4.6 step 6: for centre d with members M_d = {d} ∪ {i : dest_i = d}, w_j = s_hat_j / sum s_hat,
    Khat_d = normalize(sum w_j k_j / ||k_j||), Vent_d = sum w_j v_j; members keep their own ||k_j||.
    ``dirs`` [B, Hkv, C, D] (the "w.o. pos" pre-RoPE keys, §4.5) are merged like the keys."""
    acc = torch.promote_types(k.dtype, torch.float32)
    own = (cls == CENTER) | (cls == LOCAL)
    slot = torch.arange(k.shape[2], device=k.device)
    entry = torch.where(own, slot, dest)                                               # -1: no slot
    src = entry >= 0
    tgt = entry.clamp(min=0)
    w = torch.where(src & (cls != LOCAL), s_hat.to(acc).clamp(min=1e-12), 0.0)
    w = torch.where(cls == LOCAL, 1.0, w)
    knorm = k.to(acc).norm(dim=-1)
    unit = k.to(acc) / (knorm[..., None] + 1e-6)
    wsum = torch.zeros_like(w).scatter_add_(-1, tgt, w)
    idx = tgt[..., None].expand_as(unit)
    ksum = torch.zeros_like(unit).scatter_add_(2, idx, w[..., None] * unit)
    vsum = torch.zeros_like(unit).scatter_add_(2, idx, w[..., None] * v.to(acc))
    khat = ksum / (ksum.norm(dim=-1, keepdim=True) + 1e-12)
    vent = vsum / wsum.clamp(min=torch.finfo(acc).tiny)[..., None]
    members = torch.zeros_like(entry).scatter_add_(-1, tgt, (src & (cls == TBM)).long())
    merged_dirs = None
    if dirs is not None:
        dsum = torch.zeros_like(unit).scatter_add_(2, idx, w[..., None] * (dirs.to(acc) / (dirs.to(acc).norm(
            dim=-1, keepdim=True) + 1e-6)))
        merged_dirs = dsum / (dsum.norm(dim=-1, keepdim=True) + 1e-12)
    return CenterMerge(khat=khat, vent=vent, knorm=knorm, entry=entry, members=members, dirs=merged_dirs)


def unrotate(k: Tensor, position: Tensor, inv_freq: tuple[float, ...] | None) -> Tensor:
    """k_raw = RoPE^{-1}(k, pos) (§4.9) for HF's rotate-half RoPE over the first 2 * len(inv_freq) dims
    (the rest pass through; no frequencies: k unchanged). k: [B, Hkv, C, D]; position: [B, Hkv, C]."""
    if not inv_freq:
        return k
    r = len(inv_freq)
    freq = torch.tensor(inv_freq, dtype=torch.float32, device=k.device)
    angle = position.clamp(min=0).float()[..., None] * freq                # fp32 angles, as HF computes them
    acc = torch.promote_types(k.dtype, torch.float32)
    cos, sin = angle.cos().to(acc), angle.sin().to(acc)
    x = k.to(acc)
    y1, y2 = x[..., :r], x[..., r:2 * r]
    return torch.cat([y1 * cos + y2 * sin, y2 * cos - y1 * sin, x[..., 2 * r:]], dim=-1)


def rope_inv_freq_of(model) -> tuple[float, ...]:
    """The RoPE frequencies of ``model``'s full-attention layers, read from its rotary-embedding buffer
    (``full_attention_inv_freq`` where layer types differ, else ``inv_freq``); () without RoPE."""
    buffers = {name: t for name, t in model.named_buffers() if name.endswith("inv_freq") and "original" not in name}
    for want in ("full_attention_inv_freq", "inv_freq"):
        for name, t in buffers.items():
            if name.split(".")[-1] == want:
                return tuple(float(x) for x in t.detach().float().cpu())
    return ()


def slot_scores(glo: Tensor, loc: Tensor, pos: Tensor, tracked: Tensor, candidate: Tensor, pool: int) -> Tensor:
    """s_hat of the candidate slots (§4.3 in decode, §4.8 step 4): s_GL = max(s_Glo * sum s_Loc / sum s_Glo,
    s_Loc) with both sums over every tracked slot, then mean-pooled (kernel ``pool``, zero padding) over the
    candidates sorted by position [OURS]. All [B, Hkv, S]; returns fp32 [B, Hkv, S], 0 off the candidates."""
    g, lo = glo.masked_fill(~tracked, 0), loc.masked_fill(~tracked, 0)
    # the sums in float64: a row's sum then does not depend on how many free slots its table has (a batch
    # holds every row's table at the widest row's S; an fp32 sum's rounding depends on the length summed)
    factor = (lo.double().sum(-1, keepdim=True) / g.double().sum(-1, keepdim=True).clamp(min=1e-30)).to(g.dtype)
    gl = torch.maximum(g * factor, lo).masked_fill(~candidate, 0)
    key = torch.where(candidate, pos, torch.iinfo(torch.int64).max)
    order = torch.sort(key, dim=-1, stable=True).indices                   # candidates first, by position
    b, h, s = gl.shape
    pooled = F.avg_pool1d(torch.gather(gl, -1, order).reshape(b * h, 1, s).float(), pool, stride=1,
                          padding=pool // 2).reshape(b, h, s)
    return torch.empty_like(pooled).scatter_(-1, order, pooled).masked_fill(~candidate, 0)
