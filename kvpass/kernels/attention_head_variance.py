"""Per-query-head variance of the prefill attention column sums (D2O's layer density metric,
docs/policies.md §5.4 step 1, code form).

For batch row b with real columns R_b = {j : j >= pad[b]} (n_b = |R_b|) and query head h:

    c[b, h, j]  = sum_i A_h[i, j]                       (causal prefill attention, fp32 softmax)
    var[b, h]   = sum_{j in R_b} (c[b, h, j] - mean_{R_b} c)^2 / (n_b - 1)     (unbiased; 0 if n_b = 1)

Query heads are NOT averaged over their group: D2O min-max normalises the per-head variances of a
layer first. Computed in blocks of query rows (never the T x T matrix of all heads).
Shapes: q: [B, Hq, T, D]; k: [B, Hkv, T, D]; pad: [B] int64 -> [B, Hq] fp32.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvpass.kernels.attention_column_sums import head_column_sums


def attention_head_variance_reference(q: Tensor, k: Tensor, pad: Tensor, scale: float, window: int | None = None,
                                      softcap: float | None = None, lse: Tensor | None = None) -> Tensor:
    return head_variance_of_sums(head_column_sums(q, k, pad, scale, window, softcap, lse=lse), pad)


def head_variance_of_sums(c: Tensor, pad: Tensor) -> Tensor:
    """c: per-query-head column sums [B, Hq, T] fp32 (``head_column_sums``), pad [B] -> var [B, Hq]."""
    t = c.shape[2]
    real = (torch.arange(t, device=c.device)[None, :] >= pad[:, None]).float()[:, None, :]   # [B, 1, T]
    n = real.sum(-1)                                                      # [B, 1]
    mean = (c * real).sum(-1) / n
    ss = (((c - mean[..., None]) * real) ** 2).sum(-1)
    return ss / (n - 1).clamp(min=1)


@torch.library.custom_op("kvpass::attention_head_variance", mutates_args=())
def attention_head_variance(q: Tensor, k: Tensor, pad: Tensor, scale: float, window: int | None = None,
                            softcap: float | None = None, lse: Tensor | None = None) -> Tensor:
    return attention_head_variance_reference(q, k, pad, scale, window, softcap, lse)


@attention_head_variance.register_fake
def _(q, k, pad, scale, window=None, softcap=None, lse=None):
    return q.new_empty(q.shape[0], q.shape[1], dtype=torch.float32)
