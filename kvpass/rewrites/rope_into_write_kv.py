"""Decode RoPE -> ``kvpass::rope_write_kv``: the step's rotations of q and k run in the launch that writes the cache.

In a decode graph each layer rotates its query and key (transformers' ``apply_rotary_pos_emb``:
``x * cos + rotate_half(x) * sin``) and then hands k to ``write_kv`` and q to the attention op. Inductor
compiles the two rotations into two kernels of their own (their consumers are opaque custom ops), each
about a microsecond and a half of a step that, at batch 1, is launch-bound between its GEMVs. Where a
``write_kv`` writes rope(k) and the same layer's query is rope(q) with the same cos and sin, this pass
replaces the write by ``rope_write_kv(..., q, k, v, cos, sin)``, which returns rope(q) for every reader of
the rotated query: two launches fewer a layer. Phi-3's partial form (the first r features rotated, the rest
concatenated back) is matched too; other forms (interleaved, or anything not op for op) are left as they are. Run by ``compile_model`` on the decode graph of a
CUDA model; the op is the same rotation and writes off CUDA, op for op (tests/rewrites/).
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

import kvpass.kernels  # noqa: F401  (registers torch.ops.kvpass)
from kvpass.rewrites.linears_to_gemv import is_call

WRITE_KV, ROPE_WRITE_KV = torch.ops.kvpass.write_kv.default, torch.ops.kvpass.rope_write_kv.default
ADD, MUL, CAT = torch.ops.aten.add.Tensor, torch.ops.aten.mul.Tensor, torch.ops.aten.cat.default
NEG, SLICE, ALIAS = torch.ops.aten.neg.default, torch.ops.aten.slice.Tensor, torch.ops.aten.alias.default
BIG = 2 ** 62                                        # a slice's "to the end" (sys.maxsize in traced graphs)


def _val(node: object):
    return node.meta.get("val") if isinstance(node, Node) else None


def _half_slice(node: object, x: Node, lo: int, hi: int | None, dims: int) -> bool:
    """node is x[..., lo:hi] along the last of ``dims`` dims (hi None: to the end)."""
    if not is_call(node, SLICE) or node.args[0] is not x or node.args[1] not in (-1, dims - 1):
        return False
    end = node.args[3] if len(node.args) > 3 else None
    return node.args[2] == lo and (end == hi or (hi is None and (end is None or end >= BIG)))


def rotary_input(node: object) -> tuple[Node, Node, Node, list[Node]] | None:
    """(x, cos, sin, the rotation's nodes) when node is ``x * cos + cat(-x[..., h:], x[..., :h]) * sin`` with h
    half of x's last dim (either order of each sum and product), or Phi-3's partial form
    ``cat(rope(x[..., :r]), x[..., r:])``; else None. The op computes exactly these expressions wherever its
    kernel does not apply, so cos and sin may be of any shape that broadcasts."""
    if is_call(node, CAT):
        return _partial_rotary_input(node)
    if not is_call(node, ADD) or len(node.args) != 2 or node.kwargs:
        return None
    for plain, turned in (node.args, node.args[::-1]):
        if not (is_call(plain, MUL) and is_call(turned, MUL)):
            continue
        for x, cos in (plain.args, plain.args[::-1]):
            for cat, sin in (turned.args, turned.args[::-1]):
                found = _rotation(x, cos, cat, sin)
                if found is not None:
                    return x, cos, sin, [node, plain, turned, *found]
    return None


def _partial_rotary_input(node: Node) -> tuple[Node, Node, Node, list[Node]] | None:
    """``cat(rope(x[..., :r]), x[..., r:])`` along the last dim of a 4-d x (Phi-3, GPT-NeoX): (x, cos, sin, nodes)."""
    parts = node.args[0]
    if len(parts) != 2 or (len(node.args) > 1 and node.args[1] not in (-1, 3)) or not is_call(parts[0], ADD):
        return None
    inner = rotary_input(parts[0])
    if inner is None or not (is_call(head := inner[0], SLICE) or is_call(head, ALIAS)) or _val(head) is None:
        return None
    x, r = head.args[0], _val(head).shape[-1]              # x[..., :D] is traced as an alias of x
    if not ((is_call(head, ALIAS) or _half_slice(head, x, 0, r, 4)) and _half_slice(parts[1], x, r, None, 4)):
        return None
    return x, inner[1], inner[2], [node, *inner[3], head, parts[1]]


def _rotation(x: object, cos: object, cat: object, sin: object) -> list[Node] | None:
    xv, cv, sv = _val(x), _val(cos), _val(sin)
    if None in (xv, cv, sv) or not is_call(cat, CAT) or xv.dim() != 4 or xv.shape[-1] % 2:
        return None
    d = xv.shape[-1]
    if not cv.shape[-1] == sv.shape[-1] == d:         # the op rotates cos.shape[-1] features (its reference)
        return None
    parts = cat.args[0]
    if len(parts) != 2 or (len(cat.args) > 1 and cat.args[1] not in (-1, 3)) or not is_call(parts[0], NEG):
        return None
    h = d // 2
    if not (_half_slice(parts[0].args[0], x, h, None, 4) and _half_slice(parts[1], x, 0, h, 4)):
        return None
    return [cat, parts[0], parts[0].args[0], parts[1]]


def _queries_of(gm: GraphModule, write: Node) -> list[tuple[Node, tuple]]:
    """The rotated queries read with ``write``'s cache: (rope node, its rotary_input) of each other node that
    reads the layer's K cache and takes a rotated tensor as its first argument (the attention)."""
    k_cache = write.args[0]
    found = []
    for user in k_cache.users:
        if user is write or not user.args or user.args[0] is k_cache:
            continue
        rope = rotary_input(user.args[0])
        if rope is not None and not any(r[0] is user.args[0] for r in found):
            found.append((user.args[0], rope))
    return found


def rope_into_write_kv(gm: GraphModule) -> int:
    """Every ``write_kv`` whose new key is rope(k) and whose layer attends with rope(q) (same cos, sin, q of k's
    dtype, every reader of rope(q) after the write) becomes ``rope_write_kv``; rope(q)'s readers read its
    output. Returns how many writes were fused."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    count = 0
    for write in list(gm.graph.nodes):
        if not is_call(write, WRITE_KV) or len(write.args) != 8 or write.kwargs:
            continue
        k_rope = rotary_input(write.args[6])
        queries = _queries_of(gm, write)
        if k_rope is None or len(queries) != 1 or len(write.args[6].users) != 1:
            continue
        q_node, (q, cos, sin, q_nodes) = queries[0]
        k, k_cos, k_sin, k_nodes = k_rope
        if (cos, sin) != (k_cos, k_sin) or any(order[u] < order[write] for u in q_node.users):
            continue
        with gm.graph.inserting_before(write):
            fused = gm.graph.call_function(ROPE_WRITE_KV, (*write.args[:6], q, k, write.args[7], cos, sin))
        fused.meta["val"] = q_node.meta.get("val")
        q_node.replace_all_uses_with(fused)
        gm.graph.erase_node(write)
        for node in sorted({*q_nodes, *k_nodes}, key=order.__getitem__, reverse=True):
            if not node.users:
                gm.graph.erase_node(node)
        count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count
