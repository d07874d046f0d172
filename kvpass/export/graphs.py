"""The three exportable graphs as ``nn.Module``s with flat tensor inputs and outputs, and their I/O names.

Names follow the optimum / onnxruntime-genai convention for the cache, plus kvpass's state:

    past_key_values.{l}.key / .value  ->  present.{l}.key / .value      [B, Hkv, C_l, D]
    past_log_weight.{l}               ->  present_log_weight.{l}        [B, Hkv, C_l] fp32
    past_length.{l}                   ->  present_length.{l}            [B, Hkv] int64
    past_position.{l}                 ->  present_position.{l}          [B, Hkv, C_l] int64
    past_{meta}.{l}                   ->  present_{meta}.{l}            policy slot data, e.g. col_sum

prefill: (input_ids, position_ids, pad) -> (logits, present.* with C_l = T: the prompt's entries,
         left pads compacted away, as ``kvpass.cache.entries_from_prompt`` lays them out)
decode:  (input_ids, position_ids, past.* of every layer) -> (logits, present.* of every layer)
compress (one layer): (past.* with any capacity N) -> (present.* with capacity C = keep + interval)
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.fx import GraphModule

from kvpass.cache import LayerCache, entries_from_prompt, keep_slots
from kvpass.policies.base import Policy

BASE = ("key", "value", "log_weight", "length", "position")


def state_names(layer: int, meta: tuple[str, ...], prefix: str) -> list[str]:
    """I/O names of one layer's state; prefix is "past" or "present"."""
    kv = "past_key_values" if prefix == "past" else "present"
    names = [f"{kv}.{layer}.key", f"{kv}.{layer}.value"]
    return names + [f"{prefix}_{what}.{layer}" for what in (*BASE[2:], *meta)]


def to_flat(cache: LayerCache, meta: tuple[str, ...]) -> list[Tensor]:
    return [cache.k, cache.v, cache.log_weight, cache.length, cache.position, *(cache.slot_meta[m] for m in meta)]


def from_flat(flat: list[Tensor] | tuple[Tensor, ...], meta: tuple[str, ...]) -> LayerCache:
    k, v, lw, length, position, *rest = flat
    return LayerCache(k=k, v=v, log_weight=lw, length=length, position=position, slot_meta=dict(zip(meta, rest, strict=True)))


def to_capacity(cache: LayerCache, capacity: int) -> LayerCache:
    """Same entries in ``capacity`` slots: pads with empty slots, or keeps the first ``capacity``
    slots (the caller guarantees the cut ones are empty). Static shapes only: no data-dependent check."""
    c = cache.capacity
    if c == capacity:
        return cache
    if c > capacity:
        idx = torch.arange(capacity, device=cache.k.device).expand(*cache.length.shape, capacity)
        return keep_slots(cache, idx)

    def grow(t: Tensor, value) -> Tensor:
        shape = list(t.shape)
        shape[2] = capacity - c
        return torch.cat([t, t.new_full(shape, value)], dim=2)

    return LayerCache(k=grow(cache.k, 0), v=grow(cache.v, 0), log_weight=grow(cache.log_weight, float("-inf")),
                      length=cache.length, position=grow(cache.position, -1),
                      slot_meta={n: grow(t, 0) for n, t in cache.slot_meta.items()}, state=dict(cache.state))


class PrefillGraph(nn.Module):
    """input_ids, position_ids: [B, T] int64; pad: [B] int64 -> logits [B, 1, V], then per layer the
    prompt's cache entries (capacity T). ``prefill`` is the functional prefill graph."""

    def __init__(self, prefill: GraphModule, n_layers: int, stats: tuple[tuple[int, str], ...],
                 meta: dict[int, tuple[str, ...]]) -> None:
        super().__init__()
        self.prefill, self.n_layers, self.stats, self.meta = prefill, n_layers, stats, meta

    def forward(self, input_ids: Tensor, position_ids: Tensor, pad: Tensor) -> tuple[Tensor, ...]:
        outs = self.prefill(input_ids, position_ids, pad)
        n = self.n_layers
        stat_values: dict[int, dict[str, Tensor]] = {}
        for (layer, name), value in zip(self.stats, outs[1 + 2 * n:], strict=True):
            stat_values.setdefault(layer, {})[name] = value
        flat = [outs[0]]
        for layer in range(n):
            cache = entries_from_prompt(outs[1 + 2 * layer], outs[2 + 2 * layer], pad, stat_values.get(layer, {}))
            flat += to_flat(cache, self.meta.get(layer, ()))
        return tuple(flat)


class DecodeGraph(nn.Module):
    """The functional decode graph (``kvpass.rewrites.functional_graphs.functional_decode``)."""

    def __init__(self, decode: GraphModule) -> None:
        super().__init__()
        self.decode = decode

    def forward(self, input_ids: Tensor, position_ids: Tensor, *state: Tensor) -> tuple[Tensor, ...]:
        return tuple(self.decode(input_ids, position_ids, *state))


class CompressGraph(nn.Module):
    """One layer's ``policy.compress(cache, keep)`` followed by a resize to ``capacity`` slots.
    Inputs: that layer's state with any capacity N; outputs: the same tensors with ``capacity`` slots."""

    def __init__(self, policy: Policy, keep: int, capacity: int, meta: tuple[str, ...]) -> None:
        super().__init__()
        self.policy, self.keep, self.capacity, self.meta = policy, keep, capacity, meta

    def forward(self, *state: Tensor) -> tuple[Tensor, ...]:
        out = self.policy.compress(from_flat(state, self.meta), self.keep)
        if out.state:
            raise NotImplementedError(f"{self.policy.name} keeps per-layer state; export does not carry it yet")
        return tuple(to_flat(to_capacity(out, self.capacity), self.meta))
