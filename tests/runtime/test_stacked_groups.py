"""Which layers the runtime compresses as one cache of stacked rows (``stacked_groups``)."""

from __future__ import annotations

import torch

import kvpass.runtime.layers as runtime
from kvpass.cache import LayerCache
from kvpass.runtime import Layer, stacked_groups


def layer(budget: int, capacity: int = 16, state: dict | None = None) -> Layer:
    cache = LayerCache.empty(2, 2, capacity, 4, torch.float32, "cpu")
    cache.state = dict(state or {})
    return Layer(cache, None, True, budget, capacity)


def names(groups, layers) -> list[list[int]]:
    return [[next(i for i, lay in enumerate(layers) if lay is g) for g in group] for group in groups]


def test_layers_of_one_budget_and_layout_share_a_group():
    layers = [layer(8), layer(6), layer(8), layer(8, capacity=20), layer(6)]
    assert names(stacked_groups(layers, True, None), layers) == [[0, 2], [1, 4], [3]]
    assert names(stacked_groups(layers, False, None), layers) == [[0], [1], [2], [3], [4]]


def test_state_not_per_batch_row_keeps_a_layer_alone():
    layers = [layer(8, state={"tau": torch.zeros(2, 2)}), layer(8, state={"tau": torch.zeros(2, 2)}),
              layer(8, state={"ema": torch.zeros(3)}), layer(8, state={"ema": torch.zeros(3)})]
    assert names(stacked_groups(layers, True, None), layers) == [[0, 1], [2], [3]]


def test_groups_respect_the_element_and_memory_caps(monkeypatch):
    layers = [layer(8) for _ in range(5)]
    k_elements, nbytes = layers[0].cache.k.numel(), layers[0].cache.nbytes()
    monkeypatch.setattr(runtime, "STACK_ELEMENTS", 2 * k_elements)
    assert names(stacked_groups(layers, True, None), layers) == [[0, 1], [2, 3], [4]]
    monkeypatch.setattr(runtime, "STACK_ELEMENTS", 2**30)
    assert names(stacked_groups(layers, True, 8 * 3 * nbytes), layers) == [[0, 1, 2], [3, 4]]
    monkeypatch.setattr(runtime, "STACK_BYTES", 4 * nbytes)
    assert names(stacked_groups(layers, True, None), layers) == [[0, 1, 2, 3], [4]]
    assert names(stacked_groups(layers, True, 0), layers) == [[0], [1], [2], [3], [4]]
