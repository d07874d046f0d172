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

A linear that reads Llama's RMSNorm of a hidden state h (``g * (h32 * rsqrt(mean(h32^2) + eps)).to(h.dtype)``,
op for op) reads h itself with ``norm_weight=g``, and an add of a GEMV's output to the residual stream becomes
that GEMV's ``residual``: the q/k/v and gate/up GEMVs normalise in their loads, the o and down GEMVs add the
residual in their stores, and the two norm launches of every layer are gone. Other norms (Gemma's 1 + w,
a norm whose output something else reads) are left as they are.

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
ADD, TO, POW = torch.ops.aten.add.Tensor, torch.ops.aten.to.dtype, torch.ops.aten.pow.Tensor_Scalar
MEAN, RSQRT = torch.ops.aten.mean.dim, torch.ops.aten.rsqrt.default
ASSERT_META = torch.ops.aten._assert_tensor_metadata.default


def _call(node: object, target) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target is target


def _weight_shape(gm: GraphModule, linear: Node) -> torch.Size | None:
    """[N, K] of a linear (or gemv) node's get_attr weight, else None."""
    weight = linear.args[1]
    if not (isinstance(weight, Node) and weight.op == "get_attr"):
        return None
    return attr_value(gm, weight.target).shape


def _half(node: object, which: int, k: int) -> Node | None:
    """``a`` if node is slice(a, -1, which * k, (which + 1) * k), read only once; else None."""
    if not _call(node, SLICE) or len(node.users) != 1 or len(node.args) != 4:
        return None
    return node.args[0] if tuple(node.args[1:]) == (-1, which * k, (which + 1) * k) else None


def silu_gate_input(gm: GraphModule, x: object, k: int) -> tuple[Node, list[Node]] | None:
    """(a, the nodes that only compute x from a) when x is silu(a[..., :k]) * a[..., k:2k] (either operand
    order), a is a linear's output over 2k rows and nothing else reads the silu, the product or the
    slices; else None."""
    if not _call(x, MUL) or len(x.users) != 1 or len(x.args) != 2:
        return None
    for act, up in (x.args, x.args[::-1]):
        if _call(act, SILU) and len(act.users) == 1:
            a = _half(act.args[0], 0, k)
            if a is not None and a is _half(up, 1, k) and (_call(a, LINEAR) or _call(a, GEMV)):
                shape = _weight_shape(gm, a)
                if shape is not None and shape[0] == 2 * k:
                    return a, [x, act, act.args[0], up]
    return None


def _val(node: object):
    """The fake tensor a node's meta records (None where it has none)."""
    return node.meta.get("val") if isinstance(node, Node) else None


def _operands(node: Node) -> list[tuple[object, object]]:
    """Both orders of a binary node's two operands."""
    return [tuple(node.args), tuple(node.args[::-1])]


def rms_norm_input(gm: GraphModule, x: object) -> tuple[Node, Node, float, list[Node]] | None:
    """(h, g, eps, the norm's nodes) when x is ``g * (h32 * rsqrt(mean(h32^2, -1, keepdim) + eps)).to(h.dtype)``
    with h32 = h.to(float32) (or h where h is float32) and g a [K] weight; else None."""
    if not _call(x, MUL) or len(x.args) != 2:
        return None
    for g, normed in _operands(x):
        if not (isinstance(g, Node) and g.op == "get_attr") or not _call(normed, TO) or len(normed.args) != 2:
            continue
        scaled = normed.args[0]
        if not _call(scaled, MUL) or len(scaled.args) != 2:
            continue
        for h32, rsqrt in _operands(scaled):
            found = _rms_scale(h32, rsqrt)
            if found is None:
                continue
            h, eps, scale_nodes = found
            hv, gv = _val(h), attr_value(gm, g.target)
            if hv is None or normed.args[1] != hv.dtype or tuple(gv.shape) != (hv.shape[-1],):
                continue
            return h, g, eps, [x, normed, scaled, *scale_nodes]
    return None


def _rms_scale(h32: object, rsqrt: object) -> tuple[Node, float, list[Node]] | None:
    """(h, eps, nodes) when rsqrt is rsqrt(mean(h32 ** 2, [-1], True) + eps) and h32 is h in float32."""
    if not _call(rsqrt, RSQRT) or not _call(add := rsqrt.args[0], ADD) or not isinstance(add.args[1], float):
        return None
    if not _call(mean := add.args[0], MEAN) or tuple(mean.args[1:]) not in (([-1], True),):
        return None
    if not _call(pow_ := mean.args[0], POW) or pow_.args[0] is not h32 or pow_.args[1] != 2:
        return None
    if _call(h32, TO) and tuple(h32.args[1:]) == (torch.float32,):
        h, nodes = h32.args[0], [rsqrt, add, mean, pow_, h32]
    else:
        h, nodes = h32, [rsqrt, add, mean, pow_]
    hv = _val(h)
    if not isinstance(h, Node) or hv is None or (h is h32 and hv.dtype != torch.float32):
        return None
    return h, add.args[1], nodes


def _erase_unused(gm: GraphModule, nodes: list[Node]) -> None:
    """Erase each of ``nodes`` (users first) that nothing but metadata asserts reads any more."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in sorted(set(nodes), key=order.__getitem__, reverse=True):
        if all(_call(u, ASSERT_META) for u in node.users):
            for u in list(node.users):
                gm.graph.erase_node(u)
            gm.graph.erase_node(node)


def fold_rms_norms(gm: GraphModule) -> int:
    """Every GEMV reading an RMSNorm (``rms_norm_input``) reads the norm's input with ``norm_weight`` and
    ``norm_eps``; the norm's nodes go where nothing else reads them. Returns how many GEMVs now normalise."""
    count, dead = 0, []
    for node in list(gm.graph.nodes):
        if not _call(node, GEMV) or node.kwargs.get("silu_gate") or "norm_weight" in node.kwargs:
            continue
        found = rms_norm_input(gm, node.args[0])
        if found is None:
            continue
        h, g, eps, nodes = found
        node.args = (h, *node.args[1:])
        node.kwargs = {**node.kwargs, "norm_weight": g, "norm_eps": eps}
        dead += nodes
        count += 1
    _erase_unused(gm, dead)
    return count


def fold_residual_adds(gm: GraphModule) -> int:
    """Every ``add(r, y)`` (either order) of a GEMV's output y that nothing else reads, r of y's shape and
    dtype and computed before the GEMV, becomes that GEMV's ``residual``. Returns how many adds were folded."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    count = 0
    for add in list(gm.graph.nodes):
        if not _call(add, ADD) or len(add.args) != 2 or add.kwargs:
            continue
        for y, r in _operands(add):
            if not _call(y, GEMV) or len(y.users) != 1 or "residual" in y.kwargs or not isinstance(r, Node):
                continue
            yv, rv, av = _val(y), _val(r), _val(add)
            if None in (yv, rv, av) or not (yv.shape == rv.shape == av.shape and yv.dtype == rv.dtype == av.dtype):
                continue
            if order[r] > order[y]:
                continue
            y.kwargs = {**y.kwargs, "residual": r}
            add.replace_all_uses_with(y)
            gm.graph.erase_node(add)
            count += 1
            break
    return count


def linears_to_gemv(gm: GraphModule, fold_norms: bool = True) -> int:
    """Retarget every ``aten.linear`` call of ``gm`` to ``kvpass::gemv`` (same arguments), with a SiLU gate
    folded into the call that reads it and (``fold_norms``) RMSNorms and residual adds into the calls around
    them (``fold_rms_norms``, ``fold_residual_adds``). Returns how many linears were retargeted."""
    count = 0
    for node in list(gm.graph.nodes):
        if not _call(node, LINEAR):
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
    if count and fold_norms:
        fold_rms_norms(gm)
        fold_residual_adds(gm)
    if count:
        gm.graph.lint()
        gm.recompile()
    return count
