"""AdaKV head-adaptive budgets (Feng et al. 2024, "Ada-KV: Optimizing KV Cache Eviction by Adaptive
Budget Allocation"), as a wrapper of any scoring eviction policy (docs/policies.md §6.11); [OURS] where marked."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from kvpass.cache import EMPTY, LayerCache, gather_slots, keep_slots
from kvpass.policies.base import Policy, Stat, require
from kvpass.policies.capabilities import GathersAcrossHeads
from kvpass.policies.h2o import H2O
from kvpass.policies.head_budgets import head_cap, select_kept_across_heads
from kvpass.policies.pyramidkv import PyramidKV
from kvpass.policies.selection import kept_slots
from kvpass.policies.snapkv import SnapKV
from kvpass.policies.spec import split_spec

_INNER = {p.name: p for p in (H2O, SnapKV, PyramidKV)}      # the policies with a priority, by name


@dataclass(frozen=True)
class AdaKV(Policy, GathersAcrossHeads):
    """Keep the inner policy's layer budget, split across the layer's KV heads by its scores: each head
    keeps its top ``floor = int(alpha * keep)`` entries, and the rest of the layer's ``Hkv * keep`` go to
    the top scores over all heads jointly (``head_budgets``), so heads whose attention is concentrated
    give entries to heads whose attention is spread. What each head keeps is its selected slots; nothing
    is merged. The inner policy's protected entries (SnapKV's window, H2O's recent window) are kept in
    every head, and its layer budgets (PyramidKV's pyramid) and decode rule are kept.

    The cache's buffers are static per head, so a head's slots hold the most entries one head can get:
    ``Hkv * keep - (Hkv - 1) * floor`` (``max_share=None``, AdaKV's rule), or ``int(max_share * keep)``
    [OURS]; the live entries stay ``Hkv * keep`` per layer, but the allocation (``cache_bytes``) grows
    with the cap. Wraps policies with a ``priority(cache, keep)`` method: h2o, snapkv, pyramidkv.

    Parameters
    ----------
    inner: the scoring policy, a registered name or an instance (default "snapkv", as AdaKV's release).
    alpha: the per-head floor as a fraction of the uniform share (AdaKV's safeguard, 0.2).
    max_share: None, or the most entries one head may hold, as a multiple of the uniform share (>= 1).
    """

    name: ClassVar[str] = "adakv"
    section: ClassVar[str] = "§6.11"
    summary: ClassVar[str] = "a scoring policy's layer budget split across KV heads by score (head-adaptive)"
    rows_independent: ClassVar[bool] = True
    inner: Policy | str = "snapkv"
    alpha: float = 0.2
    max_share: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.inner, str):                   # a spec of one of the scoring policies
            name, kwargs = split_spec(self.inner)
            require(name in _INNER, f"adakv: inner must be a scoring eviction policy with a priority (h2o, snapkv, "
                                    f"pyramidkv), got {self.inner!r}")
            object.__setattr__(self, "inner", _INNER[name](**kwargs))
        require(isinstance(self.inner, Policy) and callable(getattr(self.inner, "priority", None)),
                f"adakv: inner must be a scoring eviction policy with a priority (h2o, snapkv, pyramidkv), "
                f"got {self.inner!r}")
        require(isinstance(self.alpha, (int, float)) and 0.0 <= self.alpha <= 1.0,
                f"adakv: alpha must lie in [0, 1], got {self.alpha!r}")
        require(self.max_share is None or (isinstance(self.max_share, (int, float)) and self.max_share >= 1.0),
                f"adakv: max_share must be None or a number >= 1, got {self.max_share!r}")
        super().__post_init__()

    @property
    def stats(self) -> frozenset[Stat]:                  # type: ignore[override]
        return self.inner.stats

    @property
    def interval(self) -> int:
        return getattr(self.inner, "interval", 1)

    def stat_options(self, stat: Stat) -> dict[str, object]:
        return self.inner.stat_options(stat)

    def bind_model(self, model) -> Policy:
        return replace(self, inner=self.inner.bind_model(model))

    def min_budget(self) -> int:
        return self.inner.min_budget()

    def layer_budgets(self, budget: int, caches: list[LayerCache]) -> list[int]:
        return self.inner.layer_budgets(budget, caches)

    def floor(self, keep: int) -> int:
        return min(int(self.alpha * keep), keep)

    def head_capacity(self, keep: int, heads: int) -> int:
        return head_cap(keep, heads, self.floor(keep), self.max_share)

    def gathers_across_heads(self) -> bool:
        return True                                 # the joint top-k over every KV head of the layer

    def compress(self, cache: LayerCache, keep: int) -> LayerCache:
        """cache: k, v [B, Hkv, C, D] + the inner policy's statistics -> capacity min(cap, C), row (b, g)
        holding its selected entries; per row the heads hold Hkv * keep entries together."""
        # the joint top-k runs over every KV head of the layer: under tensor parallelism each rank gathers
        # the others' priorities (``self.heads``; identity in one process) and keeps its own heads' choice
        priority = self.heads.gather(self.inner.priority(cache, keep))          # [B, Hkv of every rank, C]
        cap = self.head_capacity(keep, priority.shape[1])
        kept = self.heads.local(select_kept_across_heads(priority, keep, self.floor(keep), cap))
        idx = kept_slots(kept, cap)                          # a head's kept slots, then slots it drops
        dropped = torch.arange(idx.shape[-1], device=idx.device) >= kept.sum(-1, keepdim=True)
        log_weight = gather_slots(cache.log_weight, idx).masked_fill(dropped, EMPTY)
        return keep_slots(cache, idx, (gather_slots(cache.k, idx), gather_slots(cache.v, idx), log_weight))
