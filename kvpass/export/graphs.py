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

from kvpass.cache import EMPTY_SLOT, ENTRY_FIELDS, LayerCache, with_capacity
from kvpass.policies.base import Policy
from kvpass.rewrites.insert_compressed_cache import RewrittenGraphs, prompt_cache

# The I/O name of each field of a cache entry (``kvpass.cache.ENTRY_FIELDS``): optimum's key / value for K, V.
IO_NAMES = {"k": "key", "v": "value"}


def state_names(layer: int, meta: tuple[str, ...], prefix: str, state: tuple[str, ...] = ()) -> list[str]:
    """I/O names of one layer's cache tensors (``ENTRY_FIELDS``), slot metadata, then per-layer policy state;
    prefix is "past" or "present"."""
    kv = "past_key_values" if prefix == "past" else "present"
    names = [f"{kv}.{layer}.{IO_NAMES[f]}" if f in IO_NAMES else f"{prefix}_{f}.{layer}" for f in ENTRY_FIELDS]
    return names + [f"{prefix}_{what}.{layer}" for what in (*meta, *state)]


def to_flat(cache: LayerCache, meta: tuple[str, ...], state: tuple[str, ...] = ()) -> list[Tensor]:
    return [getattr(cache, f) for f in ENTRY_FIELDS] + [cache.slot_meta[m] for m in meta] + \
        [cache.state[s] for s in state]


def from_flat(flat: list[Tensor] | tuple[Tensor, ...], meta: tuple[str, ...], state: tuple[str, ...] = ()) -> LayerCache:
    n, m = len(ENTRY_FIELDS), len(meta)
    rest = flat[n:]
    return LayerCache(**dict(zip(ENTRY_FIELDS, flat[:n], strict=True)),
                      slot_meta=dict(zip(meta, rest[:m], strict=True)), state=dict(zip(state, rest[m:], strict=True)))


def to_capacity(cache: LayerCache, capacity: int) -> LayerCache:
    """Same entries in ``capacity`` slots (``with_capacity`` without its check: the caller guarantees the cut
    slots are empty; static shapes only, no data-dependent branch); the cache itself where it fits."""
    return cache if cache.capacity == capacity else with_capacity(cache, capacity, check=False)


def fit_capacity(cache: LayerCache, capacity: int) -> LayerCache:
    """Same entries in ``capacity`` slots without a branch on the shapes (``capacity`` may be symbolic): every
    per-slot tensor gets ``capacity`` empty slots appended, then its first ``capacity`` slots are kept. The caller
    guarantees no live entry lies at or beyond ``capacity``."""

    def fit(t: Tensor, value) -> Tensor:
        shape = list(t.shape)
        shape[2] = capacity
        return torch.cat([t, t.new_full(shape, value)], dim=2)[:, :, :capacity]

    return LayerCache(**{f: fit(getattr(cache, f), fill) for f, fill in EMPTY_SLOT.items()}, length=cache.length,
                      slot_meta={n: fit(t, 0) for n, t in cache.slot_meta.items()}, state=dict(cache.state))


class PrefillGraph(nn.Module):
    """input_ids, position_ids: [B, T] int64; pad: [B] int64 -> logits [B, 1, V], then per layer the
    prompt's cache entries (capacity T, as ``prompt_cache`` lays them out for the runtime), its per-slot
    statistics, then its per-layer statistics (state). ``prefill`` is the functional form of
    ``graphs.prefill``."""

    def __init__(self, prefill: GraphModule, graphs: RewrittenGraphs, meta: dict[int, tuple[str, ...]],
                 state: dict[int, tuple[str, ...]]) -> None:
        super().__init__()
        self.prefill, self.meta, self.state = prefill, meta, state
        self._graphs = [graphs]                  # not a submodule: only its output layout is read

    def forward(self, input_ids: Tensor, position_ids: Tensor, pad: Tensor) -> tuple[Tensor, ...]:
        graphs = self._graphs[0]
        logits, kv, stats = graphs.split_prefill(self.prefill(input_ids, position_ids, pad))
        flat = [logits]
        for i, site in enumerate(graphs.sites):
            cache = prompt_cache(kv[2 * i], kv[2 * i + 1], pad, stats.get(site.layer, {}))
            flat += to_flat(cache, self.meta.get(site.layer, ()), self.state.get(site.layer, ()))
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


class RuntimeBudgetCompressGraph(nn.Module):
    """``CompressGraph`` whose budget and output capacity are inputs, for budgets resolved per prompt at run time
    (a fraction of prompt + new tokens, or per-layer budgets such as D2O's from the prompt's attention): the
    runner computes them as ``kvpass.apply``'s runtime does and passes them as the lengths of two inputs,
    ``budget_slots`` [keep] and ``capacity_slots`` [C] (their values are unused; ONNX has no integer scalars that
    shape a graph). Inputs after those two: one layer's cache tensors with any capacity N > keep, its slot
    metadata, then ``state``; outputs: the same tensors with C slots. The policy's ``compress`` runs with a
    symbolic ``keep``: ``kvpass.export.budgets.verify_runtime_budget_graph`` checks the traced graph against it
    over the budgets and capacities the runner can ask for (a policy that computes on its budget in Python, e.g.
    ``int(keep * ratio)``, is traced for one budget only, and refused)."""

    def __init__(self, policy: Policy, meta: tuple[str, ...], state: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.policy, self.meta, self.state = policy, meta, state

    def forward(self, budget_slots: Tensor, capacity_slots: Tensor, *tensors: Tensor) -> tuple[Tensor, ...]:
        keep, capacity = budget_slots.shape[0], capacity_slots.shape[0]
        out = self.policy.compress(from_flat(tensors, self.meta, self.state), keep)
        extra = set(out.state) - set(self.state)
        if extra:
            raise NotImplementedError(f"{self.policy.name}.compress created state {sorted(extra)} the export did not "
                                      "discover; seed it in the example (see graph_specs)")
        return tuple(to_flat(fit_capacity(out, capacity), self.meta, self.state))
