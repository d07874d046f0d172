"""Prefill attention that also returns each query row's log-sum-exp, for the column-sum statistics.

Same attention as ``prefill_attention`` (causal, left pads, optional window and softcap; see there),
plus, for query head h of batch row b and row i, in base 2 (s2 = log2 e * s):

    lse2[b, h, i] = log2 sum_{j allowed(i, j)} 2^(s2_ij)        (+inf on pad rows: they add nothing)

``attention_column_sums`` (and its head-variance twin) take lse2 and then need only the column pass,
``c_j = sum_i 2^(s2_ij - lse2_i)``: the rows' normalisers come with the attention instead of from a
pass of their own over the n x n logits. Shapes: q: [B, Hq, T, D]; k, v: [B, Hkv, T, D]; pad: [B]
int64. Returns (o [B, Hq, T, D], lse2 [B, Hq, T] fp32).

On CUDA, for a prompt without pads, window or softcap, both come from one cuDNN attention call (the
kernel SDPA itself picks on Hopper, which returns the log-sum-exp at no extra cost; measured on an
H200 at 32k: 14.6 ms per layer with or without it). Otherwise, or where cuDNN refuses the shapes:
SDPA for o and the Triton row pass (``row_lse_triton``) for lse2. On CPU, for a prompt without pads,
window or softcap, both come from the flash kernel SDPA runs there (the same o, bit for bit); otherwise
the plain-torch reference.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from kvpass.kernels._triton import HAS_TRITON
from kvpass.kernels.attention_column_sums import masked_logit_blocks, row_lse_triton
from kvpass.kernels.decode_attention import LOG2E
from kvpass.kernels.prefill_attention import in_q_layout, plain_causal, prefill_attention_reference

log = logging.getLogger(__name__)


def row_lse_reference(q: Tensor, k: Tensor, pad: Tensor, scale: float, window: int | None = None,
                      softcap: float | None = None, block: int = 256) -> Tensor:
    """lse2 [B, Hq, T] in plain torch over ``masked_logit_blocks``, fp32 (float64 for float64)."""
    b, hq, t, _ = q.shape
    pad_row = torch.arange(t, device=q.device)[None, :] < pad[:, None]     # [B, T]
    out = torch.empty(b, hq, t, dtype=torch.float64 if q.dtype == torch.float64 else torch.float32, device=q.device)
    for rows, s in masked_logit_blocks(q, k, pad, scale, window, softcap, block):
        out[:, :, rows] = torch.logsumexp(s, dim=-1).reshape(b, hq, -1) * LOG2E
    return out.masked_fill(pad_row[:, None, :], float("inf"))


def prefill_attention_lse_reference(q: Tensor, k: Tensor, v: Tensor, pad: Tensor, scale: float,
                                    window: int | None = None, softcap: float | None = None) -> tuple[Tensor, Tensor]:
    return (prefill_attention_reference(q, k, v, pad, scale, window, softcap),
            row_lse_reference(q, k, pad, scale, window, softcap))


def _cudnn_attention_lse(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor] | None:
    """(o, lse2) of causal attention from cuDNN, or None where it is not available for these inputs."""
    op = getattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention", None)
    if op is None or not torch.backends.cudnn.is_available() or q.dtype not in (torch.float16, torch.bfloat16):
        return None
    try:
        res = op(q, k, v, None, True, 0.0, True, False, scale=scale)
    except RuntimeError as exc:                         # shapes/strides this cuDNN does not take
        log.debug("cuDNN attention with log-sum-exp unavailable (%s); using SDPA + the row pass", exc)
        return None
    o, lse = res[0], res[1]
    return in_q_layout(o, q), (lse.reshape(q.shape[:3]).float() * LOG2E).contiguous()


def prefill_attention_lse_cuda(q: Tensor, k: Tensor, v: Tensor, pad: Tensor, scale: float,
                               window: int | None = None, softcap: float | None = None) -> tuple[Tensor, Tensor]:
    if plain_causal(pad, window, softcap):
        got = _cudnn_attention_lse(q, k, v, scale)
        if got is not None:
            return got
    return (in_q_layout(prefill_attention_reference(q, k, v, pad, scale, window, softcap), q),
            row_lse_triton(q, k, pad, scale, window, softcap))


def prefill_attention_lse_cpu(q: Tensor, k: Tensor, v: Tensor, pad: Tensor, scale: float,
                              window: int | None = None, softcap: float | None = None) -> tuple[Tensor, Tensor]:
    """(o, lse2) on CPU: one call of SDPA's CPU flash kernel, which returns the log-sum-exp, where the
    prompt has no pads, window or softcap (its mask must be causal); else the reference."""
    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if op is None or not plain_causal(pad, window, softcap):
        return prefill_attention_lse_reference(q, k, v, pad, scale, window, softcap)
    group = q.shape[1] // k.shape[1]
    o, lse = op(q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), 0.0, True, scale=scale)
    lse2 = (lse * LOG2E).to(torch.float64 if q.dtype == torch.float64 else torch.float32)
    return in_q_layout(o, q), lse2.contiguous()        # the kernel's lse is [B, T, H] in memory; the fake's is not


@torch.library.custom_op("kvpass::prefill_attention_lse", mutates_args=())
def prefill_attention_lse(q: Tensor, k: Tensor, v: Tensor, pad: Tensor, scale: float,
                          window: int | None = None, softcap: float | None = None) -> tuple[Tensor, Tensor]:
    return prefill_attention_lse_reference(q, k, v, pad, scale, window, softcap)


@prefill_attention_lse.register_fake
def _(q, k, v, pad, scale, window=None, softcap=None):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@prefill_attention_lse.register_kernel("cpu")
def _(q, k, v, pad, scale, window=None, softcap=None):
    return prefill_attention_lse_cpu(q, k, v, pad, scale, window, softcap)


if HAS_TRITON:
    @prefill_attention_lse.register_kernel("cuda")
    def _(q, k, v, pad, scale, window=None, softcap=None):
        return prefill_attention_lse_cuda(q, k, v, pad, scale, window, softcap)
