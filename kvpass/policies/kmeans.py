"""Batched cosine K-means over the slots of a layer cache (docs/policies.md §2.4, ClusterKV): the loop, the
seeded initialisation and the member ranks; each round is the ops ``kvpass::cosine_kmeans_assign`` and
``kvpass::cosine_kmeans_update`` (Triton on CUDA)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvpass.kernels.cosine_kmeans_assign import cosine_kmeans_assign
from kvpass.kernels.cosine_kmeans_update import cosine_kmeans_update


@dataclass(frozen=True)
class Clusters:
    """centroids: [B, Hkv, K, D] fp32 (mean of the raw member keys); labels: [B, Hkv, N] int64 in
    [0, K), -1 for slots not clustered; sizes: [B, Hkv, K] int64; rank: [B, Hkv, N] int64 index of a
    slot inside its cluster in slot (= position) order, 0 for slots not clustered."""

    centroids: Tensor
    labels: Tensor
    sizes: Tensor
    rank: Tensor


def member_rank(labels: Tensor, n_clusters: int) -> Tensor:
    """Index of each slot inside its cluster, in slot order; labels: [B, Hkv, N] (-1 = none)."""
    n = labels.shape[-1]
    slot = torch.arange(n, device=labels.device)
    lab = torch.where(labels >= 0, labels, n_clusters)
    order = torch.sort(lab * n + slot, dim=-1).indices
    sorted_lab = torch.gather(lab, -1, order).contiguous()
    start = torch.searchsorted(sorted_lab, sorted_lab)                         # first index of each label
    rank_sorted = slot - start
    rank = torch.empty_like(rank_sorted).scatter_(-1, order, rank_sorted)
    return rank.masked_fill(labels < 0, 0)


def cosine_kmeans(x: Tensor, valid: Tensor, n_clusters: int, iters: int = 20, seed: int = 0,
                  row_clusters: Tensor | None = None) -> Clusters:
    """Cosine K-means of the valid slots of every (b, g) row (§2.4): centroids start as
    ``n_clusters`` distinct valid keys drawn uniformly at random (seeded); up to ``iters`` rounds of
    assign-by-cosine / centroid = mean of raw member keys, stopping when no label changes; an empty
    cluster keeps its previous centroid [OURS]. Rows with fewer valid slots than clusters leave the
    surplus clusters empty (size 0). ``row_clusters`` [B, Hkv] int64 (<= n_clusters) limits the clusters
    of each row. The random draw of a slot depends only on (seed, slot, head), so a row clusters the same
    way whatever else is in the batch. x: [B, Hkv, N, D]; valid: [B, Hkv, N] bool."""
    b, hkv, n, d = x.shape
    gen = torch.Generator().manual_seed(seed)
    draw = torch.rand(n, hkv, generator=gen).T.to(x.device).expand(b, hkv, n)      # prefix-stable in n
    draw = draw.masked_fill(~valid, -1.0)
    pick = draw.topk(min(n_clusters, n), dim=-1).indices                       # [B, Hkv, K]
    usable = torch.gather(valid, -1, pick)
    centroids = torch.gather(x.float(), 2, pick[..., None].expand(-1, -1, -1, d))
    if pick.shape[-1] < n_clusters:                                            # fewer slots than clusters
        extra = n_clusters - pick.shape[-1]
        centroids = torch.cat([centroids, centroids.new_zeros(b, hkv, extra, d)], dim=2)
        usable = torch.cat([usable, usable.new_zeros(b, hkv, extra)], dim=2)
    if row_clusters is not None:
        usable = usable & (torch.arange(n_clusters, device=x.device) < row_clusters[..., None])
    labels = cosine_kmeans_assign(x, centroids, valid, usable)                  # -1 where not valid
    for _ in range(iters):
        centroids, _ = cosine_kmeans_update(x, labels, centroids)              # empty clusters keep theirs
        new = cosine_kmeans_assign(x, centroids, valid, usable)
        if torch.equal(new, labels):
            break
        labels = new
    sizes = torch.zeros(b, hkv, n_clusters, dtype=torch.long, device=x.device)
    sizes.scatter_add_(2, labels.clamp(min=0), valid.long())
    return Clusters(centroids=centroids, labels=labels, sizes=sizes, rank=member_rank(labels, n_clusters))
