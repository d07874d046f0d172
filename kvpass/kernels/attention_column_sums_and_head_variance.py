"""D2O's two prefill statistics of one layer from one pass over the prefill attention (docs/policies.md
§0.4, §5.4): ``attention_column_sums`` [B, Hkv, T] and ``attention_head_variance`` [B, Hq], both
derived from the per-query-head column sums c[b, h, j] of ``head_column_sums`` (each op alone would
compute c again). The rewrite inserts this op when a policy asks for both statistics with the same
options. ``lse``: the rows' base-2 log-sum-exps [B, Hq, T] from ``prefill_attention_lse`` (on CUDA only
the column pass then runs; see ``head_column_sums``). Shapes: q: [B, Hq, T, D]; k: [B, Hkv, T, D]; pad: [B] int64.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvpass.kernels.attention_column_sums import head_column_sums
from kvpass.kernels.attention_head_variance import head_variance_of_sums


def attention_column_sums_and_head_variance_reference(q: Tensor, k: Tensor, pad: Tensor, scale: float,
                                                      window: int | None = None,
                                                      softcap: float | None = None,
                                                      lse: Tensor | None = None) -> tuple[Tensor, Tensor]:
    b, hq, t, _ = q.shape
    c = head_column_sums(q, k, pad, scale, window, softcap, lse=lse)      # [B, Hq, T]
    return c.reshape(b, k.shape[1], hq // k.shape[1], t).mean(dim=2), head_variance_of_sums(c, pad)


@torch.library.custom_op("kvpass::attention_column_sums_and_head_variance", mutates_args=())
def attention_column_sums_and_head_variance(q: Tensor, k: Tensor, pad: Tensor, scale: float,
                                            window: int | None = None,
                                            softcap: float | None = None,
                                            lse: Tensor | None = None) -> tuple[Tensor, Tensor]:
    return attention_column_sums_and_head_variance_reference(q, k, pad, scale, window, softcap, lse)


@attention_column_sums_and_head_variance.register_fake
def _(q, k, pad, scale, window=None, softcap=None, lse=None):
    return (q.new_empty(k.shape[0], k.shape[1], k.shape[2], dtype=torch.float32),
            q.new_empty(q.shape[0], q.shape[1], dtype=torch.float32))
