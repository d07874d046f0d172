"""Quantized cache entries (``kvpass.apply(..., kv_dtype="int8" | "fp8_e4m3")``, docs/quantization.md): the formats
(``formats``), a layer cache of 8-bit codes and per-(token, head) scales (``cache``), and any policy over it
(``policy``: ``QuantizedEntries``, imported from there). The decode graph's ops are ``kvpass.kernels``'
``write_kv_quantized``, ``decode_attention_quantized`` and ``dequantize_kv``."""

from kvpass.quantization.cache import (
           SCALES,
           dequantize_cache,
           entry_dtype,
           is_quantized,
           quantize_cache,
           requantize_like,
)
from kvpass.quantization.formats import KV_FORMATS, dequantize_entries, quantize_entries

__all__ = ["KV_FORMATS", "SCALES", "dequantize_cache", "dequantize_entries", "entry_dtype", "is_quantized",
           "quantize_cache", "quantize_entries", "requantize_like"]
