"""Observation-window scores of a prefill chunk over a layer's cache and the chunk (chunked prefill; SnapKV,
PyramidKV, D2O's scores="window", and with a window of one row TOVA's last attention; docs/policies.md §6.3).

``attention_window_scores`` for a chunk: the window W is the chunk's last ``obs_window`` real query rows
(all of them if the chunk is shorter), attending over the cache's C slots and the chunk's T keys with the
logits and masks of ``chunk_attention``. Over the live keys in sequence order (the cache's live slots
0..n_c - 1, then the chunk's real keys) for batch row b and KV head g:

    raw[b, g, j]  = mean_{h in group g} sum_{i in W} A_h[i, j]        for keys j before the window
                    (pos_last - position_j >= obs_window; every key with ``include_window``), else 0
    score         = pool1d(raw in that order, kernel, stride 1, zero padding kernel // 2), 0 off the live keys

then laid out as the inputs are: [B, Hkv, C + T] fp32, the cache's slots first (empty slots 0), then the
chunk's keys (pad keys 0). Pooling runs over the kept entries in sequence order: after an eviction the
neighbours of an entry need not be adjacent positions. With an empty cache this is
``attention_window_scores`` of the chunk. Only the window's rows are formed (memory Hq * w * (C + T)).
Shapes: q: [B, Hq, T, D]; k: [B, Hkv, T, D]; pad: [B] int64; k_cache: [B, Hkv, C, D]; log_weight:
[B, Hkv, C] fp32; position: [B, Hkv, C] int64; pos: [B, T] int64.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kvpass.cache import EMPTY
from kvpass.kernels.chunk_attention import chunk_logit_blocks


def chunk_window_scores_reference(q: Tensor, k: Tensor, pad: Tensor, k_cache: Tensor, log_weight: Tensor,
                                  position: Tensor, pos: Tensor, scale: float, window: int | None = None,
                                  softcap: float | None = None, obs_window: int = 32, kernel: int = 5,
                                  pool: str = "avg", include_window: bool = False) -> Tensor:
    if pool not in ("avg", "max"):
        raise ValueError(f"pool must be 'avg' or 'max', got {pool!r}")
    b, hq, t, _ = q.shape
    hkv, c = k_cache.shape[1], k_cache.shape[2]
    w = min(obs_window, t)
    rows = slice(t - w, t)
    (_, s), = chunk_logit_blocks(q, k, pad, k_cache, log_weight, position, pos, scale, window, softcap,
                                 block=w, rows=rows)                                  # [B, Hkv, G, w, C + T]
    real_row = torch.arange(t - w, t, device=q.device)[None, :] >= pad[:, None]       # [B, w]
    p = torch.softmax(s, dim=-1) * real_row[:, None, None, :, None]
    raw = p.sum(dim=3).mean(dim=2)                                                    # [B, Hkv, C + T]
    j = torch.arange(t, device=q.device)
    real_key = (j[None, :] >= pad[:, None])[:, None, :].expand(b, hkv, t)             # [B, Hkv, T]
    live = torch.cat([log_weight > EMPTY, real_key], dim=-1)                          # [B, Hkv, C + T]
    key_pos = torch.cat([position, pos[:, None, :].expand(b, hkv, t)], dim=-1)
    before = (pos[:, -1, None, None] - key_pos) >= obs_window
    raw = raw * (live & (before | include_window))
    # the live keys' places in sequence order: cache slot s -> s, chunk key j -> n_c + j - pad; the rest -> C + T
    n_cache = (log_weight > EMPTY).sum(-1, keepdim=True)                              # [B, Hkv, 1]
    slot = torch.arange(c + t, device=q.device)[None, None, :]
    order = torch.where(slot < c, slot, n_cache + slot - c - pad[:, None, None])
    order = torch.where(live, order, c + t)
    line = torch.zeros(b, hkv, c + t + 1, dtype=raw.dtype, device=q.device).scatter_add_(-1, order, raw)[..., :c + t]
    flat = line.reshape(b * hkv, 1, c + t)
    pooled = (F.avg_pool1d if pool == "avg" else F.max_pool1d)(flat, kernel, stride=1, padding=kernel // 2)
    pooled = pooled[..., :c + t].reshape(b, hkv, c + t)
    return (torch.gather(pooled, -1, order.clamp(max=c + t - 1)) * live).contiguous()


@torch.library.custom_op("kvpass::chunk_window_scores", mutates_args=())
def chunk_window_scores(q: Tensor, k: Tensor, pad: Tensor, k_cache: Tensor, log_weight: Tensor, position: Tensor,
                        pos: Tensor, scale: float, window: int | None = None, softcap: float | None = None,
                        obs_window: int = 32, kernel: int = 5, pool: str = "avg",
                        include_window: bool = False) -> Tensor:
    return chunk_window_scores_reference(q, k, pad, k_cache, log_weight, position, pos, scale, window, softcap,
                                         obs_window, kernel, pool, include_window)


@chunk_window_scores.register_fake
def _(q, k, pad, k_cache, log_weight, position, pos, scale, window=None, softcap=None, obs_window=32, kernel=5,
      pool="avg", include_window=False):
    return q.new_empty(k.shape[0], k.shape[1], k_cache.shape[2] + k.shape[2], dtype=torch.float32)
