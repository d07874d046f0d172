"""kvpass.export.onnx + OnnxRunner on a tiny Llama: greedy tokens equal the PyTorch runtime's."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import onnx as onnx_lib
import pytest
import torch

import kvpass
from kvpass.cache import LayerCache
from kvpass.export import METADATA, OnnxRunner, check_tensorrt
from kvpass.export import onnx as export_onnx
from kvpass.policies.streamingllm import StreamingLLM
from tests.export.conftest import BUDGET, INTERVAL, MAX_LENGTH

POLICIES = ["full", "streamingllm", "d2o", "tova"]     # tova: a statistic the step replaces (last_attn)


@pytest.mark.parametrize("policy", POLICIES)
def test_onnx_greedy_tokens_equal_runtime(exported, policy):
    model, out, _ = exported(policy)
    ids = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(1))
    want = model.generate(ids, max_new_tokens=30)
    if model.policy.compresses:
        assert model.last_report.compressions > 1           # the prompt and the decode loop both compress
    got = OnnxRunner(out).generate(ids, max_new_tokens=30)
    np.testing.assert_array_equal(got, want.numpy())


def test_onnx_expanded_kv_heads_equal_runtime(llama, tmp_path):
    """expand_kv_heads=True (a cache per query head) exports too: the decode graph repeats the step's K, V."""
    model = kvpass.apply(llama, policy="d2o", budget=BUDGET, interval=INTERVAL, expand_kv_heads=True)
    meta = export_onnx(model, tmp_path, max_length=MAX_LENGTH)
    assert [(layer["n_kv_heads"], layer["kv_repeat"]) for layer in meta["layers"]] == [(4, 2), (4, 2)]
    assert meta["policy"]["expand_kv_heads"] is True
    ids = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(1))
    want = model.generate(ids, max_new_tokens=30)
    assert model.last_report.compressions > 1
    np.testing.assert_array_equal(OnnxRunner(tmp_path).generate(ids, max_new_tokens=30), want.numpy())


def test_compression_changes_tokens(exported):
    """The equality above is not vacuous: the compressed cache decodes differently from the full one."""
    ids = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(1))
    full = OnnxRunner(exported("full")[1]).generate(ids, max_new_tokens=30)
    streaming = OnnxRunner(exported("streamingllm")[1]).generate(ids, max_new_tokens=30)
    assert not np.array_equal(full, streaming)


def test_onnx_left_padded_batch(exported):
    model, out, _ = exported("streamingllm")
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 128, (2, 18), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    want = model.generate(ids, attention_mask=mask, max_new_tokens=20)
    got = OnnxRunner(out).generate(ids, attention_mask=mask, max_new_tokens=20)
    np.testing.assert_array_equal(got, want.numpy())


def test_metadata_names_and_shapes(exported):
    model, out, meta = exported("streamingllm")
    assert json.loads((out / METADATA).read_text()) == meta
    capacity = BUDGET + INTERVAL
    assert [layer["capacity"] for layer in meta["layers"]] == [capacity, capacity]
    decode = meta["files"]["decode"]
    inputs = {i["name"]: i for i in decode["inputs"]}
    outputs = {o["name"]: o for o in decode["outputs"]}
    for name in ("past_key_values.0.key", "past_key_values.1.value", "past_log_weight.0", "past_length.1",
                 "past_position.0"):
        assert name in inputs
    for name in ("logits", "present.0.key", "present.1.value", "present_log_weight.0", "present_length.1"):
        assert name in outputs
    key = inputs["past_key_values.0.key"]["shape"]
    assert isinstance(key[0], str) and key[1:] == [2, capacity, 16]        # dynamic batch, fixed C
    prefill_ids = {i["name"]: i for i in meta["files"]["prefill"]["inputs"]}["input_ids"]["shape"]
    assert all(isinstance(d, str) for d in prefill_ids)                     # dynamic batch and prompt length
    compress = meta["files"][f"compress_{BUDGET}"]
    assert {o["name"]: o for o in compress["outputs"]}["present.0.key"]["shape"][2] == capacity


@pytest.mark.parametrize("policy", ["full", "streamingllm"])
def test_exported_files_use_standard_ops_and_pass_tensorrt_check(exported, policy):
    _, out, meta = exported(policy)
    assert meta["tensorrt_findings"] and all(v == [] for v in meta["tensorrt_findings"].values())
    for f in meta["files"].values():
        model = onnx_lib.load(str(out / f["path"]), load_external_data=False)
        assert {n.domain for n in model.graph.node} <= {"", "ai.onnx"}
        assert not {"ScatterElements", "ScatterND"} & {n.op_type for n in model.graph.node}
        assert check_tensorrt(out / f["path"]) == []


def test_d2o_export_passes_the_tensorrt_check(exported):
    """D2O's prefill, decode and compress pass the TensorRT check with budgets fixed at export: slot compaction
    without sorts (a CumSum and a ScatterElements without reduction), one TopK with the constant K = budget, and
    the merges as dense assignment matmuls (``d2o._sums_into`` under export), not scatter-adds. (With budgets
    resolved at run time the TopK's K is the budget input: TensorRT's parser wants a constant, the one finding.)"""
    _, out, meta = exported("d2o", "fixed")
    assert meta["tensorrt_findings"] and all(v == [] for v in meta["tensorrt_findings"].values())
    compress = meta["layers"][0]["compress"]
    model = onnx_lib.load(str(out / compress), load_external_data=False)
    assert {n.domain for n in model.graph.node} <= {"", "ai.onnx"}
    ops = [n for n in model.graph.node if n.op_type in ("TopK", "ScatterElements", "ScatterND")]
    assert [n.op_type for n in ops if n.op_type == "TopK"] == ["TopK"]
    assert all(not any(a.name == "reduction" and a.s not in (b"", b"none") for a in n.attribute) for n in ops)
    assert check_tensorrt(out / compress) == []
    runtime = exported("d2o")[2]["tensorrt_findings"]
    assert [f["op_type"] for found in runtime.values() for f in found] == ["TopK"]


def test_onnx_export_rejects_bad_options(exported, llama, tmp_path):
    model, _, _ = exported("full")
    with pytest.raises(ValueError, match="KVPassModel"):
        export_onnx(llama, tmp_path)
    with pytest.raises(ValueError, match="max_length"):
        export_onnx(model, tmp_path, max_length=1)
    with pytest.raises(ValueError, match="context"):
        export_onnx(model, tmp_path, max_length=10**6)
    with pytest.raises(ValueError, match="tensorrt_check"):
        export_onnx(model, tmp_path, max_length=MAX_LENGTH, tensorrt_check="maybe")


def test_runner_rejects_too_long_and_missing_dir(exported, tmp_path):
    _, out, _ = exported("full")
    with pytest.raises(ValueError, match="max_length"):
        OnnxRunner(out).generate(np.zeros((1, 40), dtype=np.int64), max_new_tokens=30)
    with pytest.raises(ValueError, match="kvpass_export.json"):
        OnnxRunner(tmp_path)


@dataclass(frozen=True)
class AlternatingSinks(StreamingLLM):
    """Test policy with per-layer state: StreamingLLM whose odd-numbered compressions keep no sinks. The
    call count lives in ``LayerCache.state`` (created by the first compression, zeros before), so the tokens
    depend on the export carrying policy state between compress calls."""

    name: ClassVar[str] = "alternating_sinks_test"

    def compress(self, cache: LayerCache, keep: int) -> LayerCache:
        calls = cache.state.get("calls", torch.zeros(cache.k.shape[0], dtype=torch.int64, device=cache.k.device))
        plain = StreamingLLM(sinks=self.sinks, interval=self.interval).compress(cache, keep)
        sinkless = StreamingLLM(sinks=0, interval=self.interval).compress(cache, keep)
        odd = calls % 2 == 1                                                      # [B]

        def pick(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return torch.where(odd.reshape(-1, *[1] * (a.dim() - 1)), b, a)

        return LayerCache(k=pick(plain.k, sinkless.k), v=pick(plain.v, sinkless.v),
                          log_weight=pick(plain.log_weight, sinkless.log_weight),
                          length=pick(plain.length, sinkless.length), position=pick(plain.position, sinkless.position),
                          slot_meta={}, state={"calls": calls + 1})


def test_policy_state_is_carried_through_compress(llama, tmp_path):
    policy = AlternatingSinks(sinks=2, interval=INTERVAL)
    model = kvpass.apply(llama, policy=policy, budget=BUDGET)
    ids = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(1))
    want = model.generate(ids, max_new_tokens=30)
    assert model.last_report.compressions > 2
    plain = kvpass.apply(llama, policy="streamingllm", budget=BUDGET, sinks=2, interval=INTERVAL)
    assert not torch.equal(want, plain.generate(ids, max_new_tokens=30))     # the state matters
    meta = export_onnx(model, tmp_path, max_length=MAX_LENGTH)
    assert meta["layers"][0]["state"] == ["calls"]
    assert meta["layers"][0]["state_seed"] == {"calls": {"shape": [], "dtype": "int64"}}
    got = OnnxRunner(tmp_path).generate(ids, max_new_tokens=30)
    np.testing.assert_array_equal(got, want.numpy())
