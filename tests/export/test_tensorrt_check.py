"""check_tensorrt flags nodes the TensorRT ONNX parser rejects or restricts, and passes clean graphs."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kvpass.export import TensorRTUnavailable, check_tensorrt, tensorrt, tensorrt_available


def _save(tmp_path, nodes, inits=(), name="g.onnx"):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    graph = helper.make_graph(nodes, "g", [x], [y], initializer=list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    path = tmp_path / name
    onnx.save(model, str(path))
    return path


def _const(name, value):
    return numpy_helper.from_array(np.asarray(value, dtype=np.int64), name)


def test_clean_graph_has_no_findings(tmp_path):
    nodes = [helper.make_node("ReduceSum", ["x", "axes"], ["s"], name="sum"),
             helper.make_node("TopK", ["x", "k"], ["y", "i"], name="topk", axis=-1),
             helper.make_node("Relu", ["s"], ["r"], name="relu"),
             helper.make_node("ScatterElements", ["x", "idx", "x"], ["z"], name="scatter")]
    assert check_tensorrt(_save(tmp_path, nodes, [_const("axes", [1]), _const("k", [4]), _const("idx", [[0]])])) == []


@pytest.mark.parametrize("node, inits, op, kind, reason", [
    (helper.make_node("Unique", ["x"], ["y"], name="u"), [], "Unique", "unsupported", "not supported"),
    (helper.make_node("TopK", ["x", "k"], ["y", "i"], name="t"), [_const("k", [5000])], "TopK", "restricted", "3840"),
    (helper.make_node("TopK", ["x", "k"], ["y", "i"], name="t", sorted=0), [_const("k", [3])], "TopK", "restricted",
     "sorted"),
    (helper.make_node("TopK", ["x", "kdyn"], ["y", "i"], name="t"), [], "TopK", "restricted", "build-time constant"),
    (helper.make_node("ScatterND", ["x", "idx", "x"], ["y"], name="s", reduction="add"), [_const("idx", [[0]])],
     "ScatterND", "restricted", "reduction"),
    (helper.make_node("ScatterElements", ["x", "idx", "x"], ["y"], name="se", reduction="add"),
     [_const("idx", [[0]])], "ScatterElements", "restricted", "scatterElements plugin"),
    (helper.make_node("Unsqueeze", ["x", "ax"], ["y"], name="un"), [], "Unsqueeze", "restricted", "axes"),
    (helper.make_node("Attend", ["x"], ["y"], name="c", domain="kvpass"), [], "Attend", "unsupported", "plugin"),
])
def test_planted_node_is_flagged(tmp_path, node, inits, op, kind, reason):
    plain = helper.make_node("Relu", ["x"], ["r"], name="ok")
    found = check_tensorrt(_save(tmp_path, [plain, node], inits))
    assert len(found) == 1
    assert (found[0].node, found[0].op_type, found[0].kind) == (node.name, op, kind)
    assert reason in found[0].reason


def test_axes_from_constant_node_pass(tmp_path):
    const = helper.make_node("Constant", [], ["ax"], value=numpy_helper.from_array(np.array([0], dtype=np.int64)))
    nodes = [const, helper.make_node("Unsqueeze", ["x", "ax"], ["y"], name="un")]
    assert check_tensorrt(_save(tmp_path, nodes)) == []


def test_tensorrt_export_says_it_is_not_installed(tmp_path):
    if tensorrt_available():
        pytest.skip("torch-tensorrt is installed here")
    with pytest.raises(TensorRTUnavailable, match="not installed"):
        tensorrt(None, tmp_path)
    with pytest.raises(ValueError, match="precision"):
        tensorrt(None, tmp_path, precision="int3")
