"""Make a captured graph traceable by Dynamo again: ``torch.sym_min`` / ``torch.sym_max`` nodes become
Python's ``min`` / ``max``.

torch.export leaves symbolic-integer arithmetic in the graph as call_function nodes over sizes
(``sym_size.int``); on CUDA, torch 2.11 writes some of it with ``torch.sym_min`` (e.g.
``min(128*T, 512*T)`` of an SDPA shape check). Run eagerly those nodes compute plain ints. But
``torch.compile`` of the graph module (the "kvpass" backend's prefill and decode graphs) fails there:
with static shapes the sizes are plain ints, and Dynamo rejects a ``torch.*`` call that returns a
non-tensor ("torch.* op returned non-Tensor"). The builtins compute the same value on ints and on
SymInts, and Dynamo traces them. Other nodes are untouched; the weights are shared, not copied.
"""

from __future__ import annotations

import builtins

import torch
from torch.fx import Graph, GraphModule

SYM_OP_BUILTINS = {torch.sym_min: builtins.min, torch.sym_max: builtins.max}


def replace_sym_ops_with_builtins(gm: GraphModule) -> GraphModule:
    """A new GraphModule over ``gm``'s parameters and buffers whose ``torch.sym_min``/``sym_max``
    nodes call ``min``/``max``; ``gm`` itself is unchanged (returned as is when it has none)."""
    if not any(n.op == "call_function" and n.target in SYM_OP_BUILTINS for n in gm.graph.nodes):
        return gm
    graph = Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    for node in graph.nodes:
        if node.op == "call_function" and node.target in SYM_OP_BUILTINS:
            node.target = SYM_OP_BUILTINS[node.target]
    return GraphModule(gm, graph, class_name=type(gm).__name__)
