"""Rewrite: the captured no-cache forward -> the prefill and decode-step graphs.

Both graphs are copies of the captured graph that share its weights; each attention site is
replaced by a ``kvpass.kernels`` op.

prefill(input_ids [B, T], position_ids [B, T], pad [B])
    -> (logits [B, 1, V] (or [B, T, V]), k_0, v_0, ..., k_{L-1}, v_{L-1}, *stats)
    k_l, v_l: [B, Hkv, T, D] post-RoPE KV-head tensors; pad = left pads per row;
    stats: for each compressible layer, each statistic the policy asks for, [B, Hkv, T] fp32 (per slot)
    or [B, H] fp32 (per head, e.g. Stat.HEAD_VARIANCE).
decode(input_ids [B, 1], position_ids [B, 1], then per layer the inputs its ``LayerInputs`` names, in the
       order of kvpass/rewrites/decode_layout.py: k_cache_l, v_cache_l, log_weight_l, slot_l, position_l, and, for
       full-attention layers, the policy's ``decode_inputs`` of that layer)
    -> (logits [B, 1, V], *scores)
    writes the step's K, V (and its position) into slot_l of the cache buffers in place, then attends over the cache with
    the policy's decode op (sliding-window layers always with the dense op: a ring is never recalled);
    scores: [B, Hkv, C_l] fp32 per compressible layer when the policy accumulates attention, except the layers
    whose scores are deferred (``FusedDecodeStatistics.deferred_scores`` m > 0, ``deferred_score_layers`` below):
    their inputs end with recent_query_l [B, Hq, m, D] and recent_position_l [B, m] int64, a ring the step writes
    its query and position into (``kvpass::write_query``), and their attention returns no scores (the runtime
    computes the kept queries' rows before the layer's next compression, kvpass/runtime/recent_queries.py).
    Where the policy names candidate slots whose nearest keys its next compression seeks
    (``FusedDecodeStatistics.nearest_candidates`` M > 0: D2O's one-in-one-out step, ``nearest_search_layers``
    below), a layer's inputs end with the six tensors of ``NEAREST_INPUTS`` and it attends with
    ``kvpass::decode_attention_nearest``, which finds them from its read of K.
    A layer some of whose KV heads keep every token (``Policy.full_kv_heads``, Chelsea's outlier heads)
    is split into two dense sub-groups (docs/policies.md §0.6 b): k_cache_l, v_cache_l, log_weight_l, slot_l,
    position_l (and the scores) cover its other heads, in order, [B, Hkv - F, C_l, ...], and the inputs
    k_full_l, v_full_l, log_weight_full_l, slot_full_l, position_full_l that follow the policy's inputs hold the F full
    heads [B, F, C_full, ...]; each group attends with its own query heads and the outputs are put back
    into head order. A layer all of whose heads are full is not split (one dense cache, never compressed).

With ``policy.expand_kv_heads`` (docs/policies.md §0.5) every site's cache is per query head: the graphs
repeat each layer's k, v to [B, Hq, T, D] (``repeat_cached_kv``) before the cache, the statistics and
the attention see them, so Hkv reads Hq above, the statistics are per query head (nothing averaged
over a group) and decode attention runs with G = 1. Policies see nothing else (``expand_kv_heads``).
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.fx import Graph, GraphModule, Node

import kvpass.kernels  # noqa: F401  (registers torch.ops.kvpass)
from kvpass.cache import LayerCache, entries_from_prompt
from kvpass.kernels.decode_attention_nearest import NEAREST_INPUTS
from kvpass.policies.base import Attention, Policy, Stat
from kvpass.policies.capabilities import deferred_scores, nearest_candidates
from kvpass.quantization.policy import kv_dtype_of
from kvpass.rewrites.attention_sites import (
    AttentionSite,
    expand_kv_heads,
    expanded_head_indices,
    per_model_kv_head,
    repeat_cached_kv,
)
from kvpass.rewrites.decode_layout import (
    CACHE_INPUTS,
    FULL_INPUTS,
    RECENT_INPUTS,
    SCALE_INPUTS,
    DecodeLayout,
    LayerInputs,
)
from kvpass.rewrites.shard_tensor_parallel import LOGITS_GATHER_OPS

log = logging.getLogger(__name__)
aten = torch.ops.aten
ops = torch.ops.kvpass

# Attention variant -> decode op. New variants (cluster / page recall) add an entry here.
DECODE_ATTENTION_OPS = {Attention.DENSE: ops.decode_attention.default,
                        Attention.PAGE_RECALL: ops.page_recall_attention.default,
                        Attention.CLUSTER_RECALL: ops.cluster_recall_attention.default,
                        Attention.EMS_EXPANSION: ops.ems_expansion_attention.default}
# Statistic -> prefill op computing it per layer (q, k, pad, scale, window, softcap, **policy.stat_options)
# -> [B, Hkv, T] fp32 for per-slot statistics, [B, H] fp32 for per-head ones (Stat.per_slot).
PREFILL_STAT_OPS = {Stat.COLUMN_SUM: ops.attention_column_sums.default,
                    Stat.WINDOW_SCORES: ops.attention_window_scores.default,
                    Stat.HEAD_VARIANCE: ops.attention_head_variance.default,
                    Stat.LAST_ATTENTION: ops.attention_window_scores.default}   # obs_window 1: the policy's options
# Statistics whose ops take the prompt rows' log-sum-exps (``lse``) from ``prefill_attention_lse``, so
# that only their column pass runs over the n x n logits.
LSE_STATS = frozenset({Stat.COLUMN_SUM, Stat.HEAD_VARIANCE})
# Statistics every decode step updates from its attention row: added (col_sum) or replaced (last_attn),
# as ``Stat.accumulates`` says; the runtime applies the rows the decode graph returns.
DECODE_STATS = frozenset({Stat.COLUMN_SUM, Stat.LAST_ATTENTION})

_ELEMENTWISE = (aten.div.Tensor, aten.mul.Tensor, aten.tanh.default, aten.to.dtype, aten._to_copy.default,
                aten.alias.default, aten.clone.default, aten.contiguous.default)


@dataclass(frozen=True)
class RewrittenGraphs:
    """What ``kvpass.rewrites.compile_model`` builds: the prefill graph and (unless prefill only, None) the
    decode graph, the sites they rewrote, which statistics the prefill returns and which layers' step
    scores the decode graph returns, the KV heads kept full, and whether sibling linears were fused."""

    prefill: GraphModule
    decode: GraphModule | None
    sites: tuple[AttentionSite, ...]
    prefill_stats: tuple[tuple[int, Stat], ...]    # (layer, stat) of each stats output, in order
    decode_scores: tuple[int, ...]                 # layers whose step scores the decode graph returns
    deferred_scores: tuple[int, ...] = ()          # layers whose step queries the decode graph keeps instead
    nearest_layers: tuple[int, ...] = ()           # layers whose attention also seeks the candidates' nearest keys
    full_heads: dict[int, tuple[int, ...]] = field(default_factory=dict)   # layer -> KV heads kept full
    fused_linears: bool = False                    # fuse_sibling_linears ran on both graphs
    decode_layout: DecodeLayout | None = None      # the decode graph's inputs per site (None: prefill only)

    def split_prefill(self, outs) -> tuple[Tensor, list[Tensor], dict[int, dict[str, Tensor]]]:
        """The prefill graph's outputs -> (logits, [k_0, v_0, ..., k_{L-1}, v_{L-1}] each [B, Hkv, T, D],
        {layer: {stat name: [B, Hkv, T] or [B, H] fp32}})."""
        n = len(self.sites)
        stats: dict[int, dict[str, Tensor]] = {}
        for (layer, stat), value in zip(self.prefill_stats, outs[1 + 2 * n:], strict=True):
            stats.setdefault(layer, {})[stat.value] = value
        return outs[0], list(outs[1:1 + 2 * n]), stats


def prompt_cache(k: Tensor, v: Tensor, pad: Tensor, stats: dict[str, Tensor]) -> LayerCache:
    """One layer's prefill outputs as a cache of capacity T: the prompt's entries with left pads compacted away
    (``entries_from_prompt``), its per-slot statistics in ``slot_meta`` (moved alike), its per-head ones
    (``Stat.per_slot`` False) in ``state``. k, v: [B, Hkv, T, D]; pad: [B]."""
    cache = entries_from_prompt(k, v, pad, {n: x for n, x in stats.items() if Stat(n).per_slot})
    cache.state.update({n: x for n, x in stats.items() if not Stat(n).per_slot})
    return cache


def copy_graph(gm: GraphModule) -> tuple[Graph, dict[Node, Node], object]:
    """A fresh copy of gm's graph (no output node yet), the node map, and the output value."""
    graph = Graph()
    env: dict[Node, Node] = {}
    out = graph.graph_copy(gm.graph, env)
    return graph, env, out


def _add_inputs(graph: Graph, names: list[str]) -> list[Node]:
    last = [n for n in graph.nodes if n.op == "placeholder"][-1]
    nodes = []
    with graph.inserting_after(last):
        for name in reversed(names):
            nodes.insert(0, graph.placeholder(name))
    return nodes


def _keep_last_position(graph: Graph, logits: Node) -> None:
    """Compute the LM head for the last position only: slice its [B, T, H] input to [B, 1, H]."""
    node = logits
    while node.target in _ELEMENTWISE or node.target in LOGITS_GATHER_OPS:   # (tensor parallel: the logits' gather)
        node = node.args[0]
    if node.target in (aten.linear.default, aten.matmul.default):
        hidden = node.args[0]
        with graph.inserting_before(node):
            last = graph.call_function(aten.slice.Tensor, (hidden, 1, -1, 2**63 - 1))
        node.replace_input_with(hidden, last)
    else:
        with graph.inserting_after(logits):
            last = graph.call_function(aten.slice.Tensor, (logits, 1, -1, 2**63 - 1))
        logits.replace_all_uses_with(last, delete_user_cb=lambda u: u is not last)


# Ops FX's dead-code elimination keeps because they are tagged random (dropout), though in an eval
# graph they are pure: the replaced attention (SDPA, eager dropout) would otherwise still run, prefill
# included, with its whole mask computation. Export's metadata asserts on dead tensors go with them.
_DEAD_WHEN_UNUSED = (aten.scaled_dot_product_attention.default, aten.dropout.default)
_ASSERT_METADATA = getattr(aten, "_assert_tensor_metadata", None)


def _drop_replaced_attention(graph: Graph) -> None:
    changed = True
    while changed:
        changed = False
        for node in reversed(list(graph.nodes)):
            if node.op != "call_function" or node.users:
                continue
            dead_assert = (_ASSERT_METADATA is not None and node.target == _ASSERT_METADATA.default
                           and all(len(a.users) == 1 for a in node.all_input_nodes))
            if node.target in _DEAD_WHEN_UNUSED or dead_assert:
                graph.erase_node(node)
                changed = True
        graph.eliminate_dead_code()


def _finish(graph: Graph, root: GraphModule, outputs: list[Node], name: str) -> GraphModule:
    graph.output(tuple(outputs))
    graph.eliminate_dead_code()
    _drop_replaced_attention(graph)
    graph.lint()
    gm = GraphModule(root, graph, class_name=name)
    return gm


def _logits_node(out) -> Node:
    return out[0] if isinstance(out, (tuple, list)) else out


def _prefill_stat_nodes(graph: Graph, policy: Policy, args: tuple, opts: dict, lse: Node | None) -> dict[Stat, Node]:
    """One layer's statistic nodes, in ``Stat`` value order. Column sums and head variance with the same
    options come from one ``attention_column_sums_and_head_variance`` call (one pass, not two); they take
    ``lse`` (the attention's row log-sum-exps) where they use the attention's own options."""
    stats = sorted((s for s in policy.stats if not s.after_prefill), key=lambda s: s.value)
    for stat in stats:
        if stat not in PREFILL_STAT_OPS:
            raise NotImplementedError(f"no prefill op computes {stat} yet")
    kwargs = {stat: {**opts, **policy.stat_options(stat)} for stat in stats}
    for stat in stats:
        if lse is not None and stat in LSE_STATS and not policy.stat_options(stat):
            kwargs[stat]["lse"] = lse
    nodes: dict[Stat, Node] = {}
    pair = (Stat.COLUMN_SUM, Stat.HEAD_VARIANCE)
    if all(s in kwargs for s in pair) and kwargs[pair[0]] == kwargs[pair[1]]:
        both = graph.call_function(ops.attention_column_sums_and_head_variance.default, args, kwargs[pair[0]])
        nodes = {s: graph.call_function(operator.getitem, (both, i)) for i, s in enumerate(pair)}
    return {stat: nodes[stat] if stat in nodes else graph.call_function(PREFILL_STAT_OPS[stat], args, kwargs[stat])
            for stat in stats}


def build_prefill(gm: GraphModule, sites: list[AttentionSite], policy: Policy,
                  last_logits_only: bool = True) -> tuple[GraphModule, tuple[tuple[int, Stat], ...]]:
    graph, env, out = copy_graph(gm)
    (pad,) = _add_inputs(graph, ["pad"])
    kv_outputs, stat_outputs, stat_keys = [], [], []
    for site in sites:
        target = env[site.output]
        opts = {"scale": site.scale, "window": site.window, "softcap": site.softcap}
        with graph.inserting_before(target):
            q, k, v = env[site.q], repeat_cached_kv(graph, site, env[site.k]), repeat_cached_kv(graph, site, env[site.v])
            stats_here = site.window is None and policy.compresses
            lse = None
            if stats_here and policy.stats & LSE_STATS:    # the attention also gives the rows' log-sum-exps
                both = graph.call_function(ops.prefill_attention_lse.default, (q, k, v, pad), dict(opts))
                attn, lse = (graph.call_function(operator.getitem, (both, i)) for i in range(2))
            else:
                attn = graph.call_function(ops.prefill_attention.default, (q, k, v, pad), dict(opts))
            if stats_here:
                for stat, node in _prefill_stat_nodes(graph, policy, (q, k, pad), opts, lse).items():
                    stat_outputs.append(node)
                    stat_keys.append((site.layer, stat))
        target.replace_all_uses_with(attn)
        kv_outputs += [k, v]
    if last_logits_only:
        _keep_last_position(graph, _logits_node(out))
    graph_out = [_final_logits(graph, out)] + kv_outputs + stat_outputs
    return _finish(graph, gm, graph_out, "KVPassPrefill"), tuple(stat_keys)


def _final_logits(graph: Graph, out) -> Node:
    """The logits node, or the slice inserted after it by _keep_last_position."""
    logits = _logits_node(out)
    users = [u for u in logits.users if u.target == aten.slice.Tensor and u.args[1:3] == (1, -1)]
    return users[0] if users else logits


def split_heads(full_heads: dict[int, tuple[int, ...]], sites: list[AttentionSite]) -> dict[int, tuple[int, ...]]:
    """The layers whose KV heads are split into a compressed and a full sub-group: those with some,
    but not all, heads full (a layer all of whose heads are full stays one dense cache)."""
    return {s.layer: full_heads[s.layer] for s in sites
            if full_heads.get(s.layer) and len(full_heads[s.layer]) < s.n_kv_heads}


def _runs(heads: list[int]) -> list[tuple[int, int]]:
    """Ascending indices -> maximal runs [start, stop) of consecutive ones."""
    runs: list[tuple[int, int]] = []
    for h in heads:
        if runs and runs[-1][1] == h:
            runs[-1] = (runs[-1][0], h + 1)
        else:
            runs.append((h, h + 1))
    return runs


def _take(graph: Graph, pieces: list[tuple[Node, int, int]]) -> Node:
    """cat(x[:, start:stop] for x, start, stop in pieces) along dim 1 (heads), adjacent pieces of one
    tensor fused. Slices and a cat rather than index_select: no index tensor on any device."""
    fused: list[tuple[Node, int, int]] = []
    for x, a, b in pieces:
        if fused and fused[-1][0] is x and fused[-1][2] == a:
            fused[-1] = (x, fused[-1][1], b)
        else:
            fused.append((x, a, b))
    parts = [graph.call_function(aten.slice.Tensor, (x, 1, a, b)) for x, a, b in fused]
    return parts[0] if len(parts) == 1 else graph.call_function(aten.cat.default, (parts, 1))


def _write_and_attend(graph: Graph, site: AttentionSite, attend, q: Node, k: Node, v: Node, pos: Node,
                      cache: list[Node], extra: list[Node], want: bool, scales: list[Node] = ()) -> Node:
    """write_kv of the step's k, v [B, H, 1, D] and position ``pos`` [B, 1] into ``cache`` = (k_cache, v_cache,
    log_weight, slot, position), then the decode op over it; returns the op's (output, scores) node. With ``scales``
    (k_scale, v_scale of a quantized cache, kvpass/quantization) the entry is encoded as it is written
    (``write_kv_quantized``) and the dense op reads the codes (``decode_attention_quantized``); another op reads K, V
    decoded to the model's dtype for the step (``dequantize_kv``)."""
    options = {"scale": site.scale, "softcap": site.softcap, "want_scores": want}
    if not scales:
        graph.call_function(ops.write_kv.default, (*cache, pos, k, v))
        return graph.call_function(attend, (q, *cache[:3], *extra), options)
    k_cache, v_cache, log_weight, slot, position = cache
    graph.call_function(ops.write_kv_quantized.default, (k_cache, v_cache, *scales, log_weight, slot, position, pos, k, v))
    if attend == DECODE_ATTENTION_OPS[Attention.DENSE] and not extra:
        return graph.call_function(ops.decode_attention_quantized.default, (q, k_cache, v_cache, *scales, log_weight),
                                   options)
    k_plain, v_plain = (graph.call_function(ops.dequantize_kv.default, (x, s))
                        for x, s in zip((k_cache, v_cache), scales, strict=True))
    return graph.call_function(attend, (q, k_plain, v_plain, log_weight, *extra), options)


def _split_attend(graph: Graph, site: AttentionSite, attend, cache: list[Node], extra: list[Node], want: bool,
                  full: tuple[int, ...], full_cache: list[Node], q: Node, k: Node, v: Node, pos: Node,
                  scales: list[Node] = ()) -> tuple[Node, Node]:
    """The split-group decode attention of one layer (§0.6 b): the new K, V [B, Hkv, 1, D] go to
    their group's buffers, each group attends with its query heads (KV head g owns query heads
    g*G..g*G+G-1) and the outputs [B, G * heads of the group, 1, D] are put back into query-head order
    [B, Hq, 1, D]. The compressed group uses ``attend`` with the policy's ``extra`` inputs, the full one
    the dense op (the compressed group's ``scales`` where its cache is quantized; the full group stays in the
    model's dtype). Returns (output, the compressed group's op result)."""
    g_size = site.group
    groups = {"compressed": [h for h in range(site.n_kv_heads) if h not in full], "full": list(full)}
    results = {}
    for name, heads in groups.items():
        q_g = _take(graph, [(q, h * g_size, (h + 1) * g_size) for h in heads])
        k_g, v_g = (_take(graph, [(x, h, h + 1) for h in heads]) for x in (k, v))
        op, args = (attend, extra) if name == "compressed" else (DECODE_ATTENTION_OPS[Attention.DENSE], [])
        compressed = name == "compressed"
        results[name] = _write_and_attend(graph, site, op, q_g, k_g, v_g, pos, cache if compressed else full_cache,
                                          args, want and compressed, scales if compressed else ())
    outs = {name: graph.call_function(operator.getitem, (res, 0)) for name, res in results.items()}
    order = []
    for h in range(site.n_kv_heads):
        name = "full" if h in full else "compressed"
        i = groups[name].index(h)
        order.append((outs[name], i * g_size, (i + 1) * g_size))
    return _take(graph, order), results["compressed"]


def deferred_score_layers(sites: list[AttentionSite], policy: Policy, split: dict[int, tuple[int, ...]],
                          defer_scores: bool = True) -> frozenset[int]:
    """The layers whose decode step keeps its query instead of returning its scores: where ``defer_scores``,
    the policy defers them (``FusedDecodeStatistics.deferred_scores`` > 0), its only decode statistic is the
    accumulated ``col_sum`` (added, never replaced), the layer is compressed, full-attention, one dense group."""
    if not (defer_scores and policy.compresses and deferred_scores(policy) > 0 and policy.attention is Attention.DENSE
            and policy.stats & DECODE_STATS == {Stat.COLUMN_SUM}):
        return frozenset()
    return frozenset(s.layer for s in sites if s.window is None and s.layer not in split)


def nearest_search_layers(sites: list[AttentionSite], policy: Policy, split: dict[int, tuple[int, ...]],
                          deferred: frozenset[int], fuse_nearest: bool = True) -> frozenset[int]:
    """The layers whose decode attention also seeks the nearest keys of the policy's candidate slots: where
    ``fuse_nearest`` and the policy names them (``FusedDecodeStatistics.nearest_candidates`` > 0), the layer is
    compressed, full-attention, one dense group, its scores not deferred, and the policy has no decode inputs."""
    if not (fuse_nearest and policy.compresses and nearest_candidates(policy) > 0
            and policy.attention is Attention.DENSE and not policy.decode_inputs):
        return frozenset()
    return frozenset(s.layer for s in sites if s.window is None and s.layer not in split and s.layer not in deferred)


def decode_layout(sites: list[AttentionSite], policy: Policy, split: dict[int, tuple[int, ...]],
                  defer_scores: bool = True, fuse_nearest: bool = True) -> DecodeLayout:
    """Each site's decode inputs (``kvpass.rewrites.decode_layout``)."""
    deferred = deferred_score_layers(sites, policy, split, defer_scores)
    nearest = nearest_search_layers(sites, policy, split, deferred, fuse_nearest)
    quantized = kv_dtype_of(policy) is not None               # every layer's cache (the full-head group's excepted)
    return DecodeLayout(tuple(
        LayerInputs(s.layer, tuple(policy.decode_inputs) if s.window is None else (), s.layer in split,
                    s.layer in deferred, NEAREST_INPUTS if s.layer in nearest else (), quantized) for s in sites))


def build_decode(gm: GraphModule, sites: list[AttentionSite], policy: Policy,
                 full_heads: dict[int, tuple[int, ...]] | None = None, defer_scores: bool = True,
                 fuse_nearest: bool = True) -> tuple[GraphModule, tuple[int, ...], DecodeLayout]:
    """The decode-step graph; returns it, the layers whose scores it returns and its inputs' layout
    (``decode_layout``; ``defer_scores=False``: no layer defers its scores; ``fuse_nearest=False``: none seeks
    nearest keys)."""
    if policy.attention not in DECODE_ATTENTION_OPS:
        raise NotImplementedError(f"decode attention variant {policy.attention.value} has no op yet")
    split = split_heads(full_heads or {}, sites)
    if split and policy.attention is not Attention.DENSE:
        raise NotImplementedError(f"full-cache heads need the dense decode attention; {policy.name} uses "
                                  f"{policy.attention.value}")
    graph, env, out = copy_graph(gm)
    pos = [n for n in graph.nodes if n.op == "placeholder"][1]            # position_ids [B, 1]
    layout = decode_layout(sites, policy, split, defer_scores, fuse_nearest)
    inputs = iter(_add_inputs(graph, layout.placeholders()))
    scores, score_layers = [], []
    for site, lay in zip(sites, layout.layers, strict=True):
        cache = [next(inputs) for _ in CACHE_INPUTS]
        scales = [next(inputs) for _ in SCALE_INPUTS] if lay.quantized else []
        extra = [next(inputs) for _ in lay.policy]
        full_cache = [next(inputs) for _ in FULL_INPUTS] if lay.full else []
        recent = [next(inputs) for _ in RECENT_INPUTS] if lay.recent else []
        near = [next(inputs) for _ in lay.nearest]
        want = (bool(policy.stats & DECODE_STATS) and site.window is None and policy.compresses and not lay.recent)
        target = env[site.output]
        with graph.inserting_before(target):
            q, k, v = env[site.q], repeat_cached_kv(graph, site, env[site.k]), repeat_cached_kv(graph, site, env[site.v])
            attn, res = _attend_site(graph, site, policy, lay, cache, extra, full_cache, near, want, split, q, k, v, pos,
                                     scales)
            if recent:                 # after the write: rope_into_write_kv folds rope(q) only where every
                graph.call_function(ops.write_query.default, (*recent, pos, q))          # reader follows it
            if want:
                scores.append(graph.call_function(operator.getitem, (res, 1)))
                score_layers.append(site.layer)
        target.replace_all_uses_with(attn)
    return _finish(graph, gm, [_logits_node(out)] + scores, "KVPassDecode"), tuple(score_layers), layout


def _attend_site(graph: Graph, site: AttentionSite, policy: Policy, lay: LayerInputs, cache: list[Node],
                 extra: list[Node], full_cache: list[Node], near: list[Node], want: bool,
                 split: dict[int, tuple[int, ...]], q: Node, k: Node, v: Node, pos: Node,
                 scales: list[Node] = ()) -> tuple[Node, Node]:
    """One site's cache write and decode attention: (its output [B, Hq, 1, D], the op's result node); ``scales``:
    the site's k_scale, v_scale inputs where its cache is quantized."""
    attend = DECODE_ATTENTION_OPS[Attention.DENSE if site.window is not None else policy.attention]
    if policy.compresses and site.window is None:   # this layer's compression, forked at the step's start
        graph.call_function(torch.ops.kvpass.await_compression.default, (cache[3], cache[0]))
    if lay.full:
        return _split_attend(graph, site, attend, cache, extra, want, split[site.layer], full_cache, q, k, v, pos,
                             scales)
    if near:                           # next, from, inv_norm, cand, best, slot: the op's inputs after log_weight
        if scales:
            raise NotImplementedError("the fused nearest-key search reads model-dtype keys; a quantized cache's "
                                      "policy has it off (kvpass/quantization/policy.py)")
        res = _write_and_attend(graph, site, ops.decode_attention_nearest.default, q, k, v, pos, cache, near, want)
    else:
        res = _write_and_attend(graph, site, attend, q, k, v, pos, cache, extra, want, scales)
    return graph.call_function(operator.getitem, (res, 0)), res


def insert_compressed_cache(gm: GraphModule, sites: list[AttentionSite], policy: Policy,
                            defer_scores: bool = True, fuse_nearest: bool = True) -> RewrittenGraphs:
    """Build the prefill and decode graphs of ``policy`` over the captured graph ``gm``. With
    ``policy.expand_kv_heads`` the sites are expanded first (the returned ``sites`` say so); a policy's
    full-cache KV heads (named in the model's KV heads) then keep all their G copies. ``defer_scores=False``:
    every decode step returns its scores even where the policy defers them (the exporters' per-step graphs);
    ``fuse_nearest=False``: no layer seeks nearest keys in its attention (the exporters' graphs too)."""
    if policy.expand_kv_heads:
        sites = expand_kv_heads(sites)
    full_heads = {}
    if policy.compresses:
        full_heads = expanded_head_indices(policy.full_kv_heads(per_model_kv_head(sites)), sites)
    prefill, stat_keys = build_prefill(gm, sites, policy)
    decode, score_layers, layout = build_decode(gm, sites, policy, full_heads, defer_scores, fuse_nearest)
    log.info("insert_compressed_cache: rewrote %d attention sites (%s)%s%s", len(sites), policy.name,
             ", KV heads expanded per query head" if any(s.kv_repeat > 1 for s in sites) else "",
             f", full-cache KV heads {full_heads}" if full_heads else "")
    return RewrittenGraphs(prefill=prefill, decode=decode, sites=tuple(sites),
                           prefill_stats=stat_keys, decode_scores=score_layers, deferred_scores=layout.deferred,
                           nearest_layers=layout.nearest, full_heads=full_heads, decode_layout=layout)
