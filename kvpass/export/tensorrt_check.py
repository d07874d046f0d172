"""Which nodes of an ONNX file the TensorRT ONNX parser would reject or restrict.

The rule table is written from the published operator support matrix of the ONNX-TensorRT parser,
``docs/operators.md`` of github.com/onnx/onnx-tensorrt (the "TensorRT 10.15 supports operators in
the inclusive range of opset 9 to opset 24" revision): operators marked ``N`` are rejected, and the
"Restrictions" column gives the conditions checked below. It is a static check of the graph, not
a TensorRT build: shapes are only checked where the file states them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# Operators the matrix marks unsupported (N). Sequence/Optional/string ops included.
UNSUPPORTED = frozenset({
    "AffineGrid", "Bernoulli", "BitShift", "BitwiseAnd", "BitwiseNot", "BitwiseOr", "BitwiseXor", "Col2Im",
    "CenterCropPad", "Compress", "ConcatFromSequence", "ConvInteger", "DFT", "Det", "DynamicQuantizeLinear",
    "ImageDecoder", "MatMulInteger", "MaxRoiPool", "MaxUnpool", "MelWeightMatrix", "Multinomial",
    "NegativeLogLikelihoodLoss", "Optional", "OptionalGetElement", "OptionalHasElement", "QLinearConv",
    "QLinearMatMul", "RegexFullMatch", "SequenceAt", "SequenceConstruct", "SequenceEmpty", "SequenceErase",
    "SequenceInsert", "SequenceLength", "SequenceMap", "SoftmaxCrossEntropyLoss", "SplitToSequence",
    "StringConcat", "StringNormalizer", "StringSplit", "TfIdfVectorizer", "Unique",
})
TOPK_MAX_K = 3840           # "TopK: `sorted` must be 1. `K` input must be less than 3840."
# Ops whose `axes` (opset >= 13/18: an input) must be an initializer / build-time constant.
AXES_INPUT = {"ReduceL1": 1, "ReduceL2": 1, "ReduceLogSum": 1, "ReduceLogSumExp": 1, "ReduceMax": 1,
              "ReduceMean": 1, "ReduceMin": 1, "ReduceProd": 1, "ReduceSum": 1, "ReduceSumSquare": 1,
              "Squeeze": 1, "Unsqueeze": 1}
BUILD_TIME_CONSTANT = {"CumSum": (1, "axis"), "OneHot": (1, "depth"), "Dropout": (2, "training_mode")}


@dataclass(frozen=True)
class Finding:
    """One node TensorRT's parser would reject ("unsupported") or accept only under a condition the
    graph does not meet ("restricted")."""

    node: str
    op_type: str
    kind: str        # "unsupported" or "restricted"
    reason: str

    def __str__(self) -> str:
        return f"{self.op_type} node {self.node!r} ({self.kind}): {self.reason}"


class _Graph:
    """Constant lookup over one ONNX graph: initializers and Constant node outputs."""

    def __init__(self, graph) -> None:
        from onnx import numpy_helper

        self.const = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
        for node in graph.node:
            if node.op_type == "Constant" and node.attribute:
                attr = node.attribute[0]
                if attr.name == "value":
                    self.const[node.output[0]] = numpy_helper.to_array(attr.t)
                elif attr.name in ("value_int", "value_ints"):
                    self.const[node.output[0]] = attr.i if attr.name == "value_int" else list(attr.ints)

    def constant(self, name: str):
        return self.const.get(name) if name else None


def _attr(node, name: str, default=None):
    from onnx import helper

    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _input(node, i: int) -> str:
    return node.input[i] if len(node.input) > i else ""


def _topk(node, g: _Graph) -> list[str]:
    problems = []
    if _attr(node, "sorted", 1) != 1:
        problems.append("`sorted` must be 1")
    k = g.constant(_input(node, 1))
    if k is None:
        problems.append("`K` must be a build-time constant (initializer) so its bound can be checked")
    elif int(k.reshape(-1)[0] if hasattr(k, "reshape") else k) >= TOPK_MAX_K:
        problems.append(f"`K` = {int(k.reshape(-1)[0])} must be less than {TOPK_MAX_K}")
    return problems


def _scatter(node, g: _Graph) -> list[str]:
    reduction = _attr(node, "reduction", b"none")
    reduction = reduction.decode() if isinstance(reduction, bytes) else reduction
    if node.op_type == "ScatterND" and reduction != "none":
        return [f"`reduction` other than none is not supported (got {reduction})"]
    if node.op_type == "ScatterElements" and reduction != "none":
        # TensorRT's core scatter layer has no reduction; the parser needs the scatterElements plugin
        return [f"`reduction` {reduction} needs TensorRT's scatterElements plugin (the core layer has none)"]
    return []


def _axes(node, g: _Graph) -> list[str]:
    i = AXES_INPUT[node.op_type]
    name = _input(node, i)
    if name and g.constant(name) is None:
        return ["`axes` must be an initializer (a build-time constant)"]
    return []


def _constant_input(node, g: _Graph) -> list[str]:
    i, what = BUILD_TIME_CONSTANT[node.op_type]
    name = _input(node, i)
    if name and g.constant(name) is None:
        return [f"`{what}` must be a build-time constant"]
    return []


def _layer_norm(node, g: _Graph) -> list[str]:
    extra = [o for o in node.output[1:] if o]
    return ["only the first output `Y` is supported"] if extra else []


def _max_pool(node, g: _Graph) -> list[str]:
    return ["the `Indices` output is unsupported"] if len(node.output) > 1 and node.output[1] else []


RULES: dict[str, Callable] = {"TopK": _topk, "ScatterND": _scatter, "ScatterElements": _scatter,
                              "LayerNormalization": _layer_norm,
                              "MaxPool": _max_pool,
                              **dict.fromkeys(AXES_INPUT, _axes), **dict.fromkeys(BUILD_TIME_CONSTANT, _constant_input)}


def check_model(model) -> list[Finding]:
    """Findings for an ``onnx.ModelProto`` (main graph and subgraphs of If/Loop/Scan)."""
    return _check_graph(model.graph)


def _check_graph(graph) -> list[Finding]:
    g = _Graph(graph)
    found: list[Finding] = []
    for i, node in enumerate(graph.node):
        name = node.name or f"#{i}"
        if node.domain not in ("", "ai.onnx"):
            found.append(Finding(name, node.op_type, "unsupported",
                                 f"custom domain {node.domain!r}: needs a TensorRT plugin"))
            continue
        if node.op_type in UNSUPPORTED:
            found.append(Finding(name, node.op_type, "unsupported", "not supported by the TensorRT ONNX parser"))
            continue
        if node.op_type in RULES:
            found += [Finding(name, node.op_type, "restricted", why) for why in RULES[node.op_type](node, g)]
        for attr in node.attribute:
            if attr.g is not None and attr.g.node:
                found += _check_graph(attr.g)
    return found


def check_tensorrt(onnx_path: str | Path) -> list[Finding]:
    """Each node of the ONNX file at ``onnx_path`` that TensorRT's ONNX parser would reject or restrict."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    return check_model(model)
