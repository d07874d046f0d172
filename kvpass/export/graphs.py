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
from kvpass.policies.base import Policy, Stat

BASE = ("key", "value", "log_weight", "length", "position")


def state_names(layer: int, meta: tuple[str, ...], prefix: str, state: tuple[str, ...] = ()) -> list[str]:
    """I/O names of one layer's cache tensors, slot metadata, then per-layer policy state;
    prefix is "past" or "present"."""
    kv = "past_key_values" if prefix == "past" else "present"
    names = [f"{kv}.{layer}.key", f"{kv}.{layer}.value"]
    return names + [f"{prefix}_{what}.{layer}" for what in (*BASE[2:], *meta, *state)]


def to_flat(cache: LayerCache, meta: tuple[str, ...], state: tuple[str, ...] = ()) -> list[Tensor]:
    return [cache.k, cache.v, cache.log_weight, cache.length, cache.position,
            *(cache.slot_meta[m] for m in meta), *(cache.state[s] for s in state)]


def from_flat(flat: list[Tensor] | tuple[Tensor, ...], meta: tuple[str, ...], state: tuple[str, ...] = ()) -> LayerCache:
    k, v, lw, length, position, *rest = flat
    n = len(meta)
    return LayerCache(k=k, v=v, log_weight=lw, length=length, position=position,
                      slot_meta=dict(zip(meta, rest[:n], strict=True)), state=dict(zip(state, rest[n:], strict=True)))


def per_slot(stat_name: str) -> bool:
    """Whether a prefill statistic is per cache slot ([B, Hkv, T], kept in slot_meta) or per layer / head
    (kept in LayerCache.state). Policies' Stat members may say so with a ``per_slot`` attribute."""
    try:
        return bool(getattr(Stat(stat_name), "per_slot", True))
    except ValueError:
        return True


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
    prompt's cache entries (capacity T), its per-slot statistics, then its per-layer statistics (state).
    ``prefill`` is the functional prefill graph."""

    def __init__(self, prefill: GraphModule, n_layers: int, stats: tuple[tuple[int, str], ...],
                 meta: dict[int, tuple[str, ...]], state: dict[int, tuple[str, ...]]) -> None:
        super().__init__()
        self.prefill, self.n_layers, self.stats, self.meta, self.state = prefill, n_layers, stats, meta, state

    def forward(self, input_ids: Tensor, position_ids: Tensor, pad: Tensor) -> tuple[Tensor, ...]:
        outs = self.prefill(input_ids, position_ids, pad)
        n = self.n_layers
        stat_values: dict[int, dict[str, Tensor]] = {}
        for (layer, name), value in zip(self.stats, outs[1 + 2 * n:], strict=True):
            stat_values.setdefault(layer, {})[name] = value
        flat = [outs[0]]
        for layer in range(n):
            values = stat_values.get(layer, {})
            cache = entries_from_prompt(outs[1 + 2 * layer], outs[2 + 2 * layer], pad,
                                        {n: values[n] for n in self.meta.get(layer, ())})
            cache.state = {n: values[n] for n in self.state.get(layer, ())}
            flat += to_flat(cache, self.meta.get(layer, ()), self.state.get(layer, ()))
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
    Inputs: that layer's cache tensors with any capacity N, slot metadata, then ``state`` (per-layer policy
    data such as an EMA threshold [B]); outputs: the same tensors, ``capacity`` slots."""

    def __init__(self, policy: Policy, keep: int, capacity: int, meta: tuple[str, ...],
                 state: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.policy, self.keep, self.capacity, self.meta, self.state = policy, keep, capacity, meta, state

    def forward(self, *tensors: Tensor) -> tuple[Tensor, ...]:
        out = self.policy.compress(from_flat(tensors, self.meta, self.state), self.keep)
        extra = set(out.state) - set(self.state)
        if extra:
            raise NotImplementedError(f"{self.policy.name}.compress created state {sorted(extra)} the export did not "
                                      "discover; seed it in the example (see graph_specs)")
        return tuple(to_flat(to_capacity(out, self.capacity), self.meta, self.state))
