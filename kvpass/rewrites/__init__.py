"""kvpass.rewrites: the graph passes, in the order they run.

    capture_causal_lm        HF model -> aten graph of the no-cache forward (dynamic B, T)
    find_attention_sites     one AttentionSite per layer (SDPA forms or the eager pattern)
    resolve_windows          prove each site's mask causal or sliding-window, on a probe
    shard_tensor_parallel    (tp > 1 only) this rank's heads and MLP rows, all-reduces, the logits' gather
    insert_compressed_cache  -> prefill and decode graphs over explicit cache tensors
                                (first expand_kv_heads when the policy asks for a per-query-head cache)
    fuse_sibling_linears     q/k/v and gate/up -> one linear each (run by KVPassModel, on CUDA by default)
    linears_to_gemv          the decode graph's linears -> the one-row GEMV op (run by KVPassModel on CUDA)
"""

from __future__ import annotations

from torch import nn

from kvpass.errors import UnsupportedModel
from kvpass.policies.base import Policy
from kvpass.rewrites.attention_sites import (
    AttentionSite,
    expand_kv_heads,
    find_attention_sites,
    per_model_kv_head,
    resolve_windows,
)
from kvpass.rewrites.capture import CapturedModel, capture_causal_lm
from kvpass.rewrites.insert_compressed_cache import RewrittenGraphs, insert_compressed_cache
from kvpass.rewrites.shard_tensor_parallel import (
    Shard,
    check_sharded_prefill,
    logits_width,
    shard_tensor_parallel,
)


def match_attention(captured: CapturedModel, config) -> list[AttentionSite]:
    """find_attention_sites + resolve_windows on a captured model."""
    sites = find_attention_sites(captured.gm, captured.model_type, getattr(config, "num_hidden_layers", None))
    return resolve_windows(captured.gm, sites, config, captured.context_length)


def rewrite_model(model: nn.Module, policy: Policy, shard: Shard | None = None) -> tuple[CapturedModel, RewrittenGraphs]:
    """All passes, in order, on a transformers causal LM; with ``shard`` (tensor parallel, world > 1) the
    captured graph is first sharded for that rank (``shard_tensor_parallel``; the model's parameters become
    the rank's shards)."""
    captured = capture_causal_lm(model)
    sites = match_attention(captured, model.config)
    if shard is None or shard.world == 1:
        return captured, insert_compressed_cache(captured.gm, sites, policy)
    vocab = logits_width(captured.gm)
    if policy.compresses and policy.full_kv_heads(per_model_kv_head(sites)):
        raise UnsupportedModel(f"tensor parallel: {policy.name}'s full-cache KV heads (a calibration's outlier "
                               "heads) are not supported yet; run it in one process or without the calibration")
    sites = shard_tensor_parallel(captured.gm, sites, shard)
    graphs = insert_compressed_cache(captured.gm, sites, policy)
    check_sharded_prefill(graphs.prefill, list(graphs.sites), vocab)
    return captured, graphs


__all__ = ["AttentionSite", "CapturedModel", "RewrittenGraphs", "Shard", "shard_tensor_parallel", "capture_causal_lm", "expand_kv_heads",
           "find_attention_sites", "insert_compressed_cache", "match_attention", "resolve_windows", "rewrite_model"]
