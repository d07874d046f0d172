"""KVMerger (Wang et al. 2024): adaptive merging of consecutive similar keys with Gaussian-kernel
weights around a pivotal token (docs/policies.md §3)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

import kvpass.kernels  # noqa: F401  (registers torch.ops.kvpass)
from kvpass.cache import EMPTY, LayerCache, keep_slots, with_capacity
from kvpass.policies.base import Policy, Stat, require
from kvpass.policies.selection import sort_rank

SIZE = "kvm_size"     # slot_meta: [B, Hkv, C] fp32 tokens an entry stands for (0 or 1: a plain token)


@dataclass(frozen=True)
class MergePlan:
    """protected: [B, Hkv, C] bool recent + heavy hitters; link: [B, Hkv, C] bool slot j joins the set
    of slot j - 1; set_id: [B, Hkv, C] int64; pivot: [B, Hkv, C] int64 pivot slot of each slot's set;
    gauss: [B, Hkv, C] fp32 g_j = exp(-||k_p - k_j||^2 / (2 sigma^2)); size: [B, Hkv, C] set size."""

    protected: Tensor
    link: Tensor
    set_id: Tensor
    pivot: Tensor
    gauss: Tensor
    size: Tensor


@dataclass(frozen=True)
class KVMerger(Policy):
    """KVMerger (docs/policies.md §3). Per KV head: protect the last ``recent_ratio * s`` entries and the
    top ``heavy_ratio * s`` by accumulated attention (§3.4 step 2, ratios of the entries s; scaled down
    together when they alone exceed ``keep`` [OURS]); link adjacent mergeable entries whose key cosine
    exceeds ``epsilon`` (chain reading of Algorithm 1, §3.4 step 4); merge each maximal chain into its
    pivot (largest accumulated attention) with Gaussian weights of the L2 distance to the pivot key
    (§3.4 step 5; ``kvpass::merge_entries``), the value scaled by the set size (``value_scale``).

    Budget (§3.6): ``budget_mode="strict"`` keeps the ``s - keep`` most similar admissible links
    regardless of epsilon; ``"adaptive"`` keeps every link above epsilon and, when that is not enough
    for ``keep``, the next most similar ones (the runtime needs at most ``keep``). If links run out,
    the lowest-attention unprotected singletons are dropped. At decode time (``interval``) merged
    entries are never merged again (§3.5 extension).

    ``overflow`` says what goes when the protected entries and this round's merged entries (pivots) alone
    exceed ``keep`` (every prompt compression below a budget of about recent_ratio + heavy_ratio, where the
    protected entries are scaled to fill ``keep``): "tiered" (default) keeps protected entries first, then
    pivots by accumulated attention, then singletons; "slot_order" (the earlier behaviour, kept
    for the stored results) ranks them all equal and drops the last in sequence order, i.e. the newest
    protected (recent) entries and the prompt's last tokens in every head, a bug (docs/quality.md,
    "Degeneration check": perplexity x620 at budget 0.1 on SmolLM2; x10 with "tiered").

    Parameters
    ----------
    epsilon: 0.75. recent_ratio, heavy_ratio: 0.17 and 0.12 (the 50% setting; 35%: 0.08 and 0.02).
    sigma: 5. sigma_mode: "fixed" or "mean_dist" (§3.9). value_scale: "set_size" (plain attention,
    values times |S|) or "none" (log|S| logit bias instead, §3.7). interval: 16. overflow: "tiered" or
    "slot_order" (above).
    """

    name: ClassVar[str] = "kvmerger"
    section: ClassVar[str] = "§3"
    summary: ClassVar[str] = "merge runs of similar consecutive keys with Gaussian weights around a pivot"
    stats: ClassVar[frozenset[Stat]] = frozenset({Stat.COLUMN_SUM})
    epsilon: float = 0.75
    recent_ratio: float = 0.17
    heavy_ratio: float = 0.12
    sigma: float = 5.0
    sigma_mode: str = "fixed"
    value_scale: str = "set_size"
    budget_mode: str = "strict"
    interval: int = 16
    overflow: str = "tiered"

    def __post_init__(self) -> None:
        super().__post_init__()
        require(-1.0 <= self.epsilon <= 1.0, f"kvmerger: epsilon must lie in [-1, 1], got {self.epsilon!r}")
        for name in ("recent_ratio", "heavy_ratio"):
            value = getattr(self, name)
            require(0.0 <= value < 1.0, f"kvmerger: {name} must lie in [0, 1), got {value!r}")
        require(self.sigma > 0, f"kvmerger: sigma must be > 0, got {self.sigma!r}")
        require(self.sigma_mode in ("fixed", "mean_dist"), f"kvmerger: sigma_mode must be 'fixed' or 'mean_dist', got {self.sigma_mode!r}")
        require(self.value_scale in ("set_size", "none"), f"kvmerger: value_scale must be 'set_size' or 'none', got {self.value_scale!r}")
        require(self.budget_mode in ("strict", "adaptive"), f"kvmerger: budget_mode must be 'strict' or 'adaptive', got {self.budget_mode!r}")
        require(self.overflow in ("slot_order", "tiered"), f"kvmerger: overflow must be 'slot_order' or 'tiered', got {self.overflow!r}")

    def protected(self, cache: LayerCache, keep: int) -> Tensor:
        """Recent and heavy-hitter entries of every row: [B, Hkv, C] bool (§3.4 step 2)."""
        s = cache.length.double()
        n_r, n_h = torch.ceil(self.recent_ratio * s), torch.ceil(self.heavy_ratio * s)
        scale = torch.clamp(keep / (n_r + n_h).clamp(min=1), max=1.0)
        n_r, n_h = torch.floor(n_r * scale).long(), torch.floor(n_h * scale).long()
        slot = torch.arange(cache.capacity, device=cache.k.device)
        live = cache.live
        recent = live & (slot >= (cache.length - n_r)[..., None])
        score = cache.slot_meta[Stat.COLUMN_SUM.value].float().masked_fill(~live | recent, EMPTY)
        rank = sort_rank(score, descending=True)
        return recent | ((rank < n_h[..., None]) & live & ~recent)

    def plan(self, cache: LayerCache, keep: int) -> MergePlan:
        """Links, merging sets, pivots and Gaussian weights of every row (§3.4 steps 3-5, §3.6)."""
        k = cache.k.float()
        attn = cache.slot_meta[Stat.COLUMN_SUM.value].float()
        protected = self.protected(cache, keep)
        size_meta = cache.slot_meta.get(SIZE, torch.zeros_like(attn))
        mergeable = cache.live & ~protected & (size_meta <= 1)
        kn = k / (k.norm(dim=-1, keepdim=True) + 1e-6)
        adj = (kn[..., 1:, :] * kn[..., :-1, :]).sum(-1)                              # cos(k_j, k_{j-1})
        admissible = mergeable[..., 1:] & mergeable[..., :-1]
        cos = adj.masked_fill(~admissible, EMPTY)
        n_need = (cache.length - keep).clamp(min=0)
        if self.budget_mode == "adaptive":
            n_need = torch.maximum(n_need, (cos > self.epsilon).sum(-1))
        rank = sort_rank(cos, descending=True)
        link = torch.nn.functional.pad((rank < n_need[..., None]) & admissible, (1, 0))  # [B, Hkv, C]
        set_id = torch.cumsum(~link, dim=-1) - 1
        size = torch.zeros_like(attn).scatter_add_(-1, set_id, torch.ones_like(attn))
        size = torch.gather(size, -1, set_id)
        best = torch.full_like(attn, EMPTY).scatter_reduce(-1, set_id, attn, "amax")
        c = cache.capacity
        cand = torch.where(attn == torch.gather(best, -1, set_id), torch.arange(c, device=k.device), c)
        pivot_of_set = torch.full_like(set_id, c).scatter_reduce(-1, set_id, cand, "amin")
        pivot = torch.gather(pivot_of_set, -1, set_id)
        kp = torch.gather(k, 2, pivot[..., None].expand_as(k))
        dist2 = ((kp - k) ** 2).sum(-1)
        sigma = self.sigma
        if self.sigma_mode == "mean_dist":
            total = torch.zeros_like(attn).scatter_add_(-1, set_id, dist2.sqrt())
            sigma = (torch.gather(total, -1, set_id) / (math.sqrt(2) * size)).clamp(min=1e-6)
        gauss = torch.exp(-dist2 / (2 * sigma ** 2 if isinstance(sigma, float) else 2 * sigma.pow(2)))
        return MergePlan(protected=protected, link=link, set_id=set_id, pivot=pivot, gauss=gauss, size=size)

    def compress(self, cache: LayerCache, keep: int) -> LayerCache:
        """cache: [B, Hkv, C, ...] with slot_meta ``col_sum`` -> rows of at most ``keep`` entries."""
        if not bool((cache.length > keep).any()):
            return cache
        plan = self.plan(cache, keep)
        live = cache.live
        grouped = live & (plan.size > 1)
        target = torch.where(grouped, plan.pivot, torch.arange(cache.capacity, device=cache.k.device))
        k, v, log_weight = torch.ops.kvpass.merge_entries(cache.k, cache.v, plan.gauss, cache.log_weight, target)
        is_pivot = grouped & (plan.pivot == torch.arange(cache.capacity, device=k.device))
        if self.value_scale == "set_size":
            acc = torch.promote_types(v.dtype, torch.float32)                     # fp32, or fp64 in tests
            v = torch.where(is_pivot[..., None], v.to(acc) * plan.size[..., None].to(acc), v.to(acc)).to(v.dtype)
            log_weight = torch.where(is_pivot, cache.log_weight, log_weight)
        col = cache.slot_meta[Stat.COLUMN_SUM.value]
        col_sum = torch.zeros_like(col).scatter_add_(-1, target, col.masked_fill(~live, 0))
        size_meta = cache.slot_meta.get(SIZE, torch.zeros_like(col))
        meta = {**cache.slot_meta, Stat.COLUMN_SUM.value: col_sum,
                SIZE: torch.where(is_pivot, plan.size.to(col.dtype), size_meta)}
        log_weight = log_weight.masked_fill(grouped & ~is_pivot, EMPTY)
        # fewer links than needed: drop the lowest-attention unprotected singletons (§3.6)
        alive = log_weight > EMPTY
        if self.overflow == "tiered":      # protected, then pivots, then singletons; by col_sum within each
            score_rank = sort_rank(col_sum.float())                                         # 0 = lowest
            tier = plan.protected.long() * 2 + (is_pivot & ~plan.protected).long()
            prio = (tier * cache.capacity + score_rank).masked_fill(~alive, -1)
        else:                              # protected and pivots tie: the last slots go first
            prio = torch.where(plan.protected | is_pivot, float("inf"), col_sum.float()).masked_fill(~alive, EMPTY)
        n_keep = torch.clamp(alive.sum(-1), max=keep)
        rank = sort_rank(prio, descending=True)
        log_weight = log_weight.masked_fill(rank >= n_keep[..., None], EMPTY)
        merged = LayerCache(k=k, v=v, log_weight=log_weight, length=cache.length, position=cache.position,
                            slot_meta=meta, state=cache.state)
        idx = torch.sort((log_weight == EMPTY).to(torch.int8), dim=-1, stable=True).indices
        out = keep_slots(merged, idx)
        return with_capacity(out, max(keep, int(out.length.max())))
