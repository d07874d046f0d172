"""Observation-window scores of the prefill, pooled over positions (SnapKV / PyramidKV;
docs/policies.md §6.3, §6.5, §0.4, §0.5).

For batch row b with n = T - pad[b] real tokens, KV head g and key j, with the observation window
W = the last ``obs_window`` real query rows (all real rows if the prompt is shorter):

    raw[b, g, j]    = mean_{h in group g} sum_{i in W} A_h[i, j]      for j before the window,
                      0 for j inside the window and for pad columns
    score[b, g, :]  = pool1d(raw[b, g, :], kernel, stride 1, padding kernel // 2), then 0 on pad columns

A_h is the prefill attention (causal, left pads, optional sliding window and softcap) in an fp32
softmax. Zeroing the window and pad columns before pooling is exactly SnapKV's zero padding of the
pooled slice ``attn[..., -w:, :-w]`` at both of its ends. ``pool``: "avg" (avg_pool1d, count
including padding, the official default) or "max". ``include_window=True`` keeps the window's own
columns (EMS's local score s_Loc over every key, §4.3; with ``kernel=1`` nothing is pooled). Only
the w window rows are ever formed: memory Hq * w * T, never T x T. Shapes: q: [B, Hq, T, D]; k: [B, Hkv, T, D]; pad: [B] int64
-> [B, Hkv, T] fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kvpass.kernels.prefill_attention import prefill_mask


def attention_window_scores_reference(q: Tensor, k: Tensor, pad: Tensor, scale: float, window: int | None = None,
                                      softcap: float | None = None, obs_window: int = 32, kernel: int = 5,
                                      pool: str = "avg", include_window: bool = False) -> Tensor:
    b, hq, t, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    w = min(obs_window, t)
    rows = slice(t - w, t)
    mask = prefill_mask(pad, t, window, rows=w)                        # [B, 1, w, T]
    qb = q[:, :, rows].float().reshape(b, hkv, group * w, d)
    s = torch.matmul(qb, k.float().transpose(-1, -2)) * scale          # [B, Hkv, G*w, T]
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s.reshape(b, hkv, group, w, t).masked_fill(~mask[:, :, None], float("-inf"))
    i = torch.arange(t - w, t, device=q.device)
    in_window_row = i[None, :] >= pad[:, None]                         # [B, w] real window rows
    p = torch.softmax(s, dim=-1) * in_window_row[:, None, None, :, None]
    raw = p.sum(dim=3).mean(dim=2)                                    # [B, Hkv, T]
    j = torch.arange(t, device=q.device)
    before_window = (j[None, :] >= pad[:, None]) & ((j[None, :] < (t - obs_window)) | include_window)   # [B, T]
    raw = raw * before_window[:, None, :]
    flat = raw.reshape(b * hkv, 1, t)
    if pool == "avg":
        pooled = F.avg_pool1d(flat, kernel, stride=1, padding=kernel // 2)
    elif pool == "max":
        pooled = F.max_pool1d(flat, kernel, stride=1, padding=kernel // 2)
    else:
        raise ValueError(f"pool must be 'avg' or 'max', got {pool!r}")
    real_col = (j[None, :] >= pad[:, None])[:, None, :]                # [B, 1, T]
    return (pooled[..., :t].reshape(b, hkv, t) * real_col).contiguous()


@torch.library.custom_op("kvpass::attention_window_scores", mutates_args=())
def attention_window_scores(q: Tensor, k: Tensor, pad: Tensor, scale: float, window: int | None = None,
                            softcap: float | None = None, obs_window: int = 32, kernel: int = 5,
                            pool: str = "avg", include_window: bool = False) -> Tensor:
    return attention_window_scores_reference(q, k, pad, scale, window, softcap, obs_window, kernel, pool,
                                             include_window)


@attention_window_scores.register_fake
def _(q, k, pad, scale, window=None, softcap=None, obs_window=32, kernel=5, pool="avg", include_window=False):
    return q.new_empty(k.shape[0], k.shape[1], k.shape[2], dtype=torch.float32)
