"""D2O's merge arithmetic, written once (docs/policies.md §5.6): the EMA threshold, the merge decision and weights,
the entries protected from absorbing, and the weighted average. The reference (``reference.py``) and the in-place
step (``in_place.py``) call these; the Triton kernels compute the same expressions and are tested against the
reference.

Shapes: u, valid [B, Hkv, E] (E evictions per row: u the best similarity of each, valid whether it counts); the
threshold state tau [B] fp32, tau_set [B] bool (one value per batch row, over every KV head of the layer)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from kvpass.head_group import HeadGroup

SCORE_EPS = 1e-6       # merge_weighting="score": added to every weight (entries of zero score average)
NO_FLOOR = -2.0        # a min_cos that lets every merge through (a cosine is >= -1)
NO_MERGE = 2.0         # a min_cos that lets none through (a cosine is <= 1)


@dataclass(frozen=True)
class StepOptions:
    """What a compression step takes of the policy's options: ``beta`` the EMA weight, ``variant`` "paper" or
    "code", ``min_cos`` the cosine floor (NO_FLOOR, or NO_MERGE for merge=False), ``bias`` merge_bias (log-sizes
    add), ``protect`` the fraction of a row's budget that never absorbs (merge_protect), ``score_weights``
    merge_weighting="score", ``chains`` the evicted entries a merge chain spans (0: none; ``chains.py``)."""

    beta: float
    variant: str
    min_cos: float = NO_FLOOR
    bias: bool = False
    protect: float = 0.0
    score_weights: bool = False
    chains: int = 0

    @property
    def w_self(self) -> float:
        """A kept entry's own weight in the average: e ("paper", against exp(u)) or 1 ("code", against u)."""
        return math.e if self.variant == "paper" else 1.0

    @property
    def by_count(self) -> bool:
        """Whether the average divides by 1 + the merged count ("code") instead of the sum of the weights."""
        return self.variant == "code" and not self.score_weights


def per_row(x: int | Tensor, b: int, dims: int) -> int | Tensor:
    """An int as it is, or a per batch row [B] tensor viewed [B, 1, ...] (``dims`` ones) to broadcast."""
    return x if isinstance(x, int) else x.view(b, *([1] * dims))


def protected_count(protect: float, keep: int | Tensor) -> int | Tensor:
    """floor(protect * keep): an int for an int ``keep``, else [B] int64 computed on keep's device in fp64."""
    return int(protect * keep) if isinstance(keep, int) else (protect * keep.double()).floor().long()


def unprotected(score: Tensor, live: Tensor, n_protect: int | Tensor) -> Tensor:
    """[B, Hkv, C] bool: the ``live`` slots outside the ``n_protect`` (int or [B]) highest ``score`` of their row
    (ties: the lower slot first; a stable sort, the same on every device). No host sync."""
    order = torch.sort(score.float().masked_fill(~live, float("-inf")), dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(order.shape[-1], device=order.device)
                                            .expand_as(order).contiguous())
    return live & (rank >= per_row(n_protect, score.shape[0], 2))


def every_head(heads: HeadGroup, u: Tensor, valid: Tensor, dim: int = 1) -> tuple[Tensor, Tensor]:
    """(u, valid) of every KV head of the layer from this rank's (heads along ``dim``), in one all-gather (the two
    stacked as fp32: valid is 0 or 1, exact); the inputs as they are in one process."""
    if heads.world == 1:
        return u, valid
    both = heads.gather(torch.stack((u.float(), valid.float())), dim=dim + 1)
    return both[0], both[1] > 0


def ema_threshold(u: Tensor, valid: Tensor, prev: Tensor, was_set: Tensor, beta: float) -> tuple[Tensor, Tensor]:
    """§5.6 step 2 per batch row: current = mean u over the valid evictions; tau = current the first time, beta
    current + (1 - beta) tau after, unchanged without evictions -> (tau [B] fp32, tau_set [B] bool)."""
    has = valid.flatten(1).any(-1)
    current = u.flatten(1).sum(-1) / valid.flatten(1).sum(-1).clamp(min=1)
    ema = beta * current + (1 - beta) * prev
    return torch.where(has, torch.where(was_set, ema, current), prev), was_set | has


def merge_weights(u: Tensor, valid: Tensor, tau: Tensor, opts: StepOptions) -> tuple[Tensor, Tensor]:
    """§5.6 steps 3-4: (merged, w_e [B, Hkv, E] fp32). "paper": merged = u >= tau, w_e = exp(u); "code": the
    mean over heads of the i-th eviction decides for every head, w_e = u; either way only where u >= min_cos."""
    floor = u >= opts.min_cos
    if opts.variant == "paper":
        merged = valid & (u >= tau[:, None, None]) & floor
        return merged, torch.where(merged, u.exp(), 0.0)
    per_slot = u.sum(1) / valid.sum(1).clamp(min=1)                         # [B, E] mean over heads
    merged = valid & (per_slot >= tau[:, None])[:, None, :] & floor
    return merged, torch.where(merged, u, 0.0)


def threshold_and_merge(heads: HeadGroup, u: Tensor, valid: Tensor, tau: Tensor, tau_set: Tensor,
                        opts: StepOptions) -> tuple[Tensor, Tensor]:
    """§5.6 steps 2-4 over every rank's heads (``every_head``): the threshold state ``tau``, ``tau_set`` [B] is
    updated in place; returns this rank's (merged, w_e) [B, Hkv, E], as one process decides them."""
    u_all, valid_all = every_head(heads, u, valid)
    new_tau, new_set = ema_threshold(u_all, valid_all, tau, tau_set, opts.beta)
    merged, w_e = merge_weights(u_all, valid_all, new_tau, opts)
    tau.copy_(new_tau)
    tau_set.copy_(new_set)
    return heads.local(merged).contiguous(), heads.local(w_e).contiguous()


def averaged(base: Tensor, acc: Tensor, w_self: float | Tensor, w_sum: Tensor, count: Tensor,
             opts: StepOptions) -> Tensor:
    """The weighted average of §5.6 step 4 for each kept entry: acc / norm where something merged into it
    (count > 0), else ``base`` [.., K, D] itself; acc = w_self x + sum_e w_e x_e (fp32), norm = w_self + sum w_e,
    or w_self + count ("code"). w_self: a float or [.., K, 1]; w_sum, count: [.., K, 1]."""
    norm = w_self + (count if opts.by_count else w_sum)
    return torch.where(count > 0, (acc / norm).to(base.dtype), base)
