"""Fuse sibling linears: projections that read the same activation (q/k/v, gate/up) become one linear
over their concatenated weights, whose output is sliced back into the originals'.

In a decode step each linear is a GEMV that streams its weight once, so the step's time is mostly
weight bytes over bandwidth. Small GEMVs reach less of that bandwidth and each pays a launch (and often
a split-K reduction): on an H100, q/k/v and gate/up of eight Llama-3.1-8B-shaped blocks took 1.46 ms
as separate GEMVs and 1.35 ms fused (benchmarks/results/sibling-linears-nvidia-h100-80gb-hbm3.json).

Nothing is copied for good. The fused weight is built once by concatenation, and each original
parameter is then re-pointed (``param.data``) at its rows of it, so the model's parameters, state dict
and values are unchanged while their storage is shared with the fused tensor. Running the pass on a
second graph over the same parameters (prefill after decode) finds them already laid out and reuses
that storage. The fused tensor is a non-persistent buffer of the graph module.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.fx import GraphModule, Node

LINEAR = torch.ops.aten.linear.default


@dataclass(frozen=True)
class SiblingLinears:
    """Linears over one input: ``nodes`` in graph order, their weights' (and biases') get_attr targets.
    weight i: [N_i, K]; bias i: [N_i] or absent for all."""

    input: Node
    nodes: tuple[Node, ...]
    weights: tuple[str, ...]
    biases: tuple[str, ...] | None


def attr_value(gm: GraphModule, target: str) -> Tensor:
    """The tensor a get_attr ``target`` ("a.b.c") names in ``gm``."""
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _plain(t: object) -> bool:
    """A dense tensor the pass may re-lay (not a quantized or other tensor subclass)."""
    return isinstance(t, Tensor) and type(t.data) is Tensor and t.layout == torch.strided and not t.is_quantized


def _operands(node: Node) -> tuple[str, str | None] | None:
    """(weight target, bias target or None) of a linear over get_attr operands, else None."""
    if node.op != "call_function" or node.target is not LINEAR:
        return None
    weight = node.args[1]
    bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    if not (isinstance(weight, Node) and weight.op == "get_attr"):
        return None
    if bias is not None and not (isinstance(bias, Node) and bias.op == "get_attr"):
        return None
    return weight.target, (None if bias is None else bias.target)


def find_sibling_linears(gm: GraphModule) -> list[SiblingLinears]:
    """Groups of >= 2 linears that read the same node, with get_attr weights of one dtype, device and
    in-features, all with or all without a bias. A linear whose weight or bias is read elsewhere in the
    graph too (tied or shared) stays out of every group."""
    readers: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            readers[node.target] = readers.get(node.target, 0) + len(node.users)
    by_layout: dict[tuple, list[Node]] = {}
    for node in gm.graph.nodes:
        ops = _operands(node)
        if ops is None or not isinstance(node.args[0], Node) or any(readers[t] > 1 for t in ops if t is not None):
            continue
        weight, bias = attr_value(gm, ops[0]), None if ops[1] is None else attr_value(gm, ops[1])
        if not _plain(weight) or weight.dim() != 2 or (bias is not None and not _plain(bias)):
            continue
        key = (node.args[0], weight.dtype, weight.device, weight.shape[1], bias is not None)
        by_layout.setdefault(key, []).append(node)
    groups = []
    for (x, *_, has_bias), nodes in by_layout.items():
        if len(nodes) >= 2:
            ops = [_operands(n) for n in nodes]
            biases = tuple(b for _, b in ops) if has_bias else None
            groups.append(SiblingLinears(x, tuple(nodes), tuple(w for w, _ in ops), biases))
    return groups


def _laid_out(parts: list[Tensor]) -> Tensor | None:
    """The tensor the contiguous ``parts`` already tile, row after row, in one storage; else None."""
    first = parts[0]
    offset = first.storage_offset()
    for p in parts:
        if not p.is_contiguous() or p.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
            return None
        if p.storage_offset() != offset:
            return None
        offset += p.numel()
    rows = sum(p.shape[0] for p in parts)
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (rows, *first.shape[1:]))


def concat_in_place(parts: list[Tensor]) -> Tensor:
    """One tensor [sum N_i, ...] holding ``parts`` row after row; each part (a Parameter or buffer) is
    re-pointed at its rows, so its values and identity stay and its old storage is freed. (The traced
    graph's attributes are the model's own Parameter objects, with torch 2.11 and 2.13 alike.)"""
    fused = _laid_out(parts)
    if fused is not None:
        return fused
    with torch.no_grad():
        fused = torch.cat([p.detach() for p in parts])
        start = 0
        for p in parts:
            p.data = fused[start:start + p.shape[0]]
            start += p.shape[0]
    return fused


def _buffer_name(gm: GraphModule, targets: tuple[str, ...]) -> str:
    """e.g. model.model.layers.0.self_attn.{q,k,v}_proj.weight -> fused_model_model_layers_0_self_attn_q_k_v."""
    parts = [t.split(".") for t in targets]
    common = 0
    while all(len(p) > common + 1 and p[common] == parts[0][common] for p in parts):
        common += 1
    rest = "_".join(p[common].removesuffix("_proj") for p in parts)
    name = re.sub(r"\W", "_", "fused_" + "_".join(parts[0][:common] + [rest]))
    while hasattr(gm, name):
        name += "_"
    return name


def _fake_cat(vals: list, dim: int):
    vals = [v for v in vals if isinstance(v, Tensor)]
    mode = getattr(vals[0], "fake_mode", None) if vals else None
    if mode is None:
        return None
    with mode:
        return torch.cat(vals, dim)


# Ops whose result may share the input's memory, beyond those whose schema says so (OpOverload.is_view).
_MAY_ALIAS = {torch.ops.aten.reshape.default, torch.ops.aten.contiguous.default, operator.getitem}


def _aliases_input(node: Node) -> bool:
    target = node.target
    return node.op == "call_function" and (target in _MAY_ALIAS or getattr(target, "is_view", False))


def _escapes(*starts: Node) -> bool:
    """Whether the value of ``starts`` (one tensor) reaches the graph's output through views only. The
    prefill graph returns each layer's V as a view of its projection: after fusion that view would hold
    the whole fused q/k/v output (4-6x V's bytes) for as long as the cache lives."""
    seen, todo = set(), [u for n in starts for u in n.users]
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "output":
            return True
        if _aliases_input(node):
            todo.extend(node.users)
    return False


def fuse_group(gm: GraphModule, group: SiblingLinears) -> None:
    """Replace the group's linears in ``gm`` by one linear and one slice per original output (a copy of
    it where the graph returns it)."""
    graph = gm.graph
    weight = concat_in_place([attr_value(gm, t) for t in group.weights])
    bias = None if group.biases is None else concat_in_place([attr_value(gm, t) for t in group.biases])
    w_name = _buffer_name(gm, group.weights)
    gm.register_buffer(w_name, weight, persistent=False)
    b_name = None
    if bias is not None:
        b_name = _buffer_name(gm, group.biases)
        gm.register_buffer(b_name, bias, persistent=False)
    first = group.nodes[0]
    with graph.inserting_before(first):
        args = [group.input, graph.get_attr(w_name)]
        if b_name is not None:
            args.append(graph.get_attr(b_name))
        fused = graph.call_function(LINEAR, tuple(args))
        fused.meta["val"] = _fake_cat([n.meta.get("val") for n in group.nodes], -1)
        start = 0
        for node, target in zip(group.nodes, group.weights, strict=True):
            rows = attr_value(gm, target).shape[0]
            piece = graph.call_function(torch.ops.aten.slice.Tensor, (fused, -1, start, start + rows))
            piece.meta = {k: v for k, v in node.meta.items() if k != "val"}
            if _escapes(piece, node):         # a view returned by the graph would keep all of `fused` alive
                piece = graph.call_function(torch.ops.aten.clone.default, (piece,),
                                            {"memory_format": torch.contiguous_format})
                piece.meta = {k: v for k, v in node.meta.items() if k != "val"}
            start += rows
            node.replace_all_uses_with(piece)
    for node in group.nodes:
        operands = [a for a in node.args[1:] if isinstance(a, Node)]
        graph.erase_node(node)
        for a in operands:
            if not a.users:
                graph.erase_node(a)


def fuse_sibling_linears(gm: GraphModule) -> int:
    """Fuse every group ``find_sibling_linears`` finds in ``gm`` (in place, recompiled); returns the
    number of groups fused. The parameters involved are re-laid in place (see the module docstring)."""
    groups = find_sibling_linears(gm)
    for group in groups:
        fuse_group(gm, group)
    if groups:
        gm.graph.lint()
        gm.recompile()
    return len(groups)
