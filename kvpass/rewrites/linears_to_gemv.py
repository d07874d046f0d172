"""Decode linears -> ``kvpass::gemv``: every ``aten.linear`` of the decode graph calls the one-row GEMV op.

At batch 1 each projection of a decode step reads one activation row against its whole weight. cuBLAS
runs the N = 4096 ones (o_proj, down_proj) as split-K GEMVs with a second, reduction launch; the op's
Triton kernel (kvpass/kernels/gemv.py) streams the weight once in one launch. On an H100, 32 Llama-3.1-8B-shaped
blocks of fused q/k/v, o, fused gate/up and down (with the activation and a norm between) took 5.83 ms
through cuBLAS and 5.26 ms through the kernel, against a 4.65 ms floor for their weights; lm_head took
373 us and 340 us (benchmarks/results/gemv-sweep-nvidia-h100-80gb-hbm3.json). In the compiled D2O step at
32k the step went from 7.05 to 6.38 ms, with write_kv also recording positions
(speed-nvidia-h100-80gb-hbm3-32k-gemv-decode.md).

A linear that reads a gated MLP's activation, silu(a[..., :K]) * a[..., K:] of the fused gate/up output
``a`` (what ``fuse_sibling_linears`` leaves behind), reads ``a`` itself with ``silu_gate=True``: the
activation is computed in the GEMV's loads, one elementwise launch fewer per layer.

The op is ``F.linear`` wherever the kernel does not apply (more than one row, another device or dtype),
so the graph computes the same function; only the fp32 accumulation order of the one-row case differs.
Run by KVPassModel on the decode graph of a CUDA model (after ``fuse_sibling_linears``); the prefill
keeps its GEMMs.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

import kvpass.kernels  # noqa: F401  (registers torch.ops.kvpass)
from kvpass.rewrites.fuse_sibling_linears import attr_value

LINEAR, GEMV = torch.ops.aten.linear.default, torch.ops.kvpass.gemv.default
SLICE, SILU, MUL = torch.ops.aten.slice.Tensor, torch.ops.aten.silu.default, torch.ops.aten.mul.Tensor


def is_call(node: object, target) -> bool:
    """node is a call_function node of ``target``."""
    return isinstance(node, Node) and node.op == "call_function" and node.target is target


def _weight_shape(gm: GraphModule, linear: Node) -> torch.Size | None:
    """[N, K] of a linear (or gemv) node's get_attr weight, else None."""
    weight = linear.args[1]
    if not (isinstance(weight, Node) and weight.op == "get_attr"):
        return None
    return attr_value(gm, weight.target).shape


def _half(node: object, which: int, k: int) -> Node | None:
    """``a`` if node is slice(a, -1, which * k, (which + 1) * k), read only once; else None."""
    if not is_call(node, SLICE) or len(node.users) != 1 or len(node.args) != 4:
        return None
    return node.args[0] if tuple(node.args[1:]) == (-1, which * k, (which + 1) * k) else None


def silu_gate_input(gm: GraphModule, x: object, k: int) -> tuple[Node, list[Node]] | None:
    """(a, the nodes that only compute x from a) when x is silu(a[..., :k]) * a[..., k:2k] (either operand
    order), a is a linear's output over 2k rows and nothing else reads the silu, the product or the
    slices; else None."""
    if not is_call(x, MUL) or len(x.users) != 1 or len(x.args) != 2:
        return None
    for act, up in (x.args, x.args[::-1]):
        if is_call(act, SILU) and len(act.users) == 1:
            a = _half(act.args[0], 0, k)
            if a is not None and a is _half(up, 1, k) and (is_call(a, LINEAR) or is_call(a, GEMV)):
                shape = _weight_shape(gm, a)
                if shape is not None and shape[0] == 2 * k:
                    return a, [x, act, act.args[0], up]
    return None


def linears_to_gemv(gm: GraphModule) -> int:
    """Retarget every ``aten.linear`` call of ``gm`` to ``kvpass::gemv`` (same arguments), with a SiLU gate
    folded into the call that reads it. Returns how many linears were retargeted."""
    count = 0
    for node in list(gm.graph.nodes):
        if not is_call(node, LINEAR):
            continue
        shape = _weight_shape(gm, node)
        gated = silu_gate_input(gm, node.args[0], shape[1]) if shape is not None else None
        if gated is not None:
            a, dead = gated
            bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
            node.args, node.kwargs = (a, node.args[1], bias), {"silu_gate": True}
            for n in dead:                          # product, silu, then the two slices: users first
                gm.graph.erase_node(n)
        node.target = GEMV
        count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count
