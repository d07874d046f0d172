"""Decode a quantized cache's K or V (kvpass/quantization) to the model's dtype: the decode graph's generic path for an
attention op that reads model-dtype K, V (the recall policies' page, cluster and slot-table ops).

    out[b, g, j, :] = codes[b, g, j, :] * scale[b, g, j]         (``dequantize_entries``, rounded to scale's dtype)

Shapes: codes [B, Hkv, C, D] int8 or float8_e4m3fn; scale [B, Hkv, C] (the model's dtype) -> [B, Hkv, C, D] in scale's
dtype. Traffic: reads B*Hkv*C*(D + 2) bytes and writes a model-dtype copy of one layer's K or V, each step (a dense
layer's attention reads the codes directly instead: ``decode_attention_quantized``). Plain torch on every device.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvpass.quantization.formats import dequantize_entries


def dequantize_kv_reference(codes: Tensor, scale: Tensor) -> Tensor:
    return dequantize_entries(codes, scale)


@torch.library.custom_op("kvpass::dequantize_kv", mutates_args=())
def dequantize_kv(codes: Tensor, scale: Tensor) -> Tensor:
    return dequantize_kv_reference(codes, scale)


@dequantize_kv.register_fake
def _(codes, scale):
    return codes.new_empty(codes.shape, dtype=scale.dtype)
