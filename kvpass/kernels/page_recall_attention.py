"""Quest page-recall decode attention (docs/policies.md §6.6).

The cache of C = n_pages * P slots is split into pages of P consecutive slots. ``page_max`` /
``page_min`` hold each page's per-channel max / min key. The op first refreshes the summaries of
the page holding each row's newest entry (slot ``length - 1``, just written by ``write_kv``), in
place, then for query head h (KV head g = h // G):

    u_{h,p} = sum_c max(q_c Mx_{g,p,c}, q_c Mn_{g,p,c})        (upper bound of q.k in page p)
    selected pages: the top max(3, budget_g // P) pages by u (ties: lower page), plus the page of
                    the newest entry where ``force_last`` ([OURS] flag quest_force_last_page)
    o_h = sum_{j in selected pages} softmax_j(scale q.k_j + log_weight_j) v_j

Pages without a live entry are never selected. ``budget`` [B, Hkv] int64 (tokens); a budget >= C
selects every page, which is exact full attention. Scores of pages and logits in fp32.

Shapes: q: [B, Hq, 1, D]; k, v: [B, Hkv, C, D]; log_weight: [B, Hkv, C] fp32; page_max, page_min:
[B, Hkv, n_pages, D] fp32 (mutated); budget: [B, Hkv] int64; force_last: [B, Hkv] bool. Returns o [B, Hq, 1, D] and an empty
scores tensor (no statistic is accumulated).
"""

from __future__ import annotations

import torch
from torch import Tensor


def _acc(q: Tensor) -> torch.dtype:
    """Accumulation dtype: float64 inputs give a float64 reference, anything else float32."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def page_summaries(k: Tensor, live: Tensor, n_pages: int) -> tuple[Tensor, Tensor]:
    """k: [B, Hkv, C, D]; live: [B, Hkv, C] -> per-page max and min keys [B, Hkv, n_pages, D] fp32
    over live slots (0 for pages without one)."""
    b, hkv, c, d = k.shape
    kp = k.float().reshape(b, hkv, n_pages, c // n_pages, d)
    lp = live.reshape(b, hkv, n_pages, c // n_pages, 1)
    any_live = lp.any(dim=3)
    mx = kp.masked_fill(~lp, float("-inf")).amax(dim=3)
    mn = kp.masked_fill(~lp, float("inf")).amin(dim=3)
    return torch.where(any_live, mx, 0.0), torch.where(any_live, mn, 0.0)


def select_pages(q: Tensor, page_max: Tensor, page_min: Tensor, page_live: Tensor, budget: Tensor,
                 page_size: int, last_page: Tensor) -> Tensor:
    """The selected pages of every query head: [B, Hq, n_pages] bool (see the module docstring).
    q: [B, Hq, D]; page_live: [B, Hkv, n_pages] bool; last_page: [B, Hkv] int64, -1 for none."""
    b, hq, d = q.shape
    hkv, n_pages = page_max.shape[1], page_max.shape[2]
    group = hq // hkv
    qg = q.to(_acc(q)).reshape(b, hkv, group, 1, d)
    u = torch.maximum(qg * page_max[:, :, None], qg * page_min[:, :, None]).sum(-1)     # [B, Hkv, G, P]
    u = u.masked_fill(~page_live[:, :, None], float("-inf"))
    order = torch.sort(u, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(n_pages, device=q.device).expand_as(order))
    n_sel = torch.clamp(torch.div(budget, page_size, rounding_mode="floor"), min=3)      # [B, Hkv]
    chosen = (rank < n_sel[:, :, None, None]) & page_live[:, :, None]
    chosen = chosen | (torch.arange(n_pages, device=q.device) == last_page[:, :, None, None])
    return chosen.reshape(b, hq, n_pages)


def page_recall_attention_reference(q: Tensor, k: Tensor, v: Tensor, log_weight: Tensor, page_max: Tensor,
                                    page_min: Tensor, budget: Tensor, force_last: Tensor, scale: float,
                                    softcap: float | None = None, want_scores: bool = False) -> tuple[Tensor, Tensor]:
    b, hq, t, d = q.shape
    hkv, c = k.shape[1], k.shape[2]
    n_pages = page_max.shape[2]
    page = c // n_pages
    live = log_weight > float("-inf")                                             # [B, Hkv, C]
    newest = (live.sum(-1) - 1).clamp(min=0)                                      # [B, Hkv]
    last_page = torch.div(newest, page, rounding_mode="floor")
    slots = last_page[..., None] * page + torch.arange(page, device=k.device)     # [B, Hkv, P]
    kp = torch.gather(k, 2, slots[..., None].expand(b, hkv, page, d))
    mx, mn = page_summaries(kp, torch.gather(live, 2, slots), 1)
    page_max.scatter_(2, last_page[:, :, None, None].expand(b, hkv, 1, d), mx)
    page_min.scatter_(2, last_page[:, :, None, None].expand(b, hkv, 1, d), mn)
    page_live = live.reshape(b, hkv, n_pages, page).any(-1)
    chosen = select_pages(q[:, :, -1], page_max, page_min, page_live, budget, page,
                          torch.where(force_last, last_page, -1))                  # [B, Hq, n_pages]
    keep = chosen.repeat_interleave(page, dim=-1).reshape(b, hkv, -1, 1, c)      # [B, Hkv, G, 1, C]
    group = hq // hkv
    qg = q.reshape(b, hkv, group, t, d).to(_acc(q))
    s = torch.matmul(qg, k.to(_acc(q))[:, :, None].transpose(-1, -2)) * scale        # [B, Hkv, G, T, C]
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = (s + log_weight[:, :, None, None].to(_acc(q))).masked_fill(~keep, float("-inf"))
    o = torch.matmul(torch.softmax(s, dim=-1), v.to(_acc(q))[:, :, None]).reshape(b, hq, t, d).to(q.dtype)
    return o, q.new_empty(0, dtype=torch.float32)


@torch.library.custom_op("kvpass::page_recall_attention", mutates_args=("page_max", "page_min"))
def page_recall_attention(q: Tensor, k: Tensor, v: Tensor, log_weight: Tensor, page_max: Tensor, page_min: Tensor,
                          budget: Tensor, force_last: Tensor, scale: float, softcap: float | None = None,
                          want_scores: bool = False) -> tuple[Tensor, Tensor]:
    return page_recall_attention_reference(q, k, v, log_weight, page_max, page_min, budget, force_last, scale,
                                           softcap, want_scores)


@page_recall_attention.register_fake
def _(q, k, v, log_weight, page_max, page_min, budget, force_last, scale, softcap=None, want_scores=False):
    return torch.empty_like(q), log_weight.new_empty(0, dtype=torch.float32)
