"""ClusterKV (Liu et al. 2025): recallable compression with semantic clusters (docs/policies.md §2)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvpass.cache import LayerCache
from kvpass.policies.base import Attention, Policy, require
from kvpass.policies.kmeans import cosine_kmeans

FULL_BUDGET = 2**62          # a selection budget no cache reaches: every cluster attended


@dataclass(frozen=True)
class ClusterKV(Policy):
    """Recallable compression (docs/policies.md §2): nothing is evicted; the full K, V stay in host memory
    when the model runs on an accelerator (``host_resident``; pinned). After prefill the keys of
    every KV head past the ``sinks`` are clustered by cosine K-means into C0 = max(1, round(n /
    cluster_ratio)) clusters, n the row's prompt tokens (§2.4, §2.5); every ``window`` generated tokens are clustered into
    ``window_clusters`` new clusters among themselves (§2.6 step 2). Each decode step, every query
    head ranks the centroids by q . mu and attends exactly to the sinks, the whole clusters taken in
    that order up to ``budget - sinks`` tokens (the last one trimmed to its lowest positions) and the
    not-yet-clustered generated tokens (``kvpass::cluster_recall_attention``). If the prompt fits the
    budget, selection is skipped (§2.5 step 3). The first ``full_layers`` layers attend to every
    token. The last step's selection is the device cache (R = 1); its hit rate is reported
    (``GenerationReport.policy_stats['recall_hit_rate']``). The K-means rounds are the ops
    ``kvpass::cosine_kmeans_assign`` and ``kvpass::cosine_kmeans_update``, the gather of host-resident
    selected entries ``kvpass::cluster_gather`` (Triton on CUDA).

    Parameters
    ----------
    sinks: s0 = 16. cluster_ratio: 80 prompt tokens per cluster. kmeans_iters: 20. window: m = 320.
    window_clusters: C+ = 4. full_layers: 2. seed: K-means initialisation seed (§0.7).
    """

    name: ClassVar[str] = "clusterkv"
    section: ClassVar[str] = "§2"
    summary: ClassVar[str] = "recall whole semantic clusters of the full (host-resident) cache"
    attention: ClassVar[Attention] = Attention.CLUSTER_RECALL
    compresses: ClassVar[bool] = False
    decode_inputs: ClassVar[tuple[str, ...]] = ("cluster", "cluster_rank", "centroids", "cluster_size",
                                                "recall_budget", "recall_prev", "recall_hits")
    host_resident: ClassVar[tuple[str, ...]] = ("k", "v")
    sinks: int = 16
    cluster_ratio: int = 80
    kmeans_iters: int = 20
    window: int = 320
    window_clusters: int = 4
    full_layers: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, low in (("sinks", 0), ("cluster_ratio", 1), ("kmeans_iters", 1), ("window", 1),
                          ("window_clusters", 1), ("full_layers", 0)):
            value = getattr(self, name)
            require(isinstance(value, int) and value >= low, f"clusterkv: {name} must be an int >= {low}, got {value!r}")
        require(self.window_clusters <= self.window, "clusterkv: window_clusters must not exceed window")

    def min_budget(self) -> int:
        return self.sinks + 1

    def prepare(self, cache: LayerCache, layer: int, budget: int) -> LayerCache:
        """Cluster the prompt (§2.5). slot_meta ``cluster`` (cluster id + 1, 0 = not clustered) and
        ``cluster_rank`` [B, Hkv, C] int64; state ``centroids`` [B, Hkv, K, D] fp32, ``cluster_size``
        [B, Hkv, K] int64 (K = C0 plus room for every decode window), ``cluster_count`` [B, Hkv],
        ``recall_budget`` [B, Hkv] int64, ``recall_prev`` [B, Hkv, C] bool, ``recall_hits`` [B, Hkv, 2]."""
        b, hkv, c, d = cache.k.shape
        dev = cache.log_weight.device
        n = int(cache.length.max())
        slot = torch.arange(c, device=dev)
        selecting = layer >= self.full_layers
        n0 = max(1, round(n / self.cluster_ratio)) if selecting else 1
        k_max = n0 + self.window_clusters * -(-(c - n) // self.window)
        valid = cache.live & (slot >= self.sinks) & selecting
        per_row = torch.clamp(torch.round(cache.length / self.cluster_ratio).long(), min=1)   # C0 of each row
        found = cosine_kmeans(cache.k, valid, n0, self.kmeans_iters, self.seed + layer, per_row.clamp(max=n0))
        centroids = torch.zeros(b, hkv, k_max, d, device=dev)
        sizes = torch.zeros(b, hkv, k_max, dtype=torch.long, device=dev)
        centroids[:, :, :n0], sizes[:, :, :n0] = found.centroids, found.sizes
        budget = torch.as_tensor(budget, dtype=torch.long, device=dev).reshape(-1, 1)   # [B or 1, 1] per row
        fits = cache.length <= budget
        cache.slot_meta = {**cache.slot_meta, "cluster": found.labels + 1, "cluster_rank": found.rank}
        cache.state = {**cache.state, "centroids": centroids, "cluster_size": sizes,
                       "cluster_count": per_row.clamp(max=n0) if selecting else torch.full((b, hkv), n0, device=dev),
                       "recall_budget": torch.where(fits | (not selecting), FULL_BUDGET, budget - self.sinks),
                       "recall_prev": torch.zeros(b, hkv, c, dtype=torch.bool, device=dev),
                       "recall_hits": torch.zeros(b, hkv, 2, device=dev)}
        return cache

    def maintenance_due(self, new_tokens: int) -> bool:
        return new_tokens % self.window == 0

    def maintain(self, cache: LayerCache, layer: int) -> LayerCache:
        """Cluster the pending generated tokens (live, not clustered, past the sinks) into
        ``window_clusters`` new clusters among themselves (§2.6 step 2)."""
        if layer < self.full_layers:
            return cache
        slot = torch.arange(cache.capacity, device=cache.log_weight.device)
        pending = cache.live & (cache.slot_meta["cluster"] == 0) & (slot >= self.sinks)
        count = cache.state["cluster_count"]                        # [B, Hkv]: each row's clusters so far
        if int(count.max()) + self.window_clusters > cache.state["centroids"].shape[2] or not bool(pending.any()):
            return cache
        keys = cache.k.to(pending.device, non_blocking=True)        # host-resident keys: cluster on the device
        found = cosine_kmeans(keys, pending, self.window_clusters, self.kmeans_iters, self.seed + layer)
        state = dict(cache.state)
        # each row's new clusters go after its own (a row's ids do not depend on its batch-mates)
        new_ids = count[..., None] + torch.arange(self.window_clusters, device=count.device)   # [B, Hkv, W]
        state["centroids"] = state["centroids"].clone().scatter_(
            2, new_ids[..., None].expand(*new_ids.shape, found.centroids.shape[-1]),
            found.centroids.to(state["centroids"].device))
        state["cluster_size"] = state["cluster_size"].clone().scatter_(2, new_ids, found.sizes)
        state["cluster_count"] = count + self.window_clusters
        meta = dict(cache.slot_meta)
        meta["cluster"] = torch.where(pending, found.labels + 1 + count[..., None], meta["cluster"])
        meta["cluster_rank"] = torch.where(pending, found.rank, meta["cluster_rank"])
        return LayerCache(k=cache.k, v=cache.v, log_weight=cache.log_weight, length=cache.length,
                          position=cache.position, slot_meta=meta, state=state)

    def report(self, caches: list[LayerCache]) -> dict[str, float]:
        """recall_hit_rate: fraction of the recalled entries already selected at the previous step
        (the R = 1 device cache of §2.8), over every selecting layer, head and step."""
        hits = sum(c.state["recall_hits"].sum(dim=(0, 1)) for c in caches if "recall_hits" in c.state)
        if not isinstance(hits, torch.Tensor) or float(hits[1]) == 0:
            return {}
        return {"recall_hit_rate": float(hits[0] / hits[1])}

    def compress(self, cache: LayerCache, keep: int) -> LayerCache:
        return cache
