"""KVzip (Kim et al. 2025, "Query-Agnostic KV Cache Compression with Context Reconstruction"; docs/policies.md
§6.13)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from torch import Tensor

from kvpass.cache import LayerCache, keep_slots
from kvpass.policies.allocation import apportion
from kvpass.policies.base import Policy, Stat, require
from kvpass.policies.selection import (
    compress_into_top,
    compress_rows_into_top,
    keep_priority,
    kept_slots,
    rows_in_one_call_in_place,
    select_kept,
)


@dataclass(frozen=True)
class KVzip(Policy):
    """Keep the entries the model attends to most while it repeats the context (``Stat.RECONSTRUCTION``: after the
    prefill the model is asked to repeat the prompt, ``chunk`` tokens at a time, and each entry is scored by the
    largest attention any query of the repetition, of any query head of its group, gives it;
    kvpass/runtime/reconstruction.py). The score does not depend on a question: a cache compressed with it serves
    questions that come later (the query-agnostic case, ``KVPassModel.compress_context``).

    Every layer keeps its ``sinks`` first and ``recent`` newest entries and the top of the rest by score. With
    ``layers="global"`` (KVzip's default) the layers' budgets follow one threshold over every layer's scores: a layer
    keeps as many entries per KV head as it has (head, token) pairs above the threshold that keeps budget x layers
    entries per head in all (each at least its protected entries; the total is exact, ``apportion``), so memory
    follows where the model looks; ``"uniform"``: every layer the same budget. Within a layer every KV head keeps the
    same number (memory really freed: a layer's buffers are one size for its heads) [OURS: KVzip ranks heads of a
    layer jointly too]. Decode-time compressions (every ``interval`` steps) keep the newest ``recent`` entries and
    rank the rest by their reconstruction score; generated tokens score 0, so those older than the window leave
    first [OURS].

    Parameters
    ----------
    sinks: first entries always kept (KVzip: 4).
    recent: newest entries always kept (0 in KVzip, which compresses the context alone) [OURS: 32].
    chunk: tokens repeated per reconstruction step (KVzip: 2048).
    scope: what a chunk's repetition attends over besides itself: "span", the first ``sinks`` entries and the
        chunk's own span of the prompt (its previous ``tail`` tokens included), the entries KVzip scores a chunk
        against [OURS: KVzip's repetition attends over the whole prompt, and only its scoring is cut to the span],
        so the reconstruction costs about one prefill at any length; "full", the whole prompt (the prefill's
        cost again plus a prompt x prompt attention).
    layers: "global" or "uniform" layer budgets ("global_mean": a layer's share by its heads' mean, for comparison).
    scores: "reconstruct" (the reconstruction pass) or "predicted": each entry's score predicted from its own key
        and value by a per-(layer, head) linear model fitted on calibration text (``kvpass calibrate kvzip``;
        kvpass/policies/kvzip_surrogate.py), no pass beyond the prefill [OURS, in the spirit of KVzap].
    surrogate: with scores="predicted", the surrogate file or the name of one shipped in kvpass/calibrations;
        None: the shipped one fitted on a model of this model's shape.
    interval: decode steps between compressions.
    """

    name: ClassVar[str] = "kvzip"
    section: ClassVar[str] = "§6.13"
    summary: ClassVar[str] = "query-agnostic: the entries the model attends to while repeating the context"
    stats: ClassVar[frozenset[Stat]] = frozenset({Stat.RECONSTRUCTION})
    prefill_chunks: ClassVar[bool] = False     # the reconstruction attends over the whole prompt's cache
    sinks: int = 4
    recent: int = 32
    chunk: int = 2048
    scope: str = "span"
    layers: str = "global"
    scores: str = "reconstruct"
    surrogate: str | None = None
    interval: int = 16

    def __post_init__(self) -> None:
        super().__post_init__()
        for field_name in ("sinks", "recent"):
            value = getattr(self, field_name)
            require(isinstance(value, int) and value >= 0, f"kvzip: {field_name} must be an int >= 0, got {value!r}")
        require(isinstance(self.chunk, int) and self.chunk >= 1, f"kvzip: chunk must be an int >= 1, got {self.chunk!r}")
        require(self.scope in ("span", "full"), f"kvzip: scope must be 'span' or 'full', got {self.scope!r}")
        require(self.scores in ("reconstruct", "predicted"),
                f"kvzip: scores must be 'reconstruct' or 'predicted', got {self.scores!r}")
        require(self.surrogate is None or isinstance(self.surrogate, str),
                f"kvzip: surrogate must be a file or a shipped name, got {self.surrogate!r}")
        require(self.layers in ("global", "global_mean", "uniform"),
                f"kvzip: layers must be 'global', 'global_mean' or 'uniform', got {self.layers!r}")

    def stat_options(self, stat: Stat) -> dict[str, object]:
        if self.scores == "predicted":
            return {"method": "predicted", "surrogate": self.surrogate}
        return {"method": "reconstruct", "chunk": self.chunk, "scope": self.scope, "sinks": self.sinks}

    def bind_model(self, model) -> KVzip:
        """With scores="predicted": the surrogate resolved (``surrogate`` None: the shipped one of the model's
        shape) and checked against the model."""
        if self.scores != "predicted":
            return self
        from kvpass.policies.kvzip_surrogate import KVzipSurrogate, model_shape, shipped_for
        from kvpass.validation import refuse

        if self.surrogate is None:
            name = shipped_for(model)
            if name is None:
                raise refuse("kvzip.surrogate_model", got="no shipped surrogate", model=str(model_shape(model)))
            return replace(self, surrogate=name)
        KVzipSurrogate.load(self.surrogate).check(model)
        return self

    def protected(self, keep: int | Tensor) -> tuple[int | Tensor, int | Tensor]:
        """(sinks, recent) within ``keep`` (an int, or [B] int64 per row): the sinks first, then the window."""
        if isinstance(keep, Tensor):
            sinks = keep.clamp(max=self.sinks)
            return sinks.view(-1, 1, 1), (keep - sinks).clamp(max=self.recent).view(-1, 1, 1)
        sinks = min(self.sinks, keep)
        return sinks, min(self.recent, keep - sinks)

    def priority(self, cache: LayerCache, keep: int | Tensor) -> Tensor:
        """[B, Hkv, C] fp64: +inf for the protected entries, the reconstruction score, -inf empty."""
        return keep_priority(cache.slot_meta[Stat.RECONSTRUCTION.value], cache.length, *self.protected(keep),
                             cache.position)

    def compress(self, cache: LayerCache, keep: int) -> LayerCache:
        """cache: k, v [B, Hkv, C, D]; slot_meta['reconstruct'] [B, Hkv, C] fp32 -> capacity min(keep, C)."""
        sinks, recent = self.protected(keep)
        kept = select_kept(cache.slot_meta[Stat.RECONSTRUCTION.value], cache.length, keep, sinks, recent,
                           cache.position)
        return keep_slots(cache, kept_slots(kept, keep))

    def compress_into(self, cache: LayerCache, keep: int) -> None:
        compress_into_top(self, KVzip, cache, keep)

    def rows_in_one_call(self, budgets: Sequence[int], capacities: Sequence[int]) -> bool:
        return rows_in_one_call_in_place(self, KVzip, budgets, capacities)

    def compress_rows_into(self, cache: LayerCache, keep: Tensor) -> None:
        compress_rows_into_top(self, cache, keep)

    def layer_budgets(self, budget: int, caches: list[LayerCache]) -> list[int]:
        """One row's budgets per compressed layer (the runtime calls this per row): ``layers="global"`` splits
        ``len(caches) * budget`` over the layers by one threshold over all of them (class docstring)."""
        n_layers = len(caches)
        longest = max(int(c.length.max()) for c in caches)
        if self.layers == "uniform" or n_layers < 2 or longest <= budget:
            return [budget] * n_layers
        floor = min(self.sinks + self.recent + 1, budget)
        # per layer [Hkv, n] live scores, each head's sorted descending
        heads = [torch.where(c.live, c.slot_meta[Stat.RECONSTRUCTION.value].float(), float("-inf"))[0]
                 .sort(dim=-1, descending=True).values for c in caches]
        if self.layers == "global_mean":
            every = torch.cat([h.flatten() for h in heads])
            total = min(n_layers * budget * heads[0].shape[0], int(torch.isfinite(every).sum()))
            threshold = every.topk(total).values[-1]
            shares = [float((h >= threshold).sum()) / h.shape[0] for h in heads]
            return apportion(shares, n_layers * budget, floor, longest)
        # "global": the largest threshold at which the layers' most-needing heads fit the total, found by bisection
        # over the candidate thresholds (every score); a layer's share is its head of most entries above it
        candidates = torch.cat([h.flatten() for h in heads])
        candidates = candidates[torch.isfinite(candidates)].unique().sort(descending=True).values

        def need(tau: Tensor) -> list[int]:
            return [int((h >= tau).sum(-1).max()) for h in heads]

        lo, hi = 0, len(candidates) - 1                     # need() grows with the index (smaller thresholds)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if sum(need(candidates[mid])) <= n_layers * budget:
                lo = mid
            else:
                hi = mid - 1
        shares = [float(n) for n in need(candidates[lo])]
        return apportion(shares, n_layers * budget, floor, longest)

