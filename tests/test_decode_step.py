from __future__ import annotations

import torch

from kvpass.cache import LayerCache, load_into, with_capacity
from kvpass.decode_step import StaticDecodeStep, capture_key, step_input_indices


def _inputs(cache: LayerCache, step: int) -> list[torch.Tensor]:
    ids = torch.full((1, 1), step)
    pos = torch.full((1, 1), 10 + step)
    slot = cache.length.clone()
    return [ids, pos, cache.k, cache.v, cache.log_weight, slot]


def test_step_inputs_are_ids_positions_and_slots():
    assert step_input_indices(2 + 3 * 4, 4) == {0, 1, 5, 9, 13}
    assert step_input_indices(2 + 2 * 5, 5) == {0, 1, 5, 10}


def test_capture_key_changes_only_when_a_persistent_buffer_changes():
    cache = LayerCache.empty(1, 2, 8, 4, torch.float32, "cpu")
    idx = step_input_indices(6, 4)
    key = capture_key(_inputs(cache, 0), idx)
    assert capture_key(_inputs(cache, 1), idx) == key                  # new step tensors, same buffers
    other = LayerCache.empty(1, 2, 8, 4, torch.float32, "cpu")
    other.k.normal_()
    other.length.fill_(3)
    load_into(cache, other)                                            # compression writes in place
    assert capture_key(_inputs(cache, 2), idx) == key
    grown = with_capacity(cache, 12)                                   # a reallocated buffer
    assert capture_key(_inputs(grown, 2), idx) != key
    bigger = _inputs(cache, 3)
    bigger[0] = torch.zeros(2, 1, dtype=torch.long)                    # a step input of a new shape
    assert capture_key(bigger, idx) != key


def test_cpu_falls_back_to_eager():
    calls = []

    def decode(*args):
        calls.append(args)
        return (args[0] * 2,)

    step = StaticDecodeStep(decode, per_layer=4)
    cache = LayerCache.empty(1, 2, 8, 4, torch.float32, "cpu")
    out = step(*_inputs(cache, 3))
    assert torch.equal(out[0], torch.full((1, 1), 6))
    assert len(calls) == 1 and step.captures == 0
