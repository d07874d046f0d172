"""The cache bookkeeping of a KVPassModel: each layer's caches built from a prefill (every batch row budgeted
as if alone: its budget, its per-layer budgets, its capacity), the prompt's compression (whole layers, stacked
layers of one budget, or rows of their own budgets), the decode-time compression of rows due on their own,
and the policy's contract checked after each (no row above its budget).

The functions take the model whose policy, budget, graphs, head group and device they use: a ``KVPassModel``,
seen here through ``RuntimeModel`` (what they read of it), so this module does not import the model's."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from kvpass.budget import budget_tokens, budget_with_full_heads
from kvpass.cache import (
    LayerCache,
    concat_rows,
    put_rows_at,
    ring_from_prompt,
    select_heads,
    split_rows,
    take_rows,
    with_capacity,
)
from kvpass.decode_step import StaticDecodeStep
from kvpass.head_group import HeadGroup
from kvpass.policies.base import Policy
from kvpass.policies.capabilities import compress_in_place, deferred_scores
from kvpass.quantization.cache import is_quantized, quantize_cache
from kvpass.quantization.policy import kv_dtype_of
from kvpass.rewrites import RewrittenGraphs
from kvpass.rewrites.insert_compressed_cache import prompt_cache
from kvpass.runtime.recent_queries import add_recent_queries
from kvpass.validation import refuse


class RuntimeModel(Protocol):
    """What the cache bookkeeping and the decode session read of a ``KVPassModel``."""

    policy: Policy
    budget: float | int
    graphs: RewrittenGraphs
    heads: HeadGroup
    decode_step: StaticDecodeStep
    compiled_decode: Callable | None      # the decode graph compiled (kvpass.compiled_decode.CompiledDecode)

    @property
    def device(self) -> torch.device: ...


@dataclass
class PromptCaches:
    """The prompt's caches after the last chunk of a chunked prefill (kvpass/runtime/chunked_prefill.py), before the
    runtime's final compression (``build_layers``): per attention site, its cache (a ring for a sliding-window layer shorter
    than prompt + new tokens), each batch row's live entries (max over KV heads) and the most live entries the
    layer held during the prefill; ``tokens`` is the padded prompt's length T."""

    caches: list[LayerCache]
    entries: list[list[int]]
    peaks: list[int]
    tokens: int


@dataclass
class Layer:
    """One layer of a session: its cache (a ring for a sliding-window layer), whether the policy compresses
    it, its budget and the host-side counts that decide when (no device sync)."""

    cache: LayerCache
    window: int | None           # a ring of this many slots, or None
    compressible: bool
    budget: int
    host_len: int                # max live entries over rows/heads, tracked without a device sync; where a
                                 # policy splits a layer's budget unevenly over heads (``head_capacity``), the
                                 # entries per head on average (budget after a compression, + 1 a step)
    sliding: bool = False        # a sliding-window layer: dense decode op, no policy inputs, never prepared
    full: LayerCache | None = None   # the layer's KV heads kept full (split-group layout, §0.6 b); ``cache``
                                     # then holds only its other heads
    # Per batch row (each row as if alone): its budget, the length at which it is compressed (its own
    # capacity: budget + interval, at most its own prompt + new tokens) and its live entries (max over
    # heads, tracked on the host). ``budget`` is their max and sets the buffers' capacity. Empty: the
    # layer is never compressed (rows are not tracked).
    row_budgets: list[int] = field(default_factory=list)
    row_caps: list[int] = field(default_factory=list)
    row_len: list[int] = field(default_factory=list)
    row_extra: list[int] = field(default_factory=list)    # head_capacity(budget) - budget per row (adakv)
    _keep_rows: tuple[tuple[int, ...], Tensor] | None = field(default=None, repr=False)
    peak: int = 0                # the most live entries (host_len) the layer held at any time, prefill included
    # deferred scores (kvpass/runtime/recent_queries.py): the decode steps whose queries wait in the cache's ring
    queries_waiting: int = 0

    def caches(self) -> list[LayerCache]:
        return [self.cache] if self.full is None else [self.cache, self.full]

    def due_rows(self) -> list[int]:
        """The rows whose entries reached their own capacity: compressed before the next step. Where a
        policy lets one head hold more than the budget (``row_extra``), the row's count is the entries per
        head on average (clamped to the budget after a compression), so it is due ``row_extra`` earlier."""
        extra = self.row_extra or [0] * len(self.row_len)
        return [b for b, (n, cap, e) in enumerate(zip(self.row_len, self.row_caps, extra, strict=True))
                if n >= cap - e]

    def whole(self, rows: Sequence[int]) -> bool:
        """Whether compressing ``rows`` is compressing the whole layer at one budget in its own buffers."""
        return len(rows) == len(self.row_budgets) and self.one_budget

    @property
    def one_budget(self) -> bool:
        """Every row has the layer's budget and capacity (one in-place compression fits the layer)."""
        return len(set(self.row_budgets)) == 1 and all(cap == self.cache.capacity for cap in self.row_caps)

    def keep_rows(self) -> Tensor:
        """``row_budgets`` as a [B] int64 tensor on the cache's device (``RaggedRows.compress_rows_into``), made
        once for the session's budgets: it exists before a CUDA-graphed step is captured (the step calls
        this first) and keeps its address."""
        key = tuple(self.row_budgets)
        if self._keep_rows is None or self._keep_rows[0] != key or self._keep_rows[1].device != self.cache.k.device:
            self._keep_rows = (key, torch.tensor(key, dtype=torch.long, device=self.cache.k.device))
        return self._keep_rows[1]

    def set_row_len(self, lengths: Sequence[int]) -> None:
        self.row_len = [int(n) for n in lengths]
        self.host_len = max(self.row_len, default=self.host_len)


def recorded_params(layers: Sequence[Layer]) -> tuple:
    """The host-side values a recorded decode step was built with (the ``params`` of its ``capture_key``): each
    layer's ring, budget and per-row budgets, capacities and head extras, which its compression's calls take as
    Python numbers (the per-row budget tensor, ``Layer.keep_rows``, holds the same row budgets)."""
    return tuple((lay.window, lay.budget, tuple(lay.row_budgets), tuple(lay.row_caps), tuple(lay.row_extra))
                 for lay in layers)


# A stacked group's K holds at most this many elements (the kernels' offsets stay within int32), and its
# caches at most this many bytes: its compression's temporaries are a few times that, on top of the prompt.
STACK_ELEMENTS = 2**30
STACK_BYTES = 2**30


def _layout(cache: LayerCache) -> tuple:
    """What caches must share to be stacked by rows: K's shape and dtype, metadata names and shapes."""
    return (tuple(cache.k.shape), cache.k.dtype, tuple((n, tuple(t.shape)) for n, t in cache.slot_meta.items()),
            tuple((n, tuple(t.shape)) for n, t in cache.state.items()))


def stacked_groups(layers: Sequence[Layer], stack: bool, spare_bytes: int | None) -> list[list[Layer]]:
    """The layers to compress together, in order of first appearance: with ``stack``, layers of one budget
    and cache layout whose state is per batch row, each group's K at most ``STACK_ELEMENTS`` elements and
    its caches at most ``STACK_BYTES`` and (``spare_bytes`` given) an eighth of those bytes (room for the
    stacked copy and the compression's temporaries); every other layer alone."""
    groups: dict[tuple, list[list[Layer]]] = {}
    for lay in layers:
        b = lay.cache.length.shape[0]
        if not stack or any(t.dim() == 0 or t.shape[0] != b for t in lay.cache.state.values()):
            groups[("alone", id(lay))] = [[lay]]
            continue
        runs = groups.setdefault((lay.budget, _layout(lay.cache)), [[]])
        cap = min(STACK_ELEMENTS // lay.cache.k.numel(), STACK_BYTES // lay.cache.nbytes())
        if spare_bytes is not None:
            cap = min(cap, spare_bytes // (8 * lay.cache.nbytes()))
        if len(runs[-1]) >= max(cap, 1):
            runs.append([])
        runs[-1].append(lay)
    return [group for runs in groups.values() for group in runs]


def row_budgets(model: RuntimeModel, total: int, row_total: list[int]) -> list[int]:
    """Each row's token budget per compressed layer, from its own prompt + new tokens (``row_total``), as
    if it ran alone; where the policy cannot hold rows of different budgets in one cache
    (``Policy.ragged_rows`` False), every row gets the batch's (from ``total``, its longest row)."""
    if not model.policy.ragged_rows:
        return [check_min_budget(model, total)] * len(row_total)
    return [check_min_budget(model, t) for t in row_total]


def row_layer_budgets(model: RuntimeModel, row_budget: list[int], caches: list[LayerCache]) -> list[list[int]]:
    """[row][layer] budgets of the compressed layers: the policy's ``layer_budgets`` of each row's own
    caches and budget, so a row's layer budgets never depend on its batch-mates. One call for the
    batch where every row has one budget and the policy keeps one budget for all layers."""
    if type(model.policy).layer_budgets is Policy.layer_budgets or not model.policy.ragged_rows:
        if len(set(row_budget)) == 1 or not model.policy.ragged_rows:
            return [model.policy.layer_budgets(max(row_budget), caches)] * len(row_budget)
    if len(row_budget) == 1:
        return [model.policy.layer_budgets(row_budget[0], caches)]
    return [model.policy.layer_budgets(budget, [take_rows(c, [b]) for c in caches])
            for b, budget in enumerate(row_budget)]


def build_layers(model: RuntimeModel, kv: Sequence[Tensor] | None, stats: dict[int, dict[str, Tensor]], pad: Tensor,
                 total: int, budget: int, recall_budget: int,
                 layer_budgets: list[int] | list[list[int]] | None = None,
                 prompt: PromptCaches | None = None) -> tuple[list[Layer], int]:
    """The layers' caches after prefill. Every row is budgeted as if alone: its budget from its own prompt
    + new tokens, its own per-layer budgets (D2O, PyramidKV), its own capacity; the buffers hold the
    largest. ``layer_budgets`` (groups of rows prefilled apart, ``prefill_rows``) gives every row those, or
    (a list per row) each row its own. ``prompt`` (chunked prefill, kvpass/runtime/chunked_prefill.py): each
    site's cache of the prompt so far, used instead of building them from ``kv`` (None then)."""
    t = kv[0].shape[2] if prompt is None else prompt.tokens
    row_tokens = [t - p for p in pad.tolist()]                          # each row's prompt
    row_total = [n + total - t for n in row_tokens]
    row_budget = prompt_row_budgets(model, total, row_total)          # refused here if below the minimum
    layers = site_layers(model, kv, stats, pad, total, row_tokens, prompt)
    compressed = [lay for lay in layers if lay.compressible]
    deferred = model.policy.prompt_compression_deferred()
    compressions = 0
    if compressed:
        if layer_budgets and isinstance(layer_budgets[0], (list, tuple)):
            per_row = [list(r) for r in layer_budgets]
        elif layer_budgets:
            per_row = [list(layer_budgets)] * len(row_tokens)
        else:
            per_row = row_layer_budgets(model, row_budget, [lay.cache for lay in compressed])
        set_row_budgets(model, compressed, per_row, row_total if model.policy.ragged_rows else [total] * len(row_total))
        due = [] if deferred else [lay for lay in compressed
                                   if any(n > b for n, b in zip(lay.row_len, lay.row_budgets, strict=True))]
        compress_prompt(model, due)
        compressions += len(due)
    for lay in layers:
        if lay.window is None:
            capacity = total if not lay.compressible else max(lay.row_caps)
            if deferred and lay.compressible and lay.host_len > lay.budget:   # the prompt and the first step
                capacity = min((t if prompt is None else lay.host_len) + 1, total)
            lay.cache = with_capacity(lay.cache, max(capacity, lay.host_len))
        if lay.full is not None:
            lay.full = with_capacity(lay.full, total)
    prepare_layers(model, layers, row_total, recall_budget)
    quantize_layers(model, layers)
    return layers, compressions


def quantize_layers(model: RuntimeModel, layers: list[Layer]) -> None:
    """Where the policy's entries are quantized (``kvpass.apply(..., kv_dtype=...)``), every layer's cache encoded once,
    its prompt compressed and prepared (kvpass/quantization); a split layer's full-head group stays in the model's
    dtype."""
    kv_dtype = kv_dtype_of(model.policy)
    if kv_dtype is None:
        return
    for lay in layers:
        if not is_quantized(lay.cache):
            lay.cache = quantize_cache(lay.cache, kv_dtype)


def prompt_row_budgets(model: RuntimeModel, total: int, row_total: list[int]) -> list[int]:
    """Each row's token budget per compressed layer (``row_budgets``); where some KV heads keep every token
    (§1.10), the other heads share what the full ones leave of the total."""
    full_heads = model.graphs.full_heads
    if not model.policy.compresses:
        return list(row_total)
    row_budget = row_budgets(model, total, row_total)
    if not full_heads:
        return row_budget
    heads = sum(s.n_kv_heads for s in model.graphs.sites if s.window is None)
    n_full = sum(map(len, full_heads.values()))
    totals = row_total if model.policy.ragged_rows else [total] * len(row_total)
    row_budget = [budget_with_full_heads(model.budget, n, heads, n_full) for n in totals]
    if min(row_budget) < model.policy.min_budget():
        raise ValueError(f"budget {model.budget!r} of {total} tokens leaves {min(row_budget)} entries per "
                         f"compressed head after keeping {full_heads} full, below {model.policy.name}'s minimum "
                         f"of {model.policy.min_budget()}; raise the budget")
    return row_budget


def site_layers(model: RuntimeModel, kv: Sequence[Tensor] | None, stats: dict[int, dict[str, Tensor]], pad: Tensor,
                total: int, row_tokens: list[int], prompt: PromptCaches | None) -> list[Layer]:
    """One ``Layer`` per attention site, uncompressed: a ring for a sliding-window layer shorter than ``total``, the
    prompt's cache otherwise (its full-cache KV heads apart, §0.6 b), each row's live entries counted."""
    full_heads = model.graphs.full_heads
    full_attention = [s.layer for s in model.graphs.sites if s.window is None]
    kept_whole = {full_attention[i] for i in model.policy.uncompressed_layers(len(full_attention))}
    layers: list[Layer] = []
    for i, site in enumerate(model.graphs.sites):
        if prompt is None:
            k, v = kv[2 * site.layer], kv[2 * site.layer + 1]
        if site.window is not None and site.window < total:
            ring = ring_from_prompt(k, v, pad, site.window) if prompt is None else prompt.caches[i]
            if prompt is not None:
                prompt.caches[i] = None
            layers.append(Layer(ring, site.window, False, site.window, int(ring.length.max()), True))
            layers[-1].peak = max(row_tokens) if prompt is None else prompt.peaks[i]   # the prefill held the prompt
            continue
        if prompt is None:
            cache = prompt_cache(k, v, pad, stats.get(site.layer, {}))
        else:
            cache, prompt.caches[i] = prompt.caches[i], None     # the layer owns it: freed when replaced
        kept_full = full_heads.get(site.layer, ())
        compressible = (model.policy.compresses and site.window is None and len(kept_full) < site.n_kv_heads
                        and site.layer not in kept_whole)
        full = None
        if compressible and kept_full:
            compressed_heads = [h for h in range(site.n_kv_heads) if h not in kept_full]
            cache, full = select_heads(cache, compressed_heads), select_heads(cache, kept_full)
        entries = row_tokens if prompt is None else prompt.entries[i]     # each row's live entries
        lay = Layer(cache, None, compressible, total, max(entries), site.window is not None, full)
        lay.peak = lay.host_len if prompt is None else prompt.peaks[i]
        if compressible:
            lay.row_len = list(entries)
        layers.append(lay)
    return layers


def set_row_budgets(model: RuntimeModel, compressed: list[Layer], per_row: list[list[int]], totals: list[int]) -> None:
    """Each compressed layer's per-row budgets (``per_row[row][layer]``), head extras and capacities: budget +
    extra + interval, at most the row's own prompt + new tokens (``totals``)."""
    interval = getattr(model.policy, "interval", 1)
    for i, lay in enumerate(compressed):
        lay.row_budgets = [int(r[i]) for r in per_row]
        lay.budget = max(lay.row_budgets)
        heads = lay.cache.length.shape[1] * model.heads.world     # every rank's heads (tensor parallel)
        lay.row_extra = [model.policy.head_capacity(b, heads) - b for b in lay.row_budgets]
        lay.row_caps = [min(b + e + interval, n) for b, e, n in zip(lay.row_budgets, lay.row_extra, totals,
                                                                    strict=True)]


def prepare_layers(model: RuntimeModel, layers: list[Layer], row_total: list[int], recall_budget: int) -> None:
    """``Policy.prepare`` of every full-attention layer with its budget (per row where the rows' differ: a [B]
    tensor), host-resident tensors pinned on the host, and the decode graph's extra state (the deferred-score ring,
    the fused nearest-key search's state) made for the layers that take it."""
    on_host = model.device.type != "cpu"
    row_recall = [budget_tokens(model.budget, n) for n in row_total]
    recall: int | Tensor = recall_budget
    if len(set(row_recall)) > 1:              # each row's own tokens attended per step (Quest, ClusterKV)
        recall = torch.tensor(row_recall, dtype=torch.long, device=model.device)
    for site, lay in zip(model.graphs.sites, layers, strict=True):
        if lay.sliding:
            continue
        budget_of: int | Tensor = lay.budget if lay.compressible else recall
        if lay.compressible and len(set(lay.row_budgets)) > 1:     # each row's own (EMS sizes its table by it)
            budget_of = torch.tensor(lay.row_budgets, dtype=torch.long, device=model.device)
        lay.cache = model.policy.prepare(lay.cache, site.layer, budget_of)
        for name in model.policy.host_resident if on_host else ():
            setattr(lay.cache, name, getattr(lay.cache, name).to("cpu").pin_memory())
        if site.layer in model.graphs.deferred_scores:
            add_recent_queries(lay.cache, site.n_heads, deferred_scores(model.policy))
        if site.layer in model.graphs.nearest_layers:
            lay.cache.state.update(model.policy.decode_state(lay.cache))


def compress_prompt(model: RuntimeModel, layers: list[Layer]) -> None:
    """Compress each layer's prompt cache to its budget (``Policy.compress``). A layer whose rows all
    hold the same number of tokens and have one budget is compressed whole; otherwise each row that
    exceeds its budget is compressed alone, at its own budget, in a cache of its own prompt's length
    (rows of one length and budget together), exactly as it would be in a batch of one.
    Whole layers: where the policy's rows are
    independent (``Policy.rows_independent``), layers of one budget and layout are compressed as one cache
    of their stacked rows (``stacked_groups``): a layer's compression is a few hundred small kernels, so
    at batch 1 the host's launches, not the GPU, set its time, once per group instead of once per layer.
    Where any layers are stacked, the groups run one after the other (their kernels fill the GPU, and one
    group's temporaries are freed before the next's); where none are, the layers run side by side on CUDA,
    on the decode step's side streams.
    Then one sync reads every layer's new lengths back, not one sync a layer."""
    ragged = [lay for lay in layers if model.policy.ragged_rows and
              (len(set(lay.row_len)) > 1 or len(set(lay.row_budgets)) > 1)]
    for lay in ragged:
        compress_prompt_rows(model, lay)
    layers_whole = [lay for lay in layers if all(lay is not r for r in ragged)]

    def compress(group: list[Layer]) -> None:
        keep = group[0].budget
        if len(group) == 1:
            group[0].cache = model.policy.compress(group[0].cache, keep)
            return
        out = model.policy.compress(concat_rows([lay.cache for lay in group]), keep)
        for lay, part in zip(group, split_rows(out, len(group)), strict=True):
            lay.cache = part

    spare = None
    if model.device.type == "cuda":              # what a stacked group may take: its copy and the steps' temporaries
        free, _ = torch.cuda.mem_get_info(model.device)
        spare = free + torch.cuda.memory_reserved(model.device) - torch.cuda.memory_allocated(model.device)
    groups = stacked_groups(layers_whole, model.policy.rows_independent, spare)
    inputs = [lay.cache for lay in layers_whole]    # alive until the side streams are joined
    calls = [functools.partial(compress, group) for group in groups]
    if len(groups) < len(layers_whole) or model.heads.world > 1:    # tensor parallel: collectives in one order
        for call in calls:
            call()
    else:
        model.decode_step.run_all(calls, model.device)
    del inputs
    if model.device.type == "cuda":
        main = torch.cuda.current_stream(model.device)
        for lay in layers_whole:              # made on a side stream, used on this one from now on
            for t in lay.cache.tensors():
                t.record_stream(main)
    if layers:
        longest = model.heads.max(torch.stack([lay.cache.length.amax(-1) for lay in layers]))  # [L, B], every rank's heads
        for lay, n in zip(layers, longest.tolist(), strict=True):
            lay.set_row_len(n)
            check_within_budget(model, lay)


def compress_prompt_rows(model: RuntimeModel, lay: Layer) -> None:
    """Each row of ``lay`` above its budget compressed alone (rows of one prompt length and budget
    together) in a copy of its own prompt's length, then put back into the layer's cache."""
    out = with_capacity(lay.cache, lay.cache.capacity)          # new buffers: the prefill stays unchanged
    out.state = {n: t.clone() for n, t in out.state.items()}
    groups: dict[tuple[int, int], list[int]] = {}
    for b, (n, keep) in enumerate(zip(lay.row_len, lay.row_budgets, strict=True)):
        if n > keep:
            groups.setdefault((keep, n), []).append(b)
    for (keep, n), rows in groups.items():
        put_rows_at(out, model.policy.compress(take_rows(lay.cache, rows, n), keep), rows)
    lay.cache = out


def compress_rows_into(model: RuntimeModel, lay: Layer, rows: list[int]) -> None:
    """Decode time, eager: the due ``rows`` of ``lay`` compressed each to its own budget in a copy of its
    own capacity (rows of one budget and capacity together, compressed in place as a batch of one
    would run it), written back into the layer's buffers; then their lengths are read back (a sync)."""
    groups: dict[tuple[int, int], list[int]] = {}
    for b in rows:
        groups.setdefault((lay.row_budgets[b], lay.row_caps[b]), []).append(b)
    for (keep, cap), part_rows in groups.items():
        part = take_rows(lay.cache, part_rows, cap)
        compress_in_place(model.policy, part, keep)
        put_rows_at(lay.cache, part, part_rows)
    lay.set_row_len(model.heads.max(lay.cache.length.amax(-1)).tolist())
    check_within_budget(model, lay)


def check_within_budget(model: RuntimeModel, lay: Layer) -> None:
    """The policy's contract after a compression: no KV head of a row holds more than the row's budget
    (more only where the policy splits a layer's budget unevenly over heads, ``row_extra``). Then the
    host-side counts are clamped to the budgets (see ``Layer.due_rows``)."""
    extra = lay.row_extra or [0] * len(lay.row_len)
    # a row not due (interval > 1: above its budget, below its capacity; the others' compression leaves it as it
    # is) keeps its count
    waiting = [e == 0 and keep < n < cap for n, keep, cap, e in zip(lay.row_len, lay.row_budgets, lay.row_caps, extra,
                                                                     strict=True)]
    for b, (n, keep, e) in enumerate(zip(lay.row_len, lay.row_budgets, extra, strict=True)):
        if n > keep + e and not waiting[b]:
            raise RuntimeError(f"policy {model.policy.name} left {n} entries in a KV head of batch row {b} for a "
                               f"budget of {keep}" + (f" (at most {keep + e} in one head)" if e else ""))
    lay.set_row_len([n if wait else min(n, keep)
                     for n, keep, wait in zip(lay.row_len, lay.row_budgets, waiting, strict=True)])


def check_min_budget(model: RuntimeModel, total: int) -> int:
    """The token budget per compressed layer for ``total`` tokens; raises below the policy's minimum."""
    budget = total if not model.policy.compresses else budget_tokens(model.budget, total)
    if model.policy.compresses and budget < model.policy.min_budget():
        raise refuse("budget.minimum", got=budget, source=f" (from {model.budget!r} of {total})",
                     policy=model.policy.name, minimum=model.policy.min_budget())
    return budget
