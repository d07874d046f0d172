"""The pipeline: a causal LM -> its rewritten graphs, every pass in order. The one place graphs are built.

    captured = capture_model(model)          # capture -> match (-> shard_captured, tensor parallel)
    graphs = compile_model(captured, policy) # insert_compressed_cache -> fuse_sibling_linears -> linears_to_gemv
                                             #   -> rope_into_write_kv
    compile_chunk_step(captured, policy, graphs.sites, graphs.fused_linears)   # chunked prefill's chunk graph

``kvpass.apply`` calls both (or reuses a ``captured`` it is given) and wraps the graphs in a KVPassModel;
evaluation, benchmarks and tests reach the graphs through ``kvpass.apply`` too, or, for a prefill graph of
their own (a shared prefill emitting several policies' statistics, the all-logits forward), through
``compile_model(..., prefill_only=True)``, so every graph that runs went through the same passes.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import nn
from torch.fx import GraphModule

from kvpass.errors import UnsupportedModel
from kvpass.policies.base import Policy
from kvpass.rewrites.attention_sites import (
    AttentionSite,
    find_attention_sites,
    per_model_kv_head,
    resolve_windows,
)
from kvpass.rewrites.capture import CapturedModel, capture_causal_lm
from kvpass.rewrites.chunk_step import build_chunk_step
from kvpass.rewrites.fuse_sibling_linears import fuse_sibling_linears
from kvpass.rewrites.insert_compressed_cache import RewrittenGraphs, build_prefill, insert_compressed_cache
from kvpass.rewrites.linears_to_gemv import linears_to_gemv
from kvpass.rewrites.rope_into_write_kv import rope_into_write_kv
from kvpass.rewrites.shard_tensor_parallel import (
    Shard,
    check_sharded_prefill,
    logits_width,
    shard_tensor_parallel,
)

log = logging.getLogger(__name__)


def match_attention(captured: CapturedModel, config) -> list[AttentionSite]:
    """find_attention_sites + resolve_windows on a captured model."""
    sites = find_attention_sites(captured.gm, captured.model_type, getattr(config, "num_hidden_layers", None))
    return resolve_windows(captured.gm, sites, config, captured.context_length)


def capture_model(model: nn.Module, shard: Shard | None = None) -> CapturedModel:
    """Capture ``model`` (``capture_causal_lm``) and match its attention sites (``match_attention``): what
    ``compile_model`` starts from. One capture serves any number of policies (``kvpass.apply(...,
    captured=...)``); tracing is most of a rewrite's time. With ``shard`` (tensor parallel, world > 1) the
    capture is then sharded for that rank (``shard_captured``)."""
    captured = capture_causal_lm(model)
    captured = replace(captured, sites=tuple(match_attention(captured, model.config)))
    return captured if shard is None or shard.world == 1 else shard_captured(captured, shard)


def shard_captured(captured: CapturedModel, shard: Shard) -> CapturedModel:
    """``shard_tensor_parallel`` of a matched capture for this rank, in place (the model's parameters become
    the rank's shards: the unsharded capture is spent). Returns the sharded capture, whose ``sites`` are the
    rank's; every ``compile_model`` of it checks its prefill's sharding."""
    if captured.shard is not None:
        raise ValueError("this capture is already sharded")
    vocab = logits_width(captured.gm)
    sites = shard_tensor_parallel(captured.gm, list(captured.sites), shard)
    return replace(captured, sites=tuple(sites), shard=shard, model_sites=captured.sites, vocab=vocab)


def _device(gm: GraphModule) -> torch.device:
    for t in (*gm.parameters(), *gm.buffers()):
        return t.device
    return torch.device("cpu")


def _fuse(graphs: list[GraphModule], decode: GraphModule | None, fuse_linears: bool | None,
          on_cuda: bool) -> bool:
    """The CUDA fusion passes, in place: sibling linears of every graph as one linear (``fuse_linears``;
    None: on CUDA only, so the CPU keeps transformers' exact GEMMs), then (on CUDA) the decode graph's
    linears as the one-row GEMV op and its rotations of q and k into the cache write (``rope_into_write_kv``).
    Returns whether the linears were fused."""
    fuse = on_cuda if fuse_linears is None else fuse_linears
    if fuse:
        for gm in graphs:
            fuse_sibling_linears(gm)
    if on_cuda and decode is not None:
        linears_to_gemv(decode)
        rope_into_write_kv(decode)
    return bool(fuse)


def compile_model(captured: CapturedModel, policy: Policy, *, fuse_linears: bool | None = None,
                  prefill_only: bool = False, last_logits_only: bool = True,
                  sites: Sequence[AttentionSite] | None = None, defer_scores: bool = True,
                  fuse_nearest: bool = True) -> RewrittenGraphs:
    """Every pass after capture, in order: ``insert_compressed_cache`` for ``policy`` (on a sharded capture,
    then ``check_sharded_prefill``), then the fusion passes (``fuse_sibling_linears`` on both graphs where
    ``fuse_linears``, default on CUDA only; on CUDA ``linears_to_gemv`` on the decode graph).

    captured: from ``capture_model`` (its ``sites`` matched). sites: the sites to rewrite instead of
    ``captured.sites`` (those of graphs already built from it, e.g. expanded ones).
    prefill_only: build the prefill graph alone (``decode`` is None): ``policy`` may then be anything with
    ``stats``, ``stat_options`` and ``compresses`` (``kvpass.eval.shared.StatUnion``); last_logits_only:
    whether the prefill's LM head runs on the last position only (False: logits [B, T, V]); defer_scores: False
    builds a decode graph that returns every step's scores even where the policy defers them (the exporters');
    fuse_nearest: False builds one whose attention never seeks the policy's nearest keys (the exporters' too)."""
    if sites is None:
        if not captured.sites:
            raise ValueError("compile_model needs a capture with its attention sites: capture_model(model), "
                             "not capture_causal_lm alone")
        sites = captured.sites
    sites = list(sites)
    on_cuda = _device(captured.gm).type == "cuda"
    if prefill_only:
        prefill, stat_keys = build_prefill(captured.gm, sites, policy, last_logits_only=last_logits_only)
        fused = _fuse([prefill], None, fuse_linears, on_cuda)
        return RewrittenGraphs(prefill=prefill, decode=None, sites=tuple(sites), prefill_stats=stat_keys,
                               decode_scores=(), fused_linears=fused)
    if not last_logits_only:
        raise ValueError("last_logits_only=False builds a prefill graph alone: pass prefill_only=True")
    sharded = captured.shard is not None
    if sharded and policy.compresses and policy.full_kv_heads(per_model_kv_head(list(captured.model_sites))):
        raise UnsupportedModel(f"tensor parallel: {policy.name}'s full-cache KV heads (a calibration's outlier "
                               "heads) are not supported yet; run it in one process or without the calibration")
    graphs = insert_compressed_cache(captured.gm, sites, policy, defer_scores, fuse_nearest)
    if sharded:
        check_sharded_prefill(graphs.prefill, list(graphs.sites), captured.vocab)
    fused = _fuse([graphs.prefill, graphs.decode], graphs.decode, fuse_linears, on_cuda)
    return replace(graphs, fused_linears=fused)


def compile_chunk_step(captured: CapturedModel, policy: Policy, sites: Sequence[AttentionSite],
                       fuse_linears: bool, stat_ops: dict | None = None) -> tuple[GraphModule, tuple]:
    """The chunk-step graph of chunked prefill (``build_chunk_step``: a prefill chunk attending over the layers'
    caches, kvpass/runtime/chunked_prefill.py) over the sites of the model's graphs, with the fusion pass its prefill
    graph had (``fuse_linears``: ``RewrittenGraphs.fused_linears``). Returns (graph, its statistics' keys).
    ``stat_ops``: the statistics' ops (default the chunked prefill's; ``RECONSTRUCTION_STAT_OPS`` for the
    reconstruction pass, kvpass/runtime/reconstruction.py)."""
    gm, keys = (build_chunk_step(captured.gm, list(sites), policy) if stat_ops is None
                else build_chunk_step(captured.gm, list(sites), policy, stat_ops))
    _fuse([gm], None, fuse_linears, _device(captured.gm).type == "cuda")
    return gm, keys
