"""A layer cache whose entries are 8-bit codes (``kvpass.quantization.formats``), and the round trip every policy's
compression takes through the model's dtype.

A quantized ``LayerCache`` holds k, v: [B, Hkv, C, D] int8 or float8_e4m3fn codes and two slot metadata tensors
``k_scale``, ``v_scale``: [B, Hkv, C] in the model's dtype (``SCALES``); being slot metadata, every slot operation of
``kvpass.cache`` (gather, keep, put, rows, capacity) moves them with their entries, and an empty slot's are 0.

``dequantize_cache`` gives the cache a policy sees: the same slots with k, v decoded to the model's dtype and the scales
gone. ``requantize_like`` encodes what the policy returned, reusing the codes and scale of every entry it kept as it was
(found by its position, its K and V equal to their decoding): an eviction or a move loses nothing, however often a
layer is compressed; a merged (or otherwise new) entry is encoded afresh.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvpass.cache import LayerCache, bits, gather_slots
from kvpass.quantization.formats import dequantize_entries, format_of, quantize_entries

SCALES = ("k_scale", "v_scale")


def is_quantized(cache: LayerCache) -> bool:
    return SCALES[0] in cache.slot_meta


def entry_dtype(cache: LayerCache) -> torch.dtype:
    """The dtype the cache's entries stand for: the model's (the scales' for a quantized cache, else K's)."""
    return cache.slot_meta[SCALES[0]].dtype if is_quantized(cache) else cache.k.dtype


def quantize_cache(cache: LayerCache, kv_dtype: str) -> LayerCache:
    """The cache with its K, V encoded (``quantize_entries`` per slot) and their scales added to its slot metadata;
    every other tensor is the cache's own. An empty slot's codes and scales are 0 (its K, V are)."""
    k, k_scale = quantize_entries(cache.k, kv_dtype)
    v, v_scale = quantize_entries(cache.v, kv_dtype)
    return LayerCache(k=k, v=v, log_weight=cache.log_weight, length=cache.length, position=cache.position,
                      slot_meta={**cache.slot_meta, SCALES[0]: k_scale, SCALES[1]: v_scale}, state=cache.state)


def dequantize_cache(cache: LayerCache) -> LayerCache:
    """A quantized cache as the policies see it: K, V [B, Hkv, C, D] in the model's dtype, the scales gone from its slot
    metadata; the other tensors are the cache's own (a pure policy leaves them as they are)."""
    meta = {n: t for n, t in cache.slot_meta.items() if n not in SCALES}
    return LayerCache(k=dequantize_entries(cache.k, cache.slot_meta[SCALES[0]]),
                      v=dequantize_entries(cache.v, cache.slot_meta[SCALES[1]]), log_weight=cache.log_weight,
                      length=cache.length, position=cache.position, slot_meta=meta, state=cache.state)


def _source_slots(out_position: Tensor, src_position: Tensor) -> tuple[Tensor, Tensor]:
    """For each slot of ``out_position`` [B, Hkv, K], the slot of ``src_position`` [B, Hkv, C] (same row) holding the
    same position: (index [B, Hkv, K] int64, found [B, Hkv, K] bool; found is False for an empty slot, position -1)."""
    big = torch.iinfo(torch.long).max
    keyed = torch.where(src_position < 0, big, src_position)
    ordered, order = keyed.sort(dim=-1)
    at = torch.searchsorted(ordered, out_position.contiguous()).clamp(max=src_position.shape[-1] - 1)
    found = (ordered.gather(-1, at) == out_position) & (out_position >= 0)
    return order.gather(-1, at), found


def requantize_like(out: LayerCache, src: LayerCache) -> LayerCache:
    """``out`` (a policy's result over ``dequantize_cache(src)``, K, V in the model's dtype) encoded in ``src``'s format.
    Where an entry of ``out`` is one of ``src``'s, unchanged (the slot of ``src`` at its position decodes to exactly its
    K, or V), its codes and scale are ``src``'s; every other entry is encoded afresh. K and V are decided apart."""
    kv_dtype = format_of(src.k)
    idx, found = _source_slots(out.position, src.position)
    meta = dict(out.slot_meta)
    coded = {}
    for name, scale_name in zip(("k", "v"), SCALES, strict=True):
        x = getattr(out, name)
        fresh, fresh_scale = quantize_entries(x, kv_dtype)
        old = gather_slots(getattr(src, name), idx)                      # [B, Hkv, K, D] codes
        old_scale = gather_slots(src.slot_meta[scale_name], idx)          # [B, Hkv, K]
        same = found & (dequantize_entries(old, old_scale, x.dtype) == x).all(-1)
        picked = torch.where(same[..., None], bits(old), bits(fresh))       # (float8 as its bytes: any device)
        coded[name] = picked if picked.dtype == old.dtype else picked.view(old.dtype)
        meta[scale_name] = torch.where(same, old_scale, fresh_scale)
    return LayerCache(k=coded["k"], v=coded["v"], log_weight=out.log_weight, length=out.length, position=out.position,
                      slot_meta=meta, state=out.state)
