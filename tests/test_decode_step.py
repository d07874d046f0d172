from __future__ import annotations

import pytest
import torch

import kvpass
import kvpass.decode_step as ds
from kvpass.bench import TINY_LLAMA, build_model
from kvpass.cache import LayerCache, load_into, with_capacity
from kvpass.decode_step import StaticDecodeStep, capture_key


def _step_inputs(step: int) -> list[torch.Tensor]:
    return [torch.full((1,), step), torch.full((1, 1), 10 + step)]


def test_capture_key_changes_only_when_a_persistent_buffer_changes():
    cache = LayerCache.empty(1, 2, 8, 4, torch.float32, "cpu")
    key = capture_key(_step_inputs(0), cache.tensors())
    assert capture_key(_step_inputs(1), cache.tensors()) == key          # new step tensors, same buffers
    other = LayerCache.empty(1, 2, 8, 4, torch.float32, "cpu")
    other.k.normal_()
    other.length.fill_(3)
    load_into(cache, other)                                              # compression writes in place
    assert capture_key(_step_inputs(2), cache.tensors()) == key
    assert capture_key(_step_inputs(2), with_capacity(cache, 12).tensors()) != key   # reallocated
    assert capture_key([torch.zeros(2), torch.zeros(2, 1)], cache.tensors()) != key  # new batch size


def test_cpu_runs_eagerly():
    step = StaticDecodeStep()
    out = step(lambda a, b: (a * 2,), _step_inputs(3), [])
    assert torch.equal(out[0], torch.full((1,), 6)) and step.captures == 0


class CpuReplay(StaticDecodeStep):
    """The replay machinery on CPU: 'capture' records fn without running it (as CUDA capture does);
    'replay' runs it on the static inputs."""

    def _record(self, fn, static):
        step = self

        class Graph:
            @staticmethod
            def replay():
                step._outs = tuple(fn(*static))
        return Graph, ()


def test_warm_up_restores_what_the_step_advances():
    length = torch.zeros(2, dtype=torch.long)
    written = torch.zeros(4)

    def fn(x):
        written[length] = x            # idempotent write at the current slot
        length.add_(1)                 # advanced: must be restored after the warm-up
        return (written.sum()[None],)

    CpuReplay(warmup=2)._warm_up(fn, [torch.tensor(5.0)], [length])
    assert length.tolist() == [0, 0] and written.tolist() == [5.0, 0, 0, 0]


@pytest.mark.parametrize("policy, budget", [("full", 1.0), ("streamingllm", 24)])
def test_replayed_generate_matches_eager_with_one_capture_per_call(monkeypatch, policy, budget):
    """Through the runtime: replaying the recorded step gives eager's tokens, and compressions (which
    write into the same buffers) do not force a re-capture."""
    torch.manual_seed(0)
    model = build_model(TINY_LLAMA, torch.device("cpu"), torch.float32)
    ids = torch.randint(1, TINY_LLAMA["vocab_size"], (2, 40))
    kv = kvpass.apply(model, policy=policy, budget=budget)
    want = kv.generate(ids, max_new_tokens=24, do_sample=False)
    monkeypatch.setattr(ds, "graphs_enabled", lambda device: True)
    kv.decode_step = CpuReplay()
    got = kv.generate(ids, max_new_tokens=24, do_sample=False)
    assert torch.equal(got, want)
    assert kv.decode_step.captures == 1
    if policy == "streamingllm":
        assert kv.last_report.compressions > 1
    kv.generate(ids[:1], max_new_tokens=3, do_sample=False)              # new buffers: one new capture
    assert kv.decode_step.captures == 2
