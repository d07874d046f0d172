"""replace_sym_ops_with_builtins: torch.sym_min / sym_max nodes call min / max, the graph computes the
same tensors (eagerly and under torch.compile with static shapes), the weights are shared, and the
input graph module is left as it was."""

from __future__ import annotations

import builtins

import torch
from torch.fx import Graph, GraphModule

from kvpass.rewrites.sym_ops_to_builtins import replace_sym_ops_with_builtins

aten = torch.ops.aten


def _graph_with_sym_ops() -> GraphModule:
    """x [N] -> (x[:min(N, 3)] * w[:min(N, 3)], x[:max(N - 2, 1)]): export's symbolic-size pattern."""
    root = torch.nn.Module()
    root.w = torch.nn.Parameter(torch.randn(8))
    g = Graph()
    x = g.placeholder("x")
    w = g.get_attr("w")
    n = g.call_function(aten.sym_size.int, (x, 0))
    lo = g.call_function(torch.sym_min, (n, 3))
    hi = g.call_function(torch.sym_max, (g.call_function(_sub, (n, 2)), 1))
    head = g.call_function(aten.mul.Tensor, (g.call_function(aten.slice.Tensor, (x, 0, 0, lo)),
                                             g.call_function(aten.slice.Tensor, (w, 0, 0, lo))))
    g.output((head, g.call_function(aten.slice.Tensor, (x, 0, 0, hi))))
    return GraphModule(root, g)


def _sub(a, b):
    return a - b


def _targets(gm: GraphModule) -> set:
    return {n.target for n in gm.graph.nodes if n.op == "call_function"}


def test_sym_ops_become_builtins_and_values_are_kept():
    gm = _graph_with_sym_ops()
    out = replace_sym_ops_with_builtins(gm)
    assert {torch.sym_min, torch.sym_max} <= _targets(gm)                 # the input is unchanged
    assert not {torch.sym_min, torch.sym_max} & _targets(out)
    assert {builtins.min, builtins.max} <= _targets(out)
    assert out.w is gm.w                                                  # shared, not copied
    for n in (2, 5):
        x = torch.randn(n)
        for got, want in zip(out(x), gm(x), strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_result_compiles_with_static_shapes():
    torch._dynamo.reset()
    gm = _graph_with_sym_ops()
    compiled = torch.compile(replace_sym_ops_with_builtins(gm), fullgraph=True, dynamic=False, backend="eager")
    x = torch.randn(6)
    for got, want in zip(compiled(x), gm(x), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_graph_without_sym_ops_is_returned_as_is():
    g = Graph()
    x = g.placeholder("x")
    g.output(g.call_function(aten.neg.default, (x,)))
    gm = GraphModule(torch.nn.Module(), g)
    assert replace_sym_ops_with_builtins(gm) is gm
