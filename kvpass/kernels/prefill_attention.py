"""Prefill attention over the whole (left-padded) prompt.

For batch row b with ``pad[b]`` left pads, query i and key j (0 <= i, j < T) of query head h
(KV head g = h // G, G = Hq / Hkv):

    allowed(i, j) = pad[b] <= j <= i  and  (window is None or i - j < window)
    s_ij = scale * q_i . k_j                      (softcap c: s_ij = c * tanh(s_ij / c))
    o_i  = sum_j softmax_j(s_ij | allowed) v_j

Pad query rows (i < pad[b]) attend to themselves only, so nothing is NaN; their outputs are never
read. Shapes: q: [B, Hq, T, D]; k, v: [B, Hkv, T, D]; pad: [B] int64. Returns o: [B, Hq, T, D].
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary


def prefill_mask(pad: Tensor, t: int, window: int | None, rows: int | None = None) -> Tensor:
    """Boolean mask [B, 1, T, T], True where query i may attend key j (see the module docstring); with ``rows``,
    only the last ``rows`` query rows: [B, 1, rows, T] (an observation window's, without forming T x T).
    Written with and/or only, no boolean where, so the ONNX export can use it as it is."""
    i = torch.arange(t - (t if rows is None else rows), t, device=pad.device)[:, None]
    j = torch.arange(t, device=pad.device)[None, :]
    allowed = (j <= i)[None] & (j[None] >= pad[:, None, None])
    if window is not None:
        allowed = allowed & ((i - j) < window)[None]
    is_pad_row = i[None] < pad[:, None, None]                         # [B, T, 1]
    allowed = (is_pad_row & (i == j)[None]) | (~is_pad_row & allowed)
    return allowed[:, None]


def _softcapped_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float, softcap: float,
                          block: int = 256) -> Tensor:
    """Attention with tanh logit capping, in query blocks of `block` rows (fp32 softmax)."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    out = torch.empty_like(q)
    for start in range(0, q.shape[2], block):
        rows = slice(start, start + block)
        s = torch.matmul(q[:, :, rows].float(), k.float().transpose(-1, -2)) * scale
        s = softcap * torch.tanh(s / softcap)
        s = s.masked_fill(~mask[:, :, rows], float("-inf"))
        out[:, :, rows] = torch.matmul(torch.softmax(s, dim=-1), v.float()).to(q.dtype)
    return out


# pad tensor -> (its version, whether any row has pads) while the tensor lives
_HAS_PADS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def has_pads(pad: Tensor) -> bool:
    """``bool(pad.any())``, read on the host once per pad tensor (and in-place version). Every layer's attention
    of one forward gets the same ``pad``: reading it once, not once a layer, lets the host queue the layers ahead
    of the GPU instead of waiting for each (on CUDA each read is a device sync)."""
    seen = _HAS_PADS.get(pad)
    if seen is not None and seen[0] == pad._version:
        return seen[1]
    got = bool(pad.any())
    _HAS_PADS[pad] = (pad._version, got)
    return got


def plain_causal(pad: Tensor, window: int | None, softcap: float | None) -> bool:
    """No pads, window or softcap: the mask is plain causal, which fused attention kernels (SDPA's
    flash kernels, cuDNN) apply themselves, without a T x T mask. Reads ``pad`` on the host (``has_pads``)."""
    return window is None and softcap is None and not has_pads(pad)


def in_q_layout(o: Tensor, q: Tensor) -> Tensor:
    """``o`` with q's strides, the layout the prefill ops declare (their fakes are ``empty_like(q)``):
    SDPA's kernels return their own (on CUDA in float32, [B, T, H, D] in memory), which torch.compile
    rejects against the fake."""
    return o if o.stride() == q.stride() else torch.empty_like(q).copy_(o)


def _sdpa(q: Tensor, k: Tensor, v: Tensor, **kwargs) -> Tensor:
    """SDPA with k, v of Hkv <= Hq heads. On CUDA in float32 only the memory-efficient kernel avoids a
    [B, Hq, T, T] score tensor, and it does not take ``enable_gqa`` (SDPA would fall back to its math
    kernel: 8k tokens x 6 rows x 9 heads of fp32 scores, 14 GiB a layer), so there the KV heads are
    repeated first (G times the K, V of one layer, small next to the scores). Elsewhere: enable_gqa."""
    group = q.shape[1] // k.shape[1]
    if group > 1 and q.is_cuda and q.dtype == torch.float32:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        group = 1
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=group > 1, **kwargs)


def prefill_attention_reference(q: Tensor, k: Tensor, v: Tensor, pad: Tensor, scale: float,
                                window: int | None = None, softcap: float | None = None) -> Tensor:
    if plain_causal(pad, window, softcap):                # SDPA's fused (flash) kernels, no T x T mask
        return _sdpa(q, k, v, is_causal=True, scale=scale)
    mask = prefill_mask(pad, q.shape[2], window)
    if softcap is not None:
        return _softcapped_attention(q, k, v, mask, scale, softcap)
    return _sdpa(q, k, v, attn_mask=mask, scale=scale)


@torch.library.custom_op("kvpass::prefill_attention", mutates_args=())
def prefill_attention(q: Tensor, k: Tensor, v: Tensor, pad: Tensor, scale: float,
                      window: int | None = None, softcap: float | None = None) -> Tensor:
    return in_q_layout(prefill_attention_reference(q, k, v, pad, scale, window, softcap), q)


@prefill_attention.register_fake
def _(q, k, v, pad, scale, window=None, softcap=None):
    return torch.empty_like(q)
