"""Accumulated attention column sums of the prefill (H2O, D2O, CaM, KVMerger; policies.md §0.4).

For batch b, KV head g and key j:

    col_sum[b, g, j] = mean_{h in group g} sum_i A_h[i, j]

where A_h is the prefill attention of query head h with the mask of ``prefill_attention``
(causal, left pads, optional window, optional softcap). Pad query rows contribute nothing.
Computed in blocks of query rows with an fp32 softmax: never materialises the T x T matrix of
all heads at once. Shapes: q: [B, Hq, T, D]; k: [B, Hkv, T, D]; pad: [B] int64 -> [B, Hkv, T] fp32.
"""

from __future__ import annotations

import torch
from kvpass.kernels.prefill_attention import prefill_mask
from torch import Tensor


def head_column_sums(q: Tensor, k: Tensor, pad: Tensor, scale: float, window: int | None = None,
                     softcap: float | None = None, block: int = 256) -> Tensor:
    """c[b, h, j] = sum over real query rows i of A_h[i, j], per query head: [B, Hq, T] fp32.
    Row blocks of ``block`` queries with an fp32 softmax over the keys up to the block's last row (the
    later ones are masked anyway); pad query rows contribute nothing."""
    b, hq, t, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    mask = prefill_mask(pad, t, window)                                  # [B, 1, T, T]
    real_row = torch.arange(t, device=q.device)[None, :] >= pad[:, None]  # [B, T]
    kf = k.float()
    out = torch.zeros(b, hq, t, dtype=torch.float32, device=q.device)
    for start in range(0, t, block):
        rows = slice(start, start + block)
        nrows = q[:, :, rows].shape[2]
        end = start + nrows                       # causal: rows < end attend to keys < end only
        qb = q[:, :, rows].float().reshape(b, hkv, group * nrows, d)
        s = torch.matmul(qb, kf[:, :, :end].transpose(-1, -2)) * scale     # [B, Hkv, G*rows, end]
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        s = s.reshape(b, hkv, group, nrows, end).masked_fill(~mask[:, :, None, rows, :end], float("-inf"))
        p = torch.softmax(s, dim=-1) * real_row[:, None, None, rows, None]
        out[:, :, :end] += p.sum(dim=3).reshape(b, hq, end)
    return out


def attention_column_sums_reference(q: Tensor, k: Tensor, pad: Tensor, scale: float, window: int | None = None,
                                    softcap: float | None = None, block: int = 256) -> Tensor:
    b, hq, t, _ = q.shape
    hkv = k.shape[1]
    return head_column_sums(q, k, pad, scale, window, softcap, block).reshape(b, hkv, hq // hkv, t).mean(dim=2)


@torch.library.custom_op("kvpass::attention_column_sums", mutates_args=())
def attention_column_sums(q: Tensor, k: Tensor, pad: Tensor, scale: float, window: int | None = None,
                          softcap: float | None = None) -> Tensor:
    return attention_column_sums_reference(q, k, pad, scale, window, softcap)


@attention_column_sums.register_fake
def _(q, k, pad, scale, window=None, softcap=None):
    return q.new_empty(k.shape[0], k.shape[1], k.shape[2], dtype=torch.float32)
