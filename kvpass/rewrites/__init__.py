"""kvpass.rewrites: the graph passes, in the order they run, and the pipeline that runs them
(``pipeline.py``: ``capture_model`` then ``compile_model``, the one place graphs are built).

    capture_causal_lm        HF model -> aten graph of the no-cache forward (dynamic B, T)
    find_attention_sites     one AttentionSite per layer (SDPA forms or the eager pattern)
    resolve_windows          prove each site's mask causal or sliding-window, on a probe
    shard_tensor_parallel    (tp > 1 only) this rank's heads and MLP rows, all-reduces, the logits' gather
    insert_compressed_cache  -> prefill and decode graphs over explicit cache tensors
                                (first expand_kv_heads when the policy asks for a per-query-head cache)
    fuse_sibling_linears     q/k/v and gate/up -> one linear each (on CUDA by default)
    linears_to_gemv          the decode graph's linears -> the one-row GEMV op (on CUDA)
    rope_into_write_kv       the decode graph's q/k rotations -> the cache write's launch (on CUDA)
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
from kvpass.rewrites.pipeline import capture_model, compile_model, match_attention
from kvpass.rewrites.shard_tensor_parallel import Shard, shard_tensor_parallel, sharded_for

__all__ = ["AttentionSite", "CapturedModel", "RewrittenGraphs", "Shard", "capture_causal_lm", "capture_model",
           "compile_model", "expand_kv_heads", "find_attention_sites", "insert_compressed_cache",
           "match_attention", "resolve_windows", "shard_tensor_parallel", "sharded_for"]
