"""The runtime: holds the cache tensors, runs prefill, decides in Python (from lengths it tracks on
the host, so a steady decode step never synchronises) when a layer must be compressed, runs the
decode steps and samples tokens.

Data flow of ``generate``:

    prefill graph ─▶ logits, per-layer K, V [B, Hkv, T, D] (+ statistics); Hkv = Hq when the
                     policy's ``expand_kv_heads`` caches every KV head G times (the sites say so)
    per layer:  sliding window  ─▶ ring of W slots (slot = position % W), never compressed
                otherwise       ─▶ compacted prompt entries ─▶ policy.compress to its budget
                                   ─▶ static buffers of C = budget + interval slots
    each step:  compress layers whose buffers are full ─▶ decode graph (writes K, V at slot,
                attends) ─▶ logits ─▶ next token; positions are absolute (tokens seen)

By job: ``model.py`` (``KVPassModel``, the adapter to transformers' ``generate``: inputs, prefill, the
session's start), ``session.py`` (``DecodeSession``: the decode steps, sampling, the report) and
``layers.py`` (the cache bookkeeping: each layer's caches and budgets from a prefill, prompt compression,
the policy's contract).
"""

from kvpass.runtime.layers import Layer, stacked_groups
from kvpass.runtime.model import GenerateOutput, KVPassModel, Prefill
from kvpass.runtime.session import DecodeSession, GenerationReport, stack_sessions

__all__ = ["DecodeSession", "GenerateOutput", "GenerationReport", "KVPassModel", "Layer", "Prefill",
           "stack_sessions", "stacked_groups"]
