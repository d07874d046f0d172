"""kvpass.rewrites: the graph passes, in the order they run.

    capture_causal_lm        HF model -> aten graph of the no-cache forward (dynamic B, T)
    find_attention_sites     one AttentionSite per layer (SDPA forms or the eager pattern)
    resolve_windows          prove each site's mask causal or sliding-window, on a probe
    insert_compressed_cache  -> prefill and decode graphs over explicit cache tensors
                                (first expand_kv_heads when the policy asks for a per-query-head cache)
    fuse_sibling_linears     q/k/v and gate/up -> one linear each (run by KVPassModel, on CUDA by default)
    linears_to_gemv          the decode graph's linears -> the one-row GEMV op (run by KVPassModel on CUDA)
"""

from __future__ import annotations

from kvpass.rewrites.attention_sites import (
    AttentionSite,
    expand_kv_heads,
    find_attention_sites,
    resolve_windows,
)
from kvpass.rewrites.capture import CapturedModel, capture_causal_lm
from kvpass.rewrites.insert_compressed_cache import RewrittenGraphs, insert_compressed_cache
from torch import nn

from kvpass.policies.base import Policy


def match_attention(captured: CapturedModel, config) -> list[AttentionSite]:
    """find_attention_sites + resolve_windows on a captured model."""
    sites = find_attention_sites(captured.gm, captured.model_type, getattr(config, "num_hidden_layers", None))
    return resolve_windows(captured.gm, sites, config, captured.context_length)


def rewrite_model(model: nn.Module, policy: Policy) -> tuple[CapturedModel, RewrittenGraphs]:
    """All passes, in order, on a transformers causal LM."""
    captured = capture_causal_lm(model)
    sites = match_attention(captured, model.config)
    return captured, insert_compressed_cache(captured.gm, sites, policy)


__all__ = ["AttentionSite", "CapturedModel", "RewrittenGraphs", "capture_causal_lm", "expand_kv_heads",
           "find_attention_sites", "insert_compressed_cache", "match_attention", "resolve_windows", "rewrite_model"]
