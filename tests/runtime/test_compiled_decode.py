"""Compiled decode by default (issue 29, docs/compiled-decode.md): ``kvpass.apply(compile=True)`` decodes with
Inductor's graph, the greedy tokens of the eager graph for every policy and prompt length, one compilation
serving every prompt length and layer budget (batch 1) and one more for every larger batch, kept across
``generate`` calls and reported; the CPU default stays eager; a failing compilation falls back to eager.

The Inductor tests (marker ``inductor``) compile the decode step of a tiny 2-layer model on the CPU: about
5-10 s a compilation on 2 cores (the first of a process about 20 s), five in all."""

from __future__ import annotations

import functools
import gc
import logging
import weakref

import pytest
import torch

import kvpass
from kvpass.compiled_decode import COMPILE_COUNTS, CompiledDecode
from tests.conftest import padded_batch, tiny_model

# prompt lengths of one model: the cache capacity (budget + interval) differs for each
LENGTHS = (23, 41, 77)
POLICIES = {
    "full": dict(policy="full", budget=1.0),
    "streamingllm": dict(policy="streamingllm", budget=0.3, sinks=2, interval=4),
    "snapkv": dict(policy="snapkv", budget=0.3, interval=4),
    "d2o": dict(policy="d2o", budget=0.3, interval=4),
    "d2o-one-in-one-out": dict(policy="d2o", budget=0.3, interval=1),
}


def _ids(n: int, seed: int, vocab: int = 128) -> torch.Tensor:
    return torch.randint(1, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


@functools.cache
def _pair(arch: str, name: str) -> tuple[kvpass.KVPassModel, kvpass.KVPassModel]:
    """(eager, compiled) models of one policy, shared by the tests of this module (a compilation is seconds)."""
    model = tiny_model(arch)
    return (kvpass.apply(model, compile=False, **POLICIES[name]), kvpass.apply(model, compile=True, **POLICIES[name]))


@pytest.mark.inductor
def test_a_dropped_compiled_model_frees_its_weights():
    """Dynamo keeps every backend it was given for the life of the process: the compiled step's backend must
    not keep the model (on a GPU each dropped model held its weights: 7 GiB a model at tp=2 of the 8B shape)."""
    from transformers import AutoModelForCausalLM

    from tests.conftest import TINY_CONFIGS

    model = AutoModelForCausalLM.from_config(TINY_CONFIGS["llama"]()).eval()     # not tiny_model's cached one
    weight = weakref.ref(model.model.layers[0].mlp.up_proj.weight)
    kv = kvpass.apply(model, compile=True, **POLICIES["full"])
    kv.generate(_ids(23, seed=1), max_new_tokens=3, eos_token_id=[])
    assert kv.compile_report["compilations"] == 1
    del kv, model
    gc.collect()
    assert weight() is None


@pytest.mark.inductor
@pytest.mark.parametrize("arch, name", [("llama", "full"), ("llama", "streamingllm"), ("qwen2", "snapkv"),
                                        ("llama", "d2o"), ("llama", "d2o-one-in-one-out")])
def test_compiled_tokens_equal_eager_with_one_compilation_for_every_length(arch, name):
    eager, compiled = _pair(arch, name)
    before = compiled.compile_report["compilations"]
    assert eager.compiled_decode is None and isinstance(compiled.compiled_decode, CompiledDecode)
    COMPILE_COUNTS.clear()
    budgets = set()
    for i, n in enumerate((*LENGTHS, LENGTHS[0])):            # the last call repeats the first length
        ids = _ids(n, seed=n)
        want = eager.generate(ids, max_new_tokens=10, eos_token_id=[])
        got = compiled.generate(ids, max_new_tokens=10, eos_token_id=[])
        assert torch.equal(got, want), (name, n)
        report = compiled.last_report
        assert report.compiled and report.compilations == (1 if i == 0 and not before else 0)
        assert (report.compile_seconds > 0) == (i == 0 and not before)
        budgets.add(tuple(report.layer_budgets.values()))
        if name != "full":
            assert report.compressions > 0 and report.cache_bytes < report.full_cache_bytes
    assert len(budgets) == len(LENGTHS) or name == "full"       # the cache's shape changed with the prompt
    summary = compiled.compile_report
    assert summary["compilations"] == 1 and COMPILE_COUNTS["decode"] == 1 - before
    (only,) = summary["each"]
    assert only["batch"] == 1 and only["capacity"] == "dynamic" and only["seconds"] > 0
    assert summary["compile_seconds"] == only["seconds"] and summary["failure"] is None


@pytest.mark.inductor
def test_larger_batches_share_one_more_compilation():
    """Batch 1, then ragged batches of 2 and 3 rows (rows of their own budgets): two compilations in all (the
    model of the d2o case above where it ran: its batch-1 graph is then compiled already)."""
    eager, compiled = _pair("llama", "d2o")
    for lengths in ([30], [30, 52], [64, 19, 40]):
        ids, mask = padded_batch(lengths, seed=len(lengths))
        want = eager.generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=[])
        got = compiled.generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=[])
        assert torch.equal(got, want), lengths
    each = compiled.compile_report["each"]
    assert [(c["batch"], c["dynamic_batch"]) for c in each] == [(1, False), (2, True)]


def test_cpu_default_is_eager():
    model = tiny_model("llama")
    kv = kvpass.apply(model, policy="streamingllm", budget=0.5)
    assert kv.compiled_decode is None
    assert kv.compile_report == {"compiled": False, "compilations": 0, "compile_seconds": 0.0, "each": [],
                                 "failure": None}
    kv.generate(_ids(20, 0), max_new_tokens=3, eos_token_id=[])
    assert not kv.last_report.compiled and kv.last_report.compilations == 0


def test_a_failing_compilation_decodes_eagerly(caplog):
    """A Dynamo/Inductor failure (any ``TorchDynamoException``) is logged and reported once; the step runs the
    eager graph from then on (same tokens) and never tries to compile again."""
    model = tiny_model("llama")
    eager = kvpass.apply(model, policy="streamingllm", budget=0.5, compile=False)
    kv = kvpass.apply(model, policy="streamingllm", budget=0.5, compile=True)
    calls = []

    def broken(*inputs):
        calls.append(len(inputs))
        cause = RuntimeError("no C++ compiler found")
        raise torch._dynamo.exc.BackendCompilerFailed(kvpass.compile_backend.kvpass_backend, cause, None) from cause

    kv.compiled_decode._fn = broken
    ids = _ids(20, 1)
    with caplog.at_level(logging.WARNING, logger="kvpass.compiled_decode"):
        got = kv.generate(ids, max_new_tokens=6, eos_token_id=[])
    assert torch.equal(got, eager.generate(ids, max_new_tokens=6, eos_token_id=[]))
    assert len(calls) == 1 and "decoding eagerly" in caplog.text
    report = kv.compile_report
    assert not report["compiled"] and "BackendCompilerFailed" in report["failure"]
    assert "RuntimeError: no C++ compiler found" in report["failure"]          # the compiler's own error, named
    assert not kv.last_report.compiled and report["compilations"] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["streamingllm", "d2o"])
def test_cuda_default_compiles_once_and_matches_eager(name):
    """On CUDA (float32, CUDA-graphed steps) the default is compiled: eager's greedy tokens at three prompt
    lengths, one compilation in all, the capacity symbolic."""
    torch.manual_seed(0)
    model = tiny_model("llama").to("cuda")
    try:
        eager = kvpass.apply(model, compile=False, **POLICIES[name])
        compiled = kvpass.apply(model, **POLICIES[name])
        assert isinstance(compiled.compiled_decode, CompiledDecode)
        for n in LENGTHS:
            ids = _ids(n, seed=n).cuda()
            want = eager.generate(ids, max_new_tokens=12, eos_token_id=[])
            assert torch.equal(compiled.generate(ids, max_new_tokens=12, eos_token_id=[]), want), n
        report = compiled.compile_report
        assert report["compilations"] == 1 and report["each"][0]["capacity"] == "dynamic"
        assert compiled.decode_step.captures >= 1
    finally:
        model.to("cpu")
