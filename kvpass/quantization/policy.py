"""Any policy over a quantized cache: ``QuantizedEntries(inner, kv_dtype)``, what ``kvpass.apply(..., kv_dtype=...)``
runs (kvpass/runtime/model.py wraps the policy; the graphs are built for the wrapper).

The wrapper is the inner policy to the rewrite and the runtime (its statistics, attention, budgets and facts about the
cache, forwarded), and the generic slow path of every compression over 8-bit entries: the layer decoded to the model's
dtype (``dequantize_cache``), the inner policy's own ``compress`` (its scores, merges and cosine similarities in the
precision it always computes them in), the result encoded again (``requantize_like``: kept entries keep their codes,
merged ones are encoded afresh). ``prepare`` and ``maintain`` take the same round trip. A cache not yet quantized (the
prompt's compression, a chunked prefill's compressions between chunks) goes to the inner policy as it is, in place
where the inner policy compresses in place; the runtime quantizes every layer once its prompt cache is built
(``kvpass.runtime.layers.build_layers``).

What the wrapper does not forward: the capabilities of ``kvpass.policies.capabilities`` other than ``InPlace`` (rows of
their own budgets are compressed one budget at a time, decode statistics are one attention row a step: D2O's fused
nearest-key search and deferred scores are off) and ``host_resident`` (a recall policy's codes stay on the device).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvpass.cache import LayerCache, load_into
from kvpass.policies.base import Policy, Stat
from kvpass.policies.capabilities import InPlace
from kvpass.quantization.cache import dequantize_cache, is_quantized, requantize_like

# What the wrapper reads from its inner policy for the rewrite and the runtime (class attributes there).
FORWARDED = ("name", "section", "summary", "stats", "attention", "compresses", "decode_inputs", "rows_independent",
             "ragged_rows", "prefill_chunks")


@dataclass(frozen=True)
class QuantizedEntries(InPlace, Policy):
    """``inner`` over a cache of ``kv_dtype`` entries ("int8" or "fp8_e4m3", kvpass/quantization/formats.py). The
    inner policy's hyperparameters read through (``wrapper.interval`` is the inner's)."""

    name: ClassVar[str] = "quantized"
    section: ClassVar[str] = "docs/quantization.md"
    summary: ClassVar[str] = "any policy over 8-bit cache entries"
    inner: Policy
    kv_dtype: str

    def __post_init__(self) -> None:
        for attr in FORWARDED:
            object.__setattr__(self, attr, getattr(self.inner, attr))
        object.__setattr__(self, "host_resident", ())
        object.__setattr__(self, "expand_kv_heads", self.inner.expand_kv_heads)
        super().__post_init__()

    def __getattr__(self, attr: str):
        inner = self.__dict__.get("inner")
        if inner is None or attr.startswith("__"):
            raise AttributeError(attr)
        return getattr(inner, attr)

    # ------------------------------------------------------------------ forwarded as they are
    def stat_options(self, stat: Stat) -> dict[str, object]:
        return self.inner.stat_options(stat)

    def with_heads(self, heads) -> Policy:
        return self if heads.world == 1 else QuantizedEntries(self.inner.with_heads(heads), self.kv_dtype)

    def bind_model(self, model) -> Policy:
        bound = self.inner.bind_model(model)
        return self if bound is self.inner else QuantizedEntries(bound, self.kv_dtype)

    def prompt_compression_deferred(self) -> bool:
        return self.inner.prompt_compression_deferred()

    def uncompressed_layers(self, n_layers: int) -> frozenset[int]:
        return self.inner.uncompressed_layers(n_layers)

    def min_budget(self) -> int:
        return self.inner.min_budget()

    def full_kv_heads(self, sites):
        return self.inner.full_kv_heads(sites)

    def head_capacity(self, keep: int, heads: int) -> int:
        return self.inner.head_capacity(keep, heads)

    def maintenance_due(self, new_tokens: int) -> bool:
        return self.inner.maintenance_due(new_tokens)

    # ------------------------------------------------------------------ through the model's dtype
    def layer_budgets(self, budget: int, caches: list[LayerCache]) -> list[int]:
        return self.inner.layer_budgets(budget, [_plain(c) for c in caches])

    def report(self, caches: list[LayerCache]) -> dict[str, float]:
        return self.inner.report([_plain(c) for c in caches])

    def compress(self, cache: LayerCache, keep: int) -> LayerCache:
        """The inner policy's ``compress`` of the decoded layer, encoded again (kept entries keep their codes)."""
        if not is_quantized(cache):
            return self.inner.compress(cache, keep)
        return requantize_like(self.inner.compress(dequantize_cache(cache), keep), cache)

    def compress_into(self, cache: LayerCache, keep: int) -> None:
        if not is_quantized(cache) and isinstance(self.inner, InPlace):
            self.inner.compress_into(cache, keep)
        else:
            load_into(cache, self.compress(cache, keep))

    def prepare(self, cache: LayerCache, layer: int, budget) -> LayerCache:
        if not is_quantized(cache) or type(self.inner).prepare is Policy.prepare:
            return self.inner.prepare(cache, layer, budget)
        return requantize_like(self.inner.prepare(dequantize_cache(cache), layer, budget), cache)

    def maintain(self, cache: LayerCache, layer: int) -> LayerCache:
        if not is_quantized(cache) or type(self.inner).maintain is Policy.maintain:
            return self.inner.maintain(cache, layer)
        return requantize_like(self.inner.maintain(dequantize_cache(cache), layer), cache)


def _plain(cache: LayerCache) -> LayerCache:
    return dequantize_cache(cache) if is_quantized(cache) else cache


def with_kv_dtype(policy: Policy, kv_dtype: str | None) -> Policy:
    """``policy`` over ``kv_dtype`` entries (None: the policy itself, the model's dtype)."""
    if kv_dtype is None:
        return policy
    if isinstance(policy, QuantizedEntries):
        policy = policy.inner
    return QuantizedEntries(policy, kv_dtype)


def kv_dtype_of(policy: Policy) -> str | None:
    """The format a policy's cache entries are stored in: its ``kv_dtype`` if wrapped, else None (the model's)."""
    return policy.kv_dtype if isinstance(policy, QuantizedEntries) else None
