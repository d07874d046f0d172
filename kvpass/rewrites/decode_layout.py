"""The decode graph's inputs: which tensors each attention site takes, in order, as the rewrite lays them out
(``insert_compressed_cache.build_decode``) and the runtime passes them (``kvpass.runtime.session``).

After input_ids [B, 1] and position_ids [B, 1], each site in order takes ``LayerInputs.names``, placeholders
``{name}_{layer}``: the cache (k_cache, v_cache, log_weight, slot, position), the scales of a quantized cache's
entries (k_scale, v_scale: ``kvpass.apply(..., kv_dtype=...)``, kvpass/quantization), then for a full-attention layer the
policy's ``decode_inputs`` (slot metadata or state of its cache), the full-head group of a split layer (k_full ...
position_full: ``Policy.full_kv_heads``), the ring of a layer whose scores are deferred (recent_query,
recent_position) and the state of a layer whose attention seeks nearest keys (``NEAREST_INPUTS``). Every name
other than the cache's and the full group's is looked up in the layer cache's ``slot_meta``, then its ``state``.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from kvpass.cache import LayerCache

CACHE_INPUTS = ("k_cache", "v_cache", "log_weight", "slot", "position")
FULL_INPUTS = ("k_full", "v_full", "log_weight_full", "slot_full", "position_full")
SCALE_INPUTS = ("k_scale", "v_scale")                   # a quantized cache's slot metadata (kvpass/quantization)
RECENT_INPUTS = ("recent_query", "recent_position")     # a deferred-score layer's ring (kvpass/runtime/recent_queries.py)
_FIELDS = {"k": "k", "v": "v", "log_weight": "log_weight", "position": "position"}


@dataclass(frozen=True)
class LayerInputs:
    """One attention site's decode inputs: ``layer`` (the decoder layer), ``policy`` (the policy's own inputs),
    whether it has a full-head group, a deferred-score ring and the nearest-key search state (``nearest``: their
    names, in the decode op's order), and whether its cache holds quantized entries (``quantized``: their scales)."""

    layer: int
    policy: tuple[str, ...] = ()
    full: bool = False
    recent: bool = False
    nearest: tuple[str, ...] = ()
    quantized: bool = False

    @property
    def names(self) -> tuple[str, ...]:
        return (CACHE_INPUTS + (SCALE_INPUTS if self.quantized else ()) + self.policy + (FULL_INPUTS if self.full else ())
                + (RECENT_INPUTS if self.recent else ()) + self.nearest)

    def tensors(self, cache: LayerCache, full: LayerCache | None, slot: Tensor) -> list[Tensor]:
        """The tensors to pass for ``names``: the layer's ``cache``, its full-head group ``full`` and this step's
        write ``slot`` [B, Hkv] int64."""
        return [_tensor(name, cache, full, slot) for name in self.names]


def _tensor(name: str, cache: LayerCache, full: LayerCache | None, slot: Tensor) -> Tensor:
    if name == "slot":
        return slot
    if name in FULL_INPUTS:
        field = name.removesuffix("_full")
        return full.length if field == "slot" else getattr(full, _FIELDS[field])
    if name in CACHE_INPUTS:
        return getattr(cache, _FIELDS[name.removesuffix("_cache")])
    return cache.slot_meta[name] if name in cache.slot_meta else cache.state[name]


@dataclass(frozen=True)
class DecodeLayout:
    """Every site's ``LayerInputs``, in the sites' order."""

    layers: tuple[LayerInputs, ...]

    def placeholders(self) -> list[str]:
        return [f"{name}_{lay.layer}" for lay in self.layers for name in lay.names]

    @property
    def deferred(self) -> tuple[int, ...]:
        return tuple(lay.layer for lay in self.layers if lay.recent)

    @property
    def nearest(self) -> tuple[int, ...]:
        return tuple(lay.layer for lay in self.layers if lay.nearest)
