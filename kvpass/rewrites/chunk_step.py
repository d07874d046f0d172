"""Rewrite: the captured no-cache forward -> the chunk-step graph of chunked prefill (kvpass/runtime/chunked_prefill.py).

A copy of the captured graph sharing its weights, like the prefill graph (``build_prefill``), whose every
attention site attends over the layer's cache as well as over the chunk (``kvpass::chunk_attention``):

chunk(input_ids [B, T], position_ids [B, T], pad [B], then per layer l: k_cache_l, v_cache_l [B, Hkv, C_l, D],
      log_weight_l [B, Hkv, C_l] fp32, position_l [B, Hkv, C_l] int64)
    -> (logits [B, 1, V], k_0, v_0, ..., k_{L-1}, v_{L-1}, *stats)
    T: the chunk's tokens, left-padded by ``pad`` (the row's padding inside this chunk); positions are
    absolute (tokens seen). k_l, v_l: the chunk's own post-RoPE K, V [B, Hkv, T, D], which the runtime
    appends to the cache; nothing is written in place. stats: for each compressible layer (no sliding
    window, a compressing policy), each per-slot statistic the policy asks for except the head variance
    (decided once, from the first chunk), [B, Hkv, C_l + T] fp32: the cache's slots, then the chunk's keys.

The statistic ops take the policy's ``stat_options`` as the prefill's do; column sums reuse the attention's
row log-sum-exps where they use the attention's own options. With ``policy.expand_kv_heads`` the sites are
the expanded ones (``RewrittenGraphs.sites``): the cache and statistics are per query head, as in prefill.
"""

from __future__ import annotations

import logging
import operator

import torch
from torch.fx import GraphModule

import kvpass.kernels  # noqa: F401  (registers torch.ops.kvpass)
from kvpass.policies.base import Policy, Stat
from kvpass.rewrites.attention_sites import AttentionSite, repeat_cached_kv
from kvpass.rewrites.insert_compressed_cache import (
    _add_inputs,
    _final_logits,
    _finish,
    _keep_last_position,
    _logits_node,
    copy_graph,
)

log = logging.getLogger(__name__)
ops = torch.ops.kvpass

# Statistic -> the chunk op computing it (q, k, pad, k_cache, log_weight, position, pos, scale, window, softcap,
# **policy.stat_options). The head variance has none: chunked prefill takes it from the first chunk.
CHUNK_STAT_OPS = {Stat.COLUMN_SUM: ops.chunk_column_sums.default,
                  Stat.WINDOW_SCORES: ops.chunk_window_scores.default,
                  Stat.LAST_ATTENTION: ops.chunk_window_scores.default}   # obs_window 1: the policy's options
# The reconstruction pass (kvpass/runtime/reconstruction.py): the chunk is the model repeating the context, and its
# one statistic, [B, Hkv, C_l] fp32 (the cache's slots only), the most attention each entry receives from it.
RECONSTRUCTION_STAT_OPS = {Stat.RECONSTRUCTION: ops.chunk_attention_max.default}
CACHE_INPUTS = ("k_cache", "v_cache", "log_weight", "position")
# statistics normalised as the attention itself: they take its rows' log-sum-exps when they have no options
_LSE_CHUNK_STATS = frozenset({Stat.COLUMN_SUM, Stat.RECONSTRUCTION})


def chunk_stats(policy: Policy, stat_ops: dict = CHUNK_STAT_OPS) -> list[Stat]:
    """The statistics a chunk step emits for ``policy``, in ``Stat`` value order."""
    return sorted((s for s in policy.stats if s in stat_ops), key=lambda s: s.value) if policy.compresses else []


def build_chunk_step(gm: GraphModule, sites: list[AttentionSite], policy: Policy,
                     stat_ops: dict = CHUNK_STAT_OPS) -> tuple[GraphModule, tuple[tuple[int, Stat], ...]]:
    """The chunk-step graph of ``policy`` over the captured graph ``gm`` (module docstring) and the (layer,
    statistic) of each statistics output, in order. ``stat_ops``: statistic -> its op (``RECONSTRUCTION_STAT_OPS``
    for the reconstruction pass)."""
    graph, env, out = copy_graph(gm)
    (pad,) = _add_inputs(graph, ["pad"])
    pos = [n for n in graph.nodes if n.op == "placeholder"][1]               # position_ids [B, T]
    inputs = iter(_add_inputs(graph, [f"{name}_{s.layer}" for s in sites for name in CACHE_INPUTS]))
    stats = chunk_stats(policy, stat_ops)
    kv_outputs, stat_outputs, stat_keys = [], [], []
    for site in sites:
        k_cache, v_cache, log_weight, position = (next(inputs) for _ in CACHE_INPUTS)
        target = env[site.output]
        opts = {"scale": site.scale, "window": site.window, "softcap": site.softcap}
        with graph.inserting_before(target):
            q, k, v = env[site.q], repeat_cached_kv(graph, site, env[site.k]), repeat_cached_kv(graph, site, env[site.v])
            both = graph.call_function(ops.chunk_attention.default,
                                       (q, k, v, pad, k_cache, v_cache, log_weight, position, pos), dict(opts))
            attn, lse = (graph.call_function(operator.getitem, (both, i)) for i in range(2))
            for stat in stats if site.window is None else ():
                extra = policy.stat_options(stat)
                kwargs = {**opts, **extra}
                if stat in _LSE_CHUNK_STATS and not extra:        # normalised as the attention: its log-sum-exps
                    kwargs["lse"] = lse
                stat_outputs.append(graph.call_function(stat_ops[stat],
                                                        (q, k, pad, k_cache, log_weight, position, pos), kwargs))
                stat_keys.append((site.layer, stat))
        target.replace_all_uses_with(attn)
        kv_outputs += [k, v]
    _keep_last_position(graph, _logits_node(out))
    step = _finish(graph, gm, [_final_logits(graph, out)] + kv_outputs + stat_outputs, "KVPassChunkStep")
    log.info("build_chunk_step: %d attention sites over the cache (%s), statistics %s", len(sites), policy.name,
             [s.value for s in stats])
    return step, tuple(stat_keys)
