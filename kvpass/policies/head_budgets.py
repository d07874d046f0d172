"""Head-adaptive budgets inside a layer (AdaKV, Feng et al. 2024): one budget per layer, split across the
layer's KV heads by score. Used by the ``adakv`` wrapper policy; any policy whose per-head priority
(``keep_priority``) is comparable across heads can be wrapped.

Per batch row, with H KV heads and a layer budget of ``keep`` entries per head on average:

* every head keeps its top ``floor`` priorities (AdaKV's safeguard, ``floor = int(alpha * keep)``), so no
  head is emptied;
* the rest of the row's ``H * keep`` entries go to the top priorities over all heads jointly;
* no head keeps more than ``cap`` entries (the static buffers' size per head). A greedy pick in descending
  priority that skips full heads takes each head's entries in its own order, so the cap is the same as
  cutting every head's candidates to its top ``cap`` before the joint top-k.
"""

from __future__ import annotations

import torch
from torch import Tensor


def head_cap(keep: int, heads: int, floor: int, max_share: float | None) -> int:
    """The most entries one head can keep: ``heads * keep - (heads - 1) * floor`` (the others at their
    floor), lowered to ``int(max_share * keep)`` when ``max_share`` is given; never below ``keep``."""
    cap = heads * keep - (heads - 1) * min(floor, keep)
    if max_share is not None:
        cap = min(cap, int(max_share * keep))
    return max(cap, keep)


def within_head_rank(priority: Tensor) -> Tensor:
    """[B, H, C] -> [B, H, C] int64: 0 for each head's highest priority, 1 for the next... (ties: lower
    slot first)."""
    order = priority.argsort(dim=-1, descending=True, stable=True)
    ar = torch.arange(priority.shape[-1], device=priority.device).expand_as(order)
    return torch.empty_like(order).scatter(-1, order, ar)


def select_kept_across_heads(priority: Tensor, keep: int, floor: int, cap: int) -> Tensor:
    """The slots each head keeps when the row's heads share ``H * keep`` entries.

    priority: [B, H, C] fp64 (+inf: protected, -inf: empty; ``keep_priority``); floor <= keep <= cap.
    Returns kept: [B, H, C] bool with, per row, min(H * keep, live slots that fit the caps) slots set,
    between min(floor, live) and cap per head."""
    b, h, c = priority.shape
    if not 0 <= floor <= keep <= cap:
        raise ValueError(f"need 0 <= floor <= keep <= cap, got floor={floor}, keep={keep}, cap={cap}")
    rank = within_head_rank(priority)
    live = priority > float("-inf")
    joint = torch.where(rank < floor, float("inf"), priority)                 # the floor first
    joint = torch.where(rank < cap, joint, float("-inf"))                     # nothing past the cap
    total = min(h * keep, h * c)
    top = joint.reshape(b, h * c).topk(total, dim=-1).indices
    kept = torch.zeros(b, h * c, dtype=torch.bool, device=priority.device).scatter(-1, top, True)
    return kept.view(b, h, c) & live & (rank < cap)
