"""ClusterKV cluster-recall decode attention (docs/policies.md §2.6, §2.7).

Slot j of KV head g belongs to cluster ``cluster[j] - 1`` (``cluster = 0``: not clustered, i.e.
sinks and pending generated tokens, always attended). For query head h (KV head g = h // G):

    score_c = q_h . mu_{g,c}                      (clusters of size 0 never selected)
    visit clusters by descending score (ties: lower c); a clustered slot j of cluster c is selected
    iff  before_h(c) + rank[j] < budget_g,  before_h(c) = sizes of the clusters visited before c
    (so whole clusters are taken until the budget, and the last one is trimmed to its lowest
    positions, as the reference); budget = B - sinks tokens
    o_h = sum_{j selected or not clustered} softmax_j(scale q.k_j + log_weight_j) v_j

The selection cache (R = 1, §2.8) is kept per KV head: ``recall_prev`` [B, Hkv, C] bool holds the
clustered slots any query head of the group selected at the previous step; ``recall_hits``
[B, Hkv, 2] fp32 accumulates (selected slots already in it, selected slots). Both are mutated.
When k, v live in host memory (a different device than q) only the selected slots are gathered
and copied to q's device.

Shapes: q: [B, Hq, 1, D]; k, v: [B, Hkv, C, D]; log_weight: [B, Hkv, C] fp32; cluster, rank:
[B, Hkv, C] int64; centroids: [B, Hkv, K, D] fp32; sizes: [B, Hkv, K] int64; budget: [B, Hkv]
int64. Returns o [B, Hq, 1, D] and an empty scores tensor.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvpass.kernels.cluster_gather import cluster_gather


def _acc(q: Tensor) -> torch.dtype:
    """Accumulation dtype: float64 inputs give a float64 reference, anything else float32."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def select_slots(q: Tensor, live: Tensor, cluster: Tensor, rank: Tensor, centroids: Tensor, sizes: Tensor,
                 budget: Tensor) -> Tensor:
    """Slots every query head attends: [B, Hkv, G, C] bool. q: [B, Hq, D] (see the module docstring)."""
    b, hq, d = q.shape
    hkv = centroids.shape[1]
    group = hq // hkv
    score = torch.einsum("bhgd,bhkd->bhgk", q.to(_acc(q)).reshape(b, hkv, group, d), centroids.to(_acc(q)))
    score = score.masked_fill((sizes == 0)[:, :, None], float("-inf"))
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices              # [B, Hkv, G, K]
    sorted_sizes = torch.gather(sizes[:, :, None].expand(-1, -1, group, -1), -1, order)
    before = torch.empty_like(sorted_sizes).scatter_(-1, order, sorted_sizes.cumsum(-1) - sorted_sizes)
    clustered = (cluster > 0) & live                                                    # [B, Hkv, C]
    c_idx = (cluster - 1).clamp(min=0)[:, :, None].expand(-1, -1, group, -1)
    slot_before = torch.gather(before, -1, c_idx)                                       # [B, Hkv, G, C]
    recalled = clustered[:, :, None] & (slot_before + rank[:, :, None] < budget[:, :, None, None])
    return recalled | (live & ~clustered)[:, :, None]


def attend_selected(q: Tensor, k: Tensor, v: Tensor, log_weight: Tensor, keep: Tensor, scale: float,
                    softcap: float | None, gather: bool) -> Tensor:
    """softmax over the kept slots of every query head. keep: [B, Hkv, G, C] bool. With ``gather``
    only the kept slots are gathered onto keep's device first (``kvpass::cluster_gather``: Triton on
    CUDA, reading pinned host k, v in place; the reference gathers on k's device and copies)."""
    b, hq, t, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    if gather:
        n = max(int(keep.sum(-1).max()), 1)
        ks, vs, lw = cluster_gather(k, v, log_weight, keep, n)       # on keep's (= q's) device; padding lw = -inf
        mask = lw > float("-inf")
    else:
        mask, ks, vs = keep, k[:, :, None], v[:, :, None]
        lw = log_weight[:, :, None]
    qg = q.reshape(b, hkv, group, t, d).to(_acc(q))
    s = torch.matmul(qg, ks.to(_acc(q)).transpose(-1, -2)) * scale                          # [B, Hkv, G, T, n]
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = (s + lw[..., None, :].to(_acc(q))).masked_fill(~mask[..., None, :], float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), vs.to(_acc(q))).reshape(b, hq, t, d).to(q.dtype)


def cluster_recall_attention_reference(q: Tensor, k: Tensor, v: Tensor, log_weight: Tensor, cluster: Tensor,
                                       rank: Tensor, centroids: Tensor, sizes: Tensor, budget: Tensor,
                                       recall_prev: Tensor, recall_hits: Tensor, scale: float,
                                       softcap: float | None = None, want_scores: bool = False) -> tuple[Tensor, Tensor]:
    dev = centroids.device
    live = (log_weight > float("-inf")).to(dev)
    keep = select_slots(q[:, :, -1].to(dev), live, cluster, rank, centroids, sizes, budget)
    recalled = (keep & (cluster > 0)[:, :, None]).any(2)                                # [B, Hkv, C]
    recall_hits[..., 0] += (recalled & recall_prev).sum(-1).float()
    recall_hits[..., 1] += recalled.sum(-1).float()
    recall_prev.copy_(recalled)
    o = attend_selected(q, k, v, log_weight, keep.to(q.device), scale, softcap, gather=k.device != q.device)
    return o, q.new_empty(0, dtype=torch.float32)


@torch.library.custom_op("kvpass::cluster_recall_attention", mutates_args=("recall_prev", "recall_hits"))
def cluster_recall_attention(q: Tensor, k: Tensor, v: Tensor, log_weight: Tensor, cluster: Tensor, rank: Tensor,
                             centroids: Tensor, sizes: Tensor, budget: Tensor, recall_prev: Tensor,
                             recall_hits: Tensor, scale: float, softcap: float | None = None,
                             want_scores: bool = False) -> tuple[Tensor, Tensor]:
    return cluster_recall_attention_reference(q, k, v, log_weight, cluster, rank, centroids, sizes, budget,
                                              recall_prev, recall_hits, scale, softcap, want_scores)


@cluster_recall_attention.register_fake
def _(q, k, v, log_weight, cluster, rank, centroids, sizes, budget, recall_prev, recall_hits, scale,
      softcap=None, want_scores=False):
    return torch.empty_like(q), q.new_empty(0, dtype=torch.float32)
