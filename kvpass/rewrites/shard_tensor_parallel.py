"""Shard the captured graph Megatron-style over ``world`` ranks (tensor parallelism); run before
``insert_compressed_cache``, so the prefill and decode graphs built from it are this rank's.

    q, k, v projections    column-parallel by heads: rank r keeps heads [r H/N, (r+1) H/N) (and their bias)
    o projection           row-parallel (its input columns of those heads), then an all-reduce (sum)
    gate, up (or fc1)      column-parallel by rows of the intermediate size
    down (or fc2)          row-parallel, then an all-reduce (sum)
    LM head                column-parallel by vocabulary rows, then an all-gather of the logits
                           (replicated where N does not divide the vocabulary or the weight is tied to
                           an input embedding that the graph also reads)
    embedding, norms       replicated

A bias of a row-parallel linear is added once, after the all-reduce. The sharded parameters are the
model's own, re-pointed at this rank's rows or columns (``param.data``), so each rank holds 1/N of the
projection weights; the model object is then this rank's shard. The collectives are
``torch.ops._c10d_functional`` ops (all_reduce / all_gather_into_tensor + wait_tensor), which trace,
export and replay in CUDA graphs.

What the pass proves before it touches anything, refusing (``UnsupportedModel``) otherwise: each
attention site's q, k and v come from their own ``aten.linear`` (a fused qkv projection is refused),
its output reaches exactly one linear (o) through reshapes only; every other linear is an LM head or
belongs to an MLP whose up-projections read one activation and reach the down-projection through
pointwise ops only; N divides the query heads, the KV heads and each MLP's intermediate size. After
sharding, ``check_sharded_prefill`` runs the prefill graph built from it on fake tensors and checks that
each attention op sees H/N query and Hkv/N KV heads (a head count baked into a reshape fails there) and
that the logits keep the whole vocabulary.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, replace

import torch
from torch import Tensor
from torch.fx import GraphModule, Node

from kvpass.errors import UnsupportedModel
from kvpass.rewrites.attention_sites import AttentionSite
from kvpass.rewrites.fuse_sibling_linears import attr_value

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
LINEAR = aten.linear.default

# Between the attention output and the o projection: layout only.
_RESHAPING = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.transpose.int,
              aten.permute.default, aten.contiguous.default, aten.clone.default, aten.alias.default,
              aten._to_copy.default, aten.to.dtype, aten.flatten.using_ints}
# Between an MLP's up-projections and its down-projection: pointwise ops, and these.
_POINTWISE_EXTRA = {aten._to_copy.default, aten.to.dtype, aten.type_as.default, aten.alias.default,
                    aten.clone.default, aten.contiguous.default, aten.dropout.default}
# What the logits gather inserts after the LM head (insert_compressed_cache walks back through them).
LOGITS_GATHER_OPS = (c10d.all_gather_into_tensor.default, c10d.wait_tensor.default, aten.unflatten.int,
                     aten.permute.default, aten.flatten.using_ints)


@dataclass(frozen=True)
class Shard:
    """This process's place: rank ``rank`` of ``world``, collectives over the group ``group_name``."""

    rank: int
    world: int
    group_name: str


def _is_linear(node: Node) -> bool:
    return node.op == "call_function" and node.target is LINEAR


def _weight(node: Node) -> Node:
    w = node.args[1]
    if not (isinstance(w, Node) and w.op == "get_attr"):
        raise UnsupportedModel(f"tensor parallel: linear {node.name} has a computed weight, not a parameter")
    return w


def _bias(node: Node) -> Node | None:
    b = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    if b is not None and not (isinstance(b, Node) and b.op == "get_attr"):
        raise UnsupportedModel(f"tensor parallel: linear {node.name} has a computed bias, not a parameter")
    return b


def nearest_linears(start: Node) -> tuple[set[Node], set[Node]]:
    """(the linears ``start`` depends on with no other linear between, the nodes walked through)."""
    found, seen, todo = set(), set(), [start]
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if _is_linear(node):
            found.add(node)
            continue
        todo.extend(node.all_input_nodes)
    return found, seen - found


def _pointwise(node: Node) -> bool:
    if node.op in ("get_attr", "placeholder"):
        return True
    if node.op != "call_function":
        return False
    tags = getattr(node.target, "tags", ())
    return torch.Tag.pointwise in tags or node.target in _POINTWISE_EXTRA or node.target is operator.getitem


def _o_projection(site: AttentionSite) -> Node:
    """The one linear the attention output reaches through reshapes."""
    node = site.output
    while True:
        users = list(node.users)
        if len(users) == 1 and _is_linear(users[0]) and users[0].args[0] is node:
            return users[0]
        if len(users) != 1 or users[0].op != "call_function" or users[0].target not in _RESHAPING:
            raise UnsupportedModel(f"tensor parallel: layer {site.layer}'s attention output does not reach one "
                                   f"o projection through reshapes only (at {node.name})")
        node = users[0]


def _projection(site: AttentionSite, which: str) -> Node:
    linears, _ = nearest_linears(getattr(site, which))
    if len(linears) != 1:
        raise UnsupportedModel(f"tensor parallel: layer {site.layer}'s {which} comes from {len(linears)} linears "
                               f"({sorted(n.name for n in linears)}), not one {which} projection")
    return next(iter(linears))


@dataclass
class _Plan:
    column: dict[Node, int]       # linear -> the parts its output rows split into (heads, or 1 for the MLP)
    row: list[Node]               # linears followed by an all-reduce
    lm_head: Node | None


def _logits_linear(gm: GraphModule) -> Node | None:
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    node = out[0] if isinstance(out, (tuple, list)) else out
    while isinstance(node, Node) and not _is_linear(node) and node.op == "call_function" and _pointwise(node):
        node = node.args[0]
    return node if isinstance(node, Node) and _is_linear(node) else None


def plan_shards(gm: GraphModule, sites: list[AttentionSite], world: int) -> _Plan:
    """Classify every linear of ``gm`` (or refuse); see the module docstring."""
    column: dict[Node, int] = {}
    row: list[Node] = []
    for site in sites:
        if site.kv_repeat != 1:
            raise UnsupportedModel("tensor parallel: shard before expand_kv_heads (the sites are already expanded)")
        for name, heads in (("query", site.n_heads), ("KV", site.n_kv_heads)):
            if heads % world:
                raise UnsupportedModel(f"tensor parallel: tp={world} does not divide layer {site.layer}'s {heads} "
                                       f"{name} heads; use a tp that divides both {site.n_heads} and {site.n_kv_heads}")
        q, k, v = (_projection(site, w) for w in ("q", "k", "v"))
        if len({q, k, v}) < 3:
            raise UnsupportedModel(f"tensor parallel: layer {site.layer} computes q, k and v with a fused linear "
                                   f"({q.name}); tensor parallelism needs separate q, k, v projections")
        column.update({q: site.n_heads, k: site.n_kv_heads, v: site.n_kv_heads})
        row.append(_o_projection(site))
    lm_head = _logits_linear(gm)
    taken = set(column) | set(row) | {lm_head}
    for node in reversed(gm.graph.nodes):          # a down projection before its up projections
        if not _is_linear(node) or node in taken:
            continue
        ups, between = nearest_linears(node.args[0])
        if (not ups or ups & taken or len({u.args[0] for u in ups}) != 1
                or not all(_pointwise(n) for n in between if n.op != "placeholder")
                or any(u.args[0] in between for u in ups)):
            raise UnsupportedModel(f"tensor parallel: cannot prove the structure around linear {node.name} "
                                   f"({_weight(node).target}); only attention q/k/v/o, gated or plain MLPs and the "
                                   "LM head are sharded")
        for up in ups:
            if any(_is_linear(u) and u is not node or not (_is_linear(u) or _pointwise(u)) for u in _forward(up, node)):
                raise UnsupportedModel(f"tensor parallel: MLP projection {up.name} is read by more than its "
                                       f"down projection {node.name}")
            column[up] = 1
        row.append(node)
        taken |= ups | {node}
    return _Plan(column, row, lm_head)


def _forward(start: Node, stop: Node) -> set[Node]:
    """Nodes reachable from ``start`` before ``stop`` (inclusive of where the walk ends)."""
    seen, todo = set(), list(start.users)
    while todo:
        node = todo.pop()
        if node in seen or node is stop:
            continue
        seen.add(node)
        if not _is_linear(node):
            todo.extend(node.users)
    return seen


# The attribute a parameter sharded in place carries: (rank, world). The model's own parameters become the rank's
# shards, so a later kvpass.apply of that model without the sharded capture would shard it again, or run a
# one-process rewrite on a fraction of its weights: both refused (rule "model.sharded", kvpass/validation.py).
SHARD_MARK = "kvpass_shard"


def sharded_for(model: torch.nn.Module) -> tuple[int, int] | None:
    """(rank, world) of a model whose parameters ``shard_tensor_parallel`` sharded in place, else None."""
    for p in model.parameters():
        mark = getattr(p, SHARD_MARK, None)
        if mark is not None:
            return mark
    return None


def _narrowed(t: Tensor, dim: int, rank: int, world: int) -> Tensor:
    """This rank's part of ``t`` along ``dim``, in storage of its own: a view (``.contiguous()`` of rows is
    one) would keep the whole tensor's storage alive, and the rank would hold all of the weight."""
    n = t.shape[dim] // world
    return t.narrow(dim, rank * n, n).clone(memory_format=torch.contiguous_format)


def _readers(gm: GraphModule) -> dict[int, int]:
    """id(tensor) -> how many graph nodes read it (through any get_attr name)."""
    count: dict[int, int] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            key = id(attr_value(gm, node.target))
            count[key] = count.get(key, 0) + len(node.users)
    return count


def _shard_param(gm: GraphModule, getattr_node: Node, dim: int, shard: Shard, readers: dict[int, int],
                 linear: Node) -> None:
    """Re-point the parameter at its shard (or, when something else reads it, give this linear a buffer)."""
    t = attr_value(gm, getattr_node.target)
    if t.shape[dim] % shard.world:
        raise UnsupportedModel(f"tensor parallel: tp={shard.world} does not divide dim {dim} ({t.shape[dim]}) of "
                               f"{getattr_node.target}")
    part = _narrowed(t.detach(), dim, shard.rank, shard.world)
    if readers.get(id(t), 0) <= 1 and isinstance(t, torch.nn.Parameter):
        t.data = part
        setattr(t, SHARD_MARK, (shard.rank, shard.world))     # kvpass.apply refuses the model without its capture
        return
    name = "tp_" + getattr_node.target.replace(".", "_")
    while hasattr(gm, name):
        name += "_"
    gm.register_buffer(name, part, persistent=False)
    with gm.graph.inserting_before(linear):
        new = gm.graph.get_attr(name)
    linear.replace_input_with(getattr_node, new)


def _all_reduce_after(gm: GraphModule, linear: Node, shard: Shard) -> None:
    """linear(x, w[, b]) -> wait(all_reduce(linear(x, w), sum)) [+ b]."""
    graph, bias = gm.graph, _bias(linear)
    if bias is not None:
        linear.args = linear.args[:2]
        linear.kwargs = {k: v for k, v in linear.kwargs.items() if k != "bias"}
    with graph.inserting_after(linear):
        reduced = graph.call_function(c10d.all_reduce.default, (linear, "sum", shard.group_name))
    with graph.inserting_after(reduced):
        done = graph.call_function(c10d.wait_tensor.default, (reduced,))
    last = done
    if bias is not None:
        with graph.inserting_after(done):
            last = graph.call_function(aten.add.Tensor, (done, bias))
    linear.replace_all_uses_with(last, delete_user_cb=lambda u: u is not reduced)


def _all_gather_logits(gm: GraphModule, linear: Node, shard: Shard, rank_of_output: int) -> None:
    """[..., V/N] per rank -> [..., V] in rank order: gather along dim 0 as [N * B, ...], then move the
    rank dimension next to the vocabulary."""
    graph, r = gm.graph, rank_of_output
    with graph.inserting_after(linear):
        gathered = graph.call_function(c10d.all_gather_into_tensor.default, (linear, shard.world, shard.group_name))
    nodes = [gathered]
    for target, args in ((c10d.wait_tensor.default, ()), (aten.unflatten.int, (0, [shard.world, -1])),
                         (aten.permute.default, ([*range(1, r), 0, r],)), (aten.flatten.using_ints, (r - 1, r))):
        with graph.inserting_after(nodes[-1]):
            nodes.append(graph.call_function(target, (nodes[-1], *args)))
    linear.replace_all_uses_with(nodes[-1], delete_user_cb=lambda u: u is not gathered)


def shard_tensor_parallel(gm: GraphModule, sites: list[AttentionSite], shard: Shard) -> list[AttentionSite]:
    """Shard ``gm`` (in place, recompiled) for ``shard``; returns the sites as this rank sees them (H/N
    query heads, Hkv/N KV heads). With ``shard.world == 1`` nothing changes and ``sites`` come back as given."""
    if shard.world == 1:
        return list(sites)
    plan = plan_shards(gm, sites, shard.world)
    readers = _readers(gm)
    logits_val = plan.lm_head.meta.get("val") if plan.lm_head is not None else None
    vocab_rows = attr_value(gm, _weight(plan.lm_head).target).shape[0] if plan.lm_head is not None else 1
    shard_lm = plan.lm_head is not None and vocab_rows % shard.world == 0 and logits_val is not None
    for linear in plan.column:
        _shard_param(gm, _weight(linear), 0, shard, readers, linear)
        if _bias(linear) is not None:
            _shard_param(gm, _bias(linear), 0, shard, readers, linear)
    for linear in plan.row:
        _shard_param(gm, _weight(linear), 1, shard, readers, linear)
        _all_reduce_after(gm, linear, shard)
    if shard_lm:
        _shard_param(gm, _weight(plan.lm_head), 0, shard, readers, plan.lm_head)
        if _bias(plan.lm_head) is not None:
            _shard_param(gm, _bias(plan.lm_head), 0, shard, readers, plan.lm_head)
        _all_gather_logits(gm, plan.lm_head, shard, logits_val.dim())
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return [replace(s, n_heads=s.n_heads // shard.world, n_kv_heads=s.n_kv_heads // shard.world) for s in sites]


def logits_width(gm: GraphModule) -> int | None:
    """The vocabulary of the captured graph's logits, from its recorded (fake) output value."""
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    node = out[0] if isinstance(out, (tuple, list)) else out
    val = node.meta.get("val") if isinstance(node, Node) else None
    return None if val is None else int(val.shape[-1])


def check_sharded_prefill(prefill: GraphModule, sites: list[AttentionSite], vocab: int | None) -> None:
    """Run a sharded prefill graph on fake inputs (one row of 3 tokens) and check that its attention ops see
    each site's (rank-local) query and KV heads and that its logits keep all ``vocab`` entries."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    attention = {torch.ops.kvpass.prefill_attention.default, torch.ops.kvpass.prefill_attention_lse.default}
    seen: list[tuple[int, int]] = []

    class Probe(torch.fx.Interpreter):
        def call_function(self, target, args, kwargs):
            if target in attention:
                seen.append((args[0].shape[1], args[1].shape[1]))
            return super().call_function(target, args, kwargs)

    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            ids = torch.ones(1, 3, dtype=torch.long, device=_device(prefill))
            out = Probe(prefill).run(ids, torch.arange(3, device=ids.device)[None], torch.zeros_like(ids[:, 0]))
    except Exception as err:           # a head count baked into a reshape, a broadcast that no longer fits...
        raise UnsupportedModel(f"tensor parallel: the sharded graph does not run ({type(err).__name__}: {err}); "
                               "this model's structure is not one the pass can shard") from err
    want = [(s.n_heads, s.n_kv_heads) for s in sites]
    if seen != want:
        raise UnsupportedModel(f"tensor parallel: after sharding the attention sees (query, KV) heads {seen}, "
                               f"expected {want}")
    if vocab is not None and out[0].shape[-1] != vocab:
        raise UnsupportedModel(f"tensor parallel: sharded logits have {out[0].shape[-1]} entries, not {vocab}")


def _device(gm: GraphModule) -> torch.device:
    for t in gm.parameters():
        return t.device
    for t in gm.buffers():
        return t.device
    return torch.device("cpu")


__all__ = ["LOGITS_GATHER_OPS", "Shard", "check_sharded_prefill", "logits_width", "nearest_linears", "plan_shards",
           "shard_tensor_parallel"]
