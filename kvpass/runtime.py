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
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from kvpass.budget import budget_tokens, budget_with_full_heads, check_budget
from kvpass.cache import (
    LayerCache,
    concat_rows,
    empty_rows,
    load_into,
    put_rows,
    put_rows_at,
    ring_from_prompt,
    select_heads,
    split_rows,
    take_rows,
    with_capacity,
)
from kvpass.decode_step import StaticDecodeStep, fork_side_by_side, join_pending
from kvpass.head_group import SINGLE_PROCESS, HeadGroup
from kvpass.policies.base import Policy
from kvpass.rewrites import CapturedModel, RewrittenGraphs, compile_model
from kvpass.rewrites.insert_compressed_cache import DECODE_STATS, prompt_cache
from kvpass.sampling import next_token
from kvpass.validation import (
    MEMORY_ADVICE,
    as_input_ids,
    check_generate_kwargs,
    check_max_new_tokens,
    check_memory,
    check_sampling,
    estimate_prefill_bytes,
    in_use,
    left_pads,
    refuse,
)

if TYPE_CHECKING:
    from kvpass.chunked_prefill import PromptCaches


@dataclass
class GenerationReport:
    """What the last ``generate`` did. Bytes are real allocations: ``cache_bytes`` is every cache
    tensor kvpass holds at the end on the model's device (K, V, log-weights, lengths, positions, policy
    metadata), ``host_bytes`` those a recall policy keeps in host memory (``Policy.host_resident``;
    0 when the model runs on the CPU, where every tensor counts as device-resident);
    ``full_cache_bytes`` is what a full cache of the same tokens holds (K and V of every token in
    every layer, in the model dtype), the number plain transformers would hold. With
    ``expand_kv_heads`` the cache holds every KV head G = Hq/Hkv times, and ``cache_bytes`` counts every
    copy while ``full_cache_bytes`` stays the model's own (so ``full`` then reports G times it)."""

    policy: str
    batch: int
    prompt_tokens: int
    new_tokens: int
    budget_tokens: int
    layer_budgets: dict[int, int]
    cache_bytes: int
    full_cache_bytes: int
    compressions: int
    prefill_seconds: float
    decode_seconds: float
    entries: dict[int, int] = field(default_factory=dict)   # layer -> live entries (max over rows/compressed heads)
    host_bytes: int = 0          # cache tensors kept in host memory while the model runs on an accelerator
    policy_stats: dict[str, float] = field(default_factory=dict)   # Policy.report (e.g. a recall hit rate)
    full_heads: dict[int, tuple[int, ...]] = field(default_factory=dict)   # layer -> KV heads that keep every token
    # per batch row: layer -> that row's budget (``layer_budgets`` holds the max over rows, the buffers' size);
    # each row's are what it gets alone (its own prompt length and, for D2O, its own attention variance)
    row_layer_budgets: list[dict[int, int]] = field(default_factory=list)
    # layer -> the most live entries one KV head of it held at any time, prefill included (tracked on the host,
    # max over rows): the whole prompt for a plain prefill, about budget + chunk with ``prefill_chunk``
    peak_entries: dict[int, int] = field(default_factory=dict)
    prefill_chunk: int | None = None    # the chunk length the prompt was prefilled in (None: in one piece)

    @property
    def tokens_per_second(self) -> float:
        return self.batch * self.new_tokens / max(self.prefill_seconds + self.decode_seconds, 1e-9)

    @property
    def compression_ratio(self) -> float:
        return self.cache_bytes / max(self.full_cache_bytes, 1)


@dataclass
class GenerateOutput:
    """Returned with ``return_dict_in_generate=True``, like transformers' output."""

    sequences: Tensor
    logits: tuple[Tensor, ...] | None
    report: GenerationReport


@dataclass
class Prefill:
    """What a prefill returns, before any compression (``KVPassModel.prefill``): ``logits`` [B, V] fp32
    for the next position, ``kv`` [k_0, v_0, ..., k_{L-1}, v_{L-1}] each [B, Hkv, T, D], ``stats``
    {layer: {stat name: [B, Hkv, T] or [B, H] fp32}}, ``pad`` [B] left pads, ``pos`` [B, T] positions,
    ``max_new_tokens`` the tokens that will follow (they set the budget), ``seconds`` its wall time."""

    logits: Tensor
    kv: list[Tensor]
    stats: dict[int, dict[str, Tensor]]
    pad: Tensor
    pos: Tensor
    max_new_tokens: int
    seconds: float = 0.0

    @property
    def batch(self) -> int:
        return self.logits.shape[0]

    def rows(self, index: Sequence[int]) -> Prefill:
        """The prefill of the batch rows ``index`` only (left padding beyond the new batch's longest row
        is kept, so each row's tensors are unchanged)."""
        idx = torch.as_tensor(list(index), dtype=torch.long, device=self.logits.device)
        if len(idx) == self.batch and bool((idx == torch.arange(self.batch, device=idx.device)).all()):
            return self
        return Prefill(logits=self.logits[idx], kv=[x[idx] for x in self.kv],
                       stats={la: {n: x[idx] for n, x in d.items()} for la, d in self.stats.items()},
                       pad=self.pad[idx], pos=self.pos[idx], max_new_tokens=self.max_new_tokens, seconds=self.seconds)


@dataclass
class _Layer:
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
        """Every row has the layer's budget and capacity (``Policy.compress_into`` fits the layer)."""
        return len(set(self.row_budgets)) == 1 and all(cap == self.cache.capacity for cap in self.row_caps)

    def keep_rows(self) -> Tensor:
        """``row_budgets`` as a [B] int64 tensor on the cache's device (``Policy.compress_rows_into``), made
        once for the session's budgets: it exists before a CUDA-graphed step is captured (the step calls
        this first) and keeps its address."""
        key = tuple(self.row_budgets)
        if self._keep_rows is None or self._keep_rows[0] != key or self._keep_rows[1].device != self.cache.k.device:
            self._keep_rows = (key, torch.tensor(key, dtype=torch.long, device=self.cache.k.device))
        return self._keep_rows[1]

    def set_row_len(self, lengths: Sequence[int]) -> None:
        self.row_len = [int(n) for n in lengths]
        self.host_len = max(self.row_len, default=self.host_len)


# A stacked group's K holds at most this many elements (the kernels' offsets stay within int32), and its
# caches at most this many bytes: its compression's temporaries are a few times that, on top of the prompt.
STACK_ELEMENTS = 2**30
STACK_BYTES = 2**30


def _layout(cache: LayerCache) -> tuple:
    """What caches must share to be stacked by rows: K's shape and dtype, metadata names and shapes."""
    return (tuple(cache.k.shape), cache.k.dtype, tuple((n, tuple(t.shape)) for n, t in cache.slot_meta.items()),
            tuple((n, tuple(t.shape)) for n, t in cache.state.items()))


def stacked_groups(layers: Sequence[_Layer], stack: bool, spare_bytes: int | None) -> list[list[_Layer]]:
    """The layers to compress together, in order of first appearance: with ``stack``, layers of one budget
    and cache layout whose state is per batch row, each group's K at most ``STACK_ELEMENTS`` elements and
    its caches at most ``STACK_BYTES`` and (``spare_bytes`` given) an eighth of those bytes (room for the
    stacked copy and the compression's temporaries); every other layer alone."""
    groups: dict[tuple, list[list[_Layer]]] = {}
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


_UNSET = object()          # an argument left out, as opposed to an explicit None
_GENERATE_ARGS = ("input_ids", "attention_mask", "max_new_tokens", "do_sample", "temperature", "top_k",
                  "top_p", "eos_token_id", "pad_token_id", "streamer", "generator", "return_dict_in_generate",
                  "output_logits", "prefill_chunk")


class KVPassModel(nn.Module):
    """A causal LM whose attention runs over a compressed KV cache. Built by ``kvpass.apply`` (from the
    graphs of ``kvpass.rewrites.compile_model``); shares the original model's weights and leaves its modules
    and values unchanged. Where the pipeline fused sibling projections (``fuse_linears``, default on CUDA)
    their parameters share the storage of one concatenated tensor."""

    def __init__(self, model: nn.Module, policy: Policy, budget: float | int,
                 captured: CapturedModel, graphs: RewrittenGraphs, heads: HeadGroup = SINGLE_PROCESS) -> None:
        super().__init__()
        check_budget(budget)
        self.fused_linears = graphs.fused_linears
        # heads: this rank's share of every layer's KV heads under tensor parallelism (kvpass.head_group);
        # host-side lengths and sampled tokens are agreed over it, and the policy reduces over it
        self.heads = heads
        self.policy, self.budget = policy.bind_model(model).with_heads(heads), budget
        self.captured, self.graphs = captured, graphs
        self._model = [model]                      # not a submodule: its weights are not ours to own
        self.config = model.config
        self.generation_config = getattr(model, "generation_config", None)
        self.last_report: GenerationReport | None = None
        self._all_logits_prefill = None
        # Each decode step's device work, replayed from a CUDA graph on CUDA (eager on CPU); decode_step.py.
        self.decode_step = StaticDecodeStep()
        # Rows prefilled at a time (None: the whole batch). Smaller groups bound the prefill's memory (the
        # full K, V of every layer exist only for the group being compressed), so larger batches fit;
        # per-layer budgets (D2O, PyramidKV) are then those of the first group's largest [OURS]: the one
        # place where a row's budgets depend on its batch-mates (the stacked buffers need one layout).
        self.prefill_rows: int | None = None
        # Decode-time compression of a layer whose rows have budgets of their own (D2O's per-row layer budgets):
        # True takes the whole layer in one call where the policy can (``Policy.rows_in_one_call``), in the
        # CUDA-graphed step; False compresses the due rows one budget at a time in copies (eager, a host sync
        # a layer): the old path, kept for benchmarks/ragged_decode_gpu.py's before/after. Same tokens.
        self.rows_in_one_call = True
        # Prompt tokens prefilled at a time (None: the whole prompt), each layer compressed back to its budget
        # between chunks, so prefill holds about budget + chunk entries per layer (kvpass/chunked_prefill.py).
        self.prefill_chunk: int | None = None
        self._chunk_step = None                    # the chunk-step graph, built on first use (chunked_prefill)
        self._lock = threading.Lock()              # held by generate(): a second thread gets ModelInUse
        # bytes free on the device for the pre-prefill memory check (None: validation.free_device_bytes, which
        # asks CUDA and skips other devices); tests set a function to exercise the check on the CPU
        self.free_bytes = None

    @property
    def model(self) -> nn.Module:
        return self._model[0]

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def __repr__(self) -> str:
        return (f"KVPassModel({self.config.model_type}, policy={self.policy!r}, budget={self.budget}, "
                f"layers={len(self.graphs.sites)})")

    # ---------------------------------------------------------------- forward
    @torch.no_grad()
    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Logits [B, T, V] of a plain forward over the prompt (the prefill graph, full attention)."""
        if self._all_logits_prefill is None:
            from kvpass.policies.full import Full
            self._all_logits_prefill = compile_model(self.captured, Full(), sites=self.graphs.sites,
                                                     fuse_linears=self.fused_linears, prefill_only=True,
                                                     last_logits_only=False).prefill
        ids, pad, pos = self._prepare(input_ids, attention_mask, 0)
        return self._all_logits_prefill(ids, pos, pad)[0]

    # ---------------------------------------------------------------- generate
    def _prepare(self, input_ids, attention_mask, max_new_tokens) -> tuple[Tensor, Tensor, Tensor]:
        """ids [B, T], left pads [B], positions [B, T] after every input check (``kvpass.validation``)."""
        ids = as_input_ids(input_ids, self.device, self.vocab_size)
        mask, pad = left_pads(attention_mask, ids)
        longest = int(ids.shape[1] - pad.min())
        ctx = self.captured.context_length
        if longest > ctx:
            raise refuse("input_ids.context", got=longest, context=ctx)
        if longest + max_new_tokens > ctx:
            raise refuse("max_new_tokens.context", prompt=longest, got=max_new_tokens, context=ctx)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        return ids, pad, pos

    @property
    def vocab_size(self) -> int | None:
        """Token ids must lie in [0, vocab_size): the input embedding's rows."""
        emb = self.model.get_input_embeddings() if hasattr(self.model, "get_input_embeddings") else None
        weight = getattr(emb, "weight", None)
        return int(weight.shape[0]) if weight is not None else getattr(self.config, "vocab_size", None)

    def _gen_default(self, name: str, value, fallback):
        if value is not None:
            return value
        got = getattr(self.generation_config, name, None) if self.generation_config is not None else None
        return fallback if got is None else got

    def _row_budgets(self, total: int, row_total: list[int]) -> list[int]:
        """Each row's token budget per compressed layer, from its own prompt + new tokens (``row_total``), as
        if it ran alone; where the policy cannot hold rows of different budgets in one cache
        (``Policy.ragged_rows`` False), every row gets the batch's (from ``total``, its longest row)."""
        if not self.policy.ragged_rows:
            return [self._check_min_budget(total)] * len(row_total)
        return [self._check_min_budget(t) for t in row_total]

    def _row_layer_budgets(self, row_budget: list[int], caches: list[LayerCache]) -> list[list[int]]:
        """[row][layer] budgets of the compressed layers: the policy's ``layer_budgets`` of each row's own
        caches and budget, so a row's layer budgets never depend on its batch-mates. One call for the
        batch where every row has one budget and the policy keeps one budget for all layers."""
        if type(self.policy).layer_budgets is Policy.layer_budgets or not self.policy.ragged_rows:
            if len(set(row_budget)) == 1 or not self.policy.ragged_rows:
                return [self.policy.layer_budgets(max(row_budget), caches)] * len(row_budget)
        if len(row_budget) == 1:
            return [self.policy.layer_budgets(row_budget[0], caches)]
        return [self.policy.layer_budgets(budget, [take_rows(c, [b]) for c in caches])
                for b, budget in enumerate(row_budget)]

    def _build_layers(self, kv: Sequence[Tensor] | None, stats: dict[int, dict[str, Tensor]], pad: Tensor,
                      total: int, budget: int, recall_budget: int,
                      layer_budgets: list[int] | list[list[int]] | None = None,
                      prompt: PromptCaches | None = None) -> tuple[list[_Layer], int]:
        """The layers' caches after prefill. Every row is budgeted as if alone: its budget from its own prompt
        + new tokens, its own per-layer budgets (D2O, PyramidKV), its own capacity; the buffers hold the
        largest. ``layer_budgets`` (groups of rows prefilled apart, ``prefill_rows``) gives every row those, or
        (a list per row) each row its own. ``prompt`` (chunked prefill, kvpass/chunked_prefill.py): each
        site's cache of the prompt so far, used instead of building them from ``kv`` (None then)."""
        layers: list[_Layer] = []
        t = kv[0].shape[2] if prompt is None else prompt.tokens
        new = total - t
        row_tokens = [t - p for p in pad.tolist()]                          # each row's prompt
        row_total = [n + new for n in row_tokens]
        prompt_len = max(row_tokens)
        compressions = 0
        full_heads = self.graphs.full_heads
        row_budget = self._row_budgets(total, row_total) if self.policy.compresses else list(row_total)
        if full_heads:              # §1.10: the other heads share what the full ones leave of the total
            heads = sum(s.n_kv_heads for s in self.graphs.sites if s.window is None)
            n_full = sum(map(len, full_heads.values()))
            totals = row_total if self.policy.ragged_rows else [total] * len(row_total)
            row_budget = [budget_with_full_heads(self.budget, n, heads, n_full) for n in totals]
            if min(row_budget) < self.policy.min_budget():
                raise ValueError(f"budget {self.budget!r} of {total} tokens leaves {min(row_budget)} entries per "
                                 f"compressed head after keeping {full_heads} full, below {self.policy.name}'s minimum "
                                 f"of {self.policy.min_budget()}; raise the budget")
        full_attention = [s.layer for s in self.graphs.sites if s.window is None]
        kept_whole = {full_attention[i] for i in self.policy.uncompressed_layers(len(full_attention))}
        deferred = self.policy.prompt_compression_deferred()
        for i, site in enumerate(self.graphs.sites):
            if prompt is None:
                k, v = kv[2 * site.layer], kv[2 * site.layer + 1]
            if site.window is not None and site.window < total:
                ring = ring_from_prompt(k, v, pad, site.window) if prompt is None else prompt.caches[i]
                if prompt is not None:
                    prompt.caches[i] = None
                layers.append(_Layer(ring, site.window, False, site.window, int(ring.length.max()), True))
                layers[-1].peak = prompt_len if prompt is None else prompt.peaks[i]   # the prefill held the prompt
                continue
            if prompt is None:
                cache = prompt_cache(k, v, pad, stats.get(site.layer, {}))
            else:
                cache, prompt.caches[i] = prompt.caches[i], None     # the layer owns it: freed when replaced
            kept_full = full_heads.get(site.layer, ())
            compressible = (self.policy.compresses and site.window is None and len(kept_full) < site.n_kv_heads
                            and site.layer not in kept_whole)
            full = None
            if compressible and kept_full:
                compressed_heads = [h for h in range(site.n_kv_heads) if h not in kept_full]
                cache, full = select_heads(cache, compressed_heads), select_heads(cache, kept_full)
            entries = row_tokens if prompt is None else prompt.entries[i]     # each row's live entries
            lay = _Layer(cache, None, compressible, total, max(entries), site.window is not None, full)
            lay.peak = lay.host_len if prompt is None else prompt.peaks[i]
            if compressible:
                lay.row_len = list(entries)
            layers.append(lay)
        compressed = [lay for lay in layers if lay.compressible]
        if compressed:
            if layer_budgets and isinstance(layer_budgets[0], (list, tuple)):
                per_row = [list(r) for r in layer_budgets]
            elif layer_budgets:
                per_row = [list(layer_budgets)] * len(row_tokens)
            else:
                per_row = self._row_layer_budgets(row_budget, [lay.cache for lay in compressed])
            interval = getattr(self.policy, "interval", 1)
            for i, lay in enumerate(compressed):
                lay.row_budgets = [int(r[i]) for r in per_row]
                lay.budget = max(lay.row_budgets)
                totals = row_total if self.policy.ragged_rows else [total] * len(row_total)
                heads = lay.cache.length.shape[1] * self.heads.world     # every rank's heads (tensor parallel)
                lay.row_extra = [self.policy.head_capacity(b, heads) - b for b in lay.row_budgets]
                lay.row_caps = [min(b + e + interval, n) for b, e, n in zip(lay.row_budgets, lay.row_extra, totals,
                                                                            strict=True)]
            due = [] if deferred else [lay for lay in compressed
                                       if any(n > b for n, b in zip(lay.row_len, lay.row_budgets, strict=True))]
            self._compress_prompt(due)
            compressions += len(due)
        for lay in layers:
            if lay.window is None:
                capacity = total if not lay.compressible else max(lay.row_caps)
                if deferred and lay.compressible and lay.host_len > lay.budget:   # the prompt and the first step
                    capacity = min((kv[0].shape[2] if prompt is None else lay.host_len) + 1, total)
                lay.cache = with_capacity(lay.cache, max(capacity, lay.host_len))
            if lay.full is not None:
                lay.full = with_capacity(lay.full, total)
        on_host = self.device.type != "cpu"
        row_recall = [budget_tokens(self.budget, n) for n in row_total]
        recall: int | Tensor = recall_budget
        if len(set(row_recall)) > 1:              # each row's own tokens attended per step (Quest, ClusterKV)
            recall = torch.tensor(row_recall, dtype=torch.long, device=self.device)
        for site, lay in zip(self.graphs.sites, layers, strict=True):
            if lay.sliding:
                continue
            budget_of: int | Tensor = lay.budget if lay.compressible else recall
            if lay.compressible and len(set(lay.row_budgets)) > 1:     # each row's own (EMS sizes its table by it)
                budget_of = torch.tensor(lay.row_budgets, dtype=torch.long, device=self.device)
            lay.cache = self.policy.prepare(lay.cache, site.layer, budget_of)
            for name in self.policy.host_resident if on_host else ():
                setattr(lay.cache, name, getattr(lay.cache, name).to("cpu").pin_memory())
        return layers, compressions

    def _compress_prompt(self, layers: list[_Layer]) -> None:
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
        ragged = [lay for lay in layers if self.policy.ragged_rows and
                  (len(set(lay.row_len)) > 1 or len(set(lay.row_budgets)) > 1)]
        for lay in ragged:
            self._compress_prompt_rows(lay)
        layers_whole = [lay for lay in layers if all(lay is not r for r in ragged)]

        def compress(group: list[_Layer]) -> None:
            keep = group[0].budget
            if len(group) == 1:
                group[0].cache = self.policy.compress(group[0].cache, keep)
                return
            out = self.policy.compress(concat_rows([lay.cache for lay in group]), keep)
            for lay, part in zip(group, split_rows(out, len(group)), strict=True):
                lay.cache = part

        spare = None
        if self.device.type == "cuda":              # what a stacked group may take: its copy and the steps' temporaries
            free, _ = torch.cuda.mem_get_info(self.device)
            spare = free + torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        groups = stacked_groups(layers_whole, self.policy.rows_independent, spare)
        inputs = [lay.cache for lay in layers_whole]    # alive until the side streams are joined
        calls = [functools.partial(compress, group) for group in groups]
        if len(groups) < len(layers_whole) or self.heads.world > 1:    # tensor parallel: collectives in one order
            for call in calls:
                call()
        else:
            self.decode_step.run_all(calls, self.device)
        del inputs
        if self.device.type == "cuda":
            main = torch.cuda.current_stream(self.device)
            for lay in layers_whole:              # made on a side stream, used on this one from now on
                for t in lay.cache.tensors():
                    t.record_stream(main)
        if layers:
            longest = self.heads.max(torch.stack([lay.cache.length.amax(-1) for lay in layers]))  # [L, B], every rank's heads
            for lay, n in zip(layers, longest.tolist(), strict=True):
                lay.set_row_len(n)
                self._check_within_budget(lay)

    def _compress_prompt_rows(self, lay: _Layer) -> None:
        """Each row of ``lay`` above its budget compressed alone (rows of one prompt length and budget
        together) in a copy of its own prompt's length, then put back into the layer's cache."""
        out = with_capacity(lay.cache, lay.cache.capacity)          # new buffers: the prefill stays unchanged
        out.state = {n: t.clone() for n, t in out.state.items()}
        groups: dict[tuple[int, int], list[int]] = {}
        for b, (n, keep) in enumerate(zip(lay.row_len, lay.row_budgets, strict=True)):
            if n > keep:
                groups.setdefault((keep, n), []).append(b)
        for (keep, n), rows in groups.items():
            put_rows_at(out, self.policy.compress(take_rows(lay.cache, rows, n), keep), rows)
        lay.cache = out

    def _compress_rows_into(self, lay: _Layer, rows: list[int]) -> None:
        """Decode time, eager: the due ``rows`` of ``lay`` compressed each to its own budget in a copy of its
        own capacity (rows of one budget and capacity together, ``Policy.compress_into`` as a batch of one
        would run it), written back into the layer's buffers; then their lengths are read back (a sync)."""
        groups: dict[tuple[int, int], list[int]] = {}
        for b in rows:
            groups.setdefault((lay.row_budgets[b], lay.row_caps[b]), []).append(b)
        for (keep, cap), part_rows in groups.items():
            part = take_rows(lay.cache, part_rows, cap)
            self.policy.compress_into(part, keep)
            put_rows_at(lay.cache, part, part_rows)
        lay.set_row_len(self.heads.max(lay.cache.length.amax(-1)).tolist())
        self._check_within_budget(lay)

    def _check_within_budget(self, lay: _Layer) -> None:
        """The policy's contract after a compression: no KV head of a row holds more than the row's budget
        (more only where the policy splits a layer's budget unevenly over heads, ``row_extra``). Then the
        host-side counts are clamped to the budgets (see ``_Layer.due_rows``)."""
        extra = lay.row_extra or [0] * len(lay.row_len)
        for b, (n, keep, e) in enumerate(zip(lay.row_len, lay.row_budgets, extra, strict=True)):
            if n > keep + e:
                raise RuntimeError(f"policy {self.policy.name} left {n} entries in a KV head of batch row {b} for a "
                                   f"budget of {keep}" + (f" (at most {keep + e} in one head)" if e else ""))
        lay.set_row_len([min(n, keep) for n, keep in zip(lay.row_len, lay.row_budgets, strict=True)])

    def _check_min_budget(self, total: int) -> int:
        """The token budget per compressed layer for ``total`` tokens; raises below the policy's minimum."""
        budget = total if not self.policy.compresses else budget_tokens(self.budget, total)
        if self.policy.compresses and budget < self.policy.min_budget():
            raise refuse("budget.minimum", got=budget, source=f" (from {self.budget!r} of {total})",
                         policy=self.policy.name, minimum=self.policy.min_budget())
        return budget

    @torch.no_grad()
    def prefill(self, input_ids: Tensor, attention_mask: Tensor | None = None, max_new_tokens: int = 0,
                graphs: RewrittenGraphs | None = None) -> Prefill:
        """Run the prefill graph over ``input_ids`` [B, T] (left-padded with ``attention_mask``) and keep
        what it returns (last logits, per-layer K, V, statistics), uncompressed. ``graphs``: another
        rewrite of the same captured model whose prefill emits a superset of this policy's statistics
        (a shared prefill serving several policies, ``kvpass.eval.shared``); default this model's."""
        ids, pad, pos = self._prepare(input_ids, attention_mask, max_new_tokens)
        graphs = graphs or self.graphs
        if [s.n_kv_heads for s in graphs.sites] != [s.n_kv_heads for s in self.graphs.sites]:
            raise ValueError(f"the given prefill graphs cache {[s.n_kv_heads for s in graphs.sites]} KV heads per "
                             f"layer, {self.policy.name}'s cache {[s.n_kv_heads for s in self.graphs.sites]} "
                             "(expand_kv_heads differs); prefill with graphs of the same layout")
        start = time.perf_counter()
        logits, kv, stats = graphs.split_prefill(graphs.prefill(ids, pos, pad))
        return Prefill(logits=logits[:, -1].float(), kv=kv, stats=stats, pad=pad, pos=pos,
                       max_new_tokens=max_new_tokens, seconds=time.perf_counter() - start)

    @torch.no_grad()
    def start_from(self, prefill: Prefill, layer_budgets: list[int] | None = None) -> DecodeSession:
        """Build this policy's caches from a prefill (which stays unchanged, so several policies can
        start from one) and return the session to step. Statistics the policy does not ask for are ignored.
        ``layer_budgets``: the compressed layers' budgets to use instead of the policy's own choice."""
        t = prefill.kv[0].shape[2]
        total = t + prefill.max_new_tokens
        budget = self._check_min_budget(total)
        start = time.perf_counter()
        wanted = {stat.value for stat in self.policy.stats} if self.policy.compresses else set()
        stats = {layer: {n: x for n, x in got.items() if n in wanted} for layer, got in prefill.stats.items()}
        layers, compressions = self._build_layers(prefill.kv, stats, prefill.pad, total, budget,
                                                  budget_tokens(self.budget, total), layer_budgets)
        session = DecodeSession(self, layers, prefill.pos[:, -1:] + 1, prefill.logits.clone(), budget,
                                int(t - prefill.pad.min()), compressions)
        session.prefill_seconds = prefill.seconds + time.perf_counter() - start
        return session

    @torch.no_grad()
    def start(self, input_ids: Tensor, attention_mask: Tensor | None = None, max_new_tokens: int = 0,
              prefill_chunk: int | None = _UNSET) -> DecodeSession:
        """Prefill ``input_ids`` [B, T] (left-padded with ``attention_mask``) and build the caches,
        compressed to the budget for ``T + max_new_tokens`` tokens. Returns the session to step.

        ``max_new_tokens`` counts every token that will go through ``step``/``feed`` afterwards.
        ``prefill_chunk``: prefill the prompt this many tokens at a time, compressing between chunks
        (kvpass/chunked_prefill.py); left out: ``self.prefill_chunk``; None: in one piece."""
        chunk = self.prefill_chunk if prefill_chunk is _UNSET else prefill_chunk
        if chunk is not None:
            from kvpass.chunked_prefill import check_prefill_chunk, start_chunked

            check_prefill_chunk(chunk, self)
        ids = as_input_ids(input_ids, self.device, self.vocab_size)
        mask, _ = left_pads(attention_mask, ids)
        self._check_min_budget(ids.shape[-1] + max_new_tokens)
        batch = ids.shape[0]
        rows = self.prefill_rows or batch
        if chunk is not None and ids.shape[1] > chunk:     # the memory check is the chunks' (start_chunked)
            if rows >= batch:
                return start_chunked(self, ids, mask, max_new_tokens, chunk)
        else:
            chunk = None
            self._check_memory(min(rows, batch), ids.shape[1], ids.shape[1] + max_new_tokens)
        if rows >= batch:
            return self.start_from(self.prefill(ids, mask, max_new_tokens))

        def groups() -> Iterator[DecodeSession]:     # prefill and compress a group of rows at a time
            budgets = None
            for r in range(0, batch, rows):
                part = slice(r, r + rows)
                if chunk is not None:
                    session = start_chunked(self, ids[part], mask[part], max_new_tokens, chunk, budgets)
                else:
                    session = self.start_from(self.prefill(ids[part], mask[part], max_new_tokens), budgets)
                budgets = budgets or [lay.budget for lay in session.layers if lay.compressible] or None
                yield session
                del session                         # not alive while the next group prefills

        return _stack_sessions(groups(), batch)

    def _check_memory(self, batch: int, tokens: int, total: int) -> None:
        """Refuse before the prefill when its estimated memory (``validation.estimate_prefill_bytes``) exceeds
        what is free on the device (CUDA; ``validation.free_device_bytes``)."""
        if self.device.type != "cuda" and self.free_bytes is None:
            return
        kv_width = sum(s.n_kv_heads * s.head_dim for s in self.graphs.sites)
        slots = total if not self.policy.compresses else budget_tokens(self.budget, total) + getattr(
            self.policy, "interval", 1)
        need = estimate_prefill_bytes(self.config, batch, tokens, total, slots, next(self.model.parameters()).dtype,
                                      kv_width)
        check_memory(need, self.device, batch, tokens, self.free_bytes)

    @torch.no_grad()
    def generate(self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                 max_new_tokens: int | None = None, do_sample: bool | None = None, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None, eos_token_id: int | list[int] | None = _UNSET,
                 pad_token_id: int | None = _UNSET, streamer=None, generator: torch.Generator | None = None,
                 return_dict_in_generate: bool = False, output_logits: bool = False,
                 prefill_chunk: int | None = _UNSET, **unsupported):
        """Generate like transformers' ``generate`` (greedy or sampling), with the compressed cache.

        input_ids: [B, T]; attention_mask: [B, T], left padding for B > 1. Returns the sequences
        [B, T + new] (rows that finished early are filled with ``pad_token_id``), or a
        ``GenerateOutput`` with ``return_dict_in_generate``. ``self.last_report`` holds cache bytes
        and timings. As in transformers, ``eos_token_id`` / ``pad_token_id`` left out come from the
        model's generation config, and an explicit None means none. ``prefill_chunk`` (kvpass): prefill the
        prompt this many tokens at a time, each layer compressed back to its budget between chunks
        (kvpass/chunked_prefill.py; left out: ``self.prefill_chunk``, set by ``kvpass.apply``)."""
        check_generate_kwargs(unsupported, _GENERATE_ARGS)
        if input_ids is None:
            raise refuse("input_ids.missing")
        if not self._lock.acquire(blocking=False):      # one generate at a time: the decode step's buffers are shared
            raise in_use()
        session = None
        try:
            max_new_tokens = check_max_new_tokens(self._gen_default("max_new_tokens", max_new_tokens, 20))
            sampling = dict(do_sample=bool(self._gen_default("do_sample", do_sample, False)),
                            temperature=self._gen_default("temperature", temperature, 1.0),
                            top_k=self._gen_default("top_k", top_k, None), top_p=self._gen_default("top_p", top_p, None),
                            generator=generator)
            check_sampling(sampling["do_sample"], sampling["temperature"], sampling["top_k"], sampling["top_p"])
            sampling["temperature"] = float(sampling["temperature"])
            eos = self._gen_default("eos_token_id", None, None) if eos_token_id is _UNSET else eos_token_id
            eos_ids = torch.tensor([eos] if isinstance(eos, int) else list(eos or []), device=self.device)
            pad_id = self._gen_default("pad_token_id", None, None) if pad_token_id is _UNSET else pad_token_id
            if pad_id is None:
                pad_id = int(eos_ids[0]) if len(eos_ids) else 0
            ids = as_input_ids(input_ids, self.device, self.vocab_size)
            session = self.start(ids, attention_mask, max_new_tokens, prefill_chunk)
            if streamer is not None:
                streamer.put(ids.cpu())
            new, step_logits = session.sample(max_new_tokens, eos_ids, pad_id, streamer, output_logits, **sampling)
            if streamer is not None:
                streamer.end()
            self.last_report = session.report()
        except torch.OutOfMemoryError as err:           # free what this call holds, then say what to change
            batch, tokens = _shape_of(input_ids)
            session = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            raise refuse("memory.oom", batch=batch, tokens=tokens, advice=MEMORY_ADVICE[0].upper() + MEMORY_ADVICE[1:] + ".") from err
        finally:
            session = None                             # never outlives the call, whatever happened
            self._lock.release()
        sequences = torch.cat([ids, new], dim=1)
        if return_dict_in_generate:
            return GenerateOutput(sequences, step_logits, self.last_report)
        return sequences


def _shape_of(input_ids) -> tuple[int, int]:
    """(batch, tokens) of whatever input_ids is, for messages."""
    shape = tuple(getattr(input_ids, "shape", ()) or ())
    return (shape[0], shape[-1]) if len(shape) == 2 else (1, shape[-1] if shape else 0)


def _stack_sessions(groups: Iterable[DecodeSession], batch: int) -> DecodeSession:
    """Sessions of groups of rows prefilled one after the other (``prefill_rows``), as one batch of ``batch``
    rows: the first group's caches give the layout of batch-sized buffers (``empty_rows``), and every group's
    rows are copied in (``put_rows``) before the next group is prefilled, so at most one group's session is
    alive beside the batch's caches."""
    out: DecodeSession | None = None
    pos, logits = [], []
    start = 0
    for session in groups:
        if out is None:
            layers = [_Layer(empty_rows(lay.cache, batch), lay.window, lay.compressible, lay.budget, 0, lay.sliding,
                             None if lay.full is None else empty_rows(lay.full, batch)) for lay in session.layers]
            for lay in layers:
                lay.row_len = []
            out = DecodeSession(session.owner, layers, session.pos, session.logits, session.budget, 0, 0)
        for dst, src in zip(out.layers, session.layers, strict=True):
            for d, c in zip(dst.caches(), src.caches(), strict=True):
                put_rows(d, c, start)
            dst.host_len = max(dst.host_len, src.host_len)
            dst.peak = max(dst.peak, src.peak)
            dst.row_budgets += src.row_budgets
            dst.row_caps += src.row_caps
            dst.row_len += src.row_len
            dst.row_extra += src.row_extra
        start += session.batch
        pos.append(session.pos)
        logits.append(session.logits)
        out.prompt_tokens = max(out.prompt_tokens, session.prompt_tokens)
        out.compressions += session.compressions
        out.prefill_seconds += session.prefill_seconds
        out.prefill_chunk = session.prefill_chunk
        del session                               # its caches go before the next group is prefilled
    if out is None or start != batch:
        raise ValueError(f"the groups of rows held {start} rows, not the batch's {batch}")
    out.pos, out.logits = torch.cat(pos), torch.cat(logits)
    return out


class DecodeSession:
    """The caches of one batch after prefill, stepped one token at a time.

    ``logits`` [B, V] (fp32) always holds the prediction for the next position; ``step(tokens)``
    appends tokens [B] at absolute positions ``pos`` [B, 1] and updates it. A layer is compressed
    before a step whenever its buffer is full (decided from host-side lengths: no device sync)."""

    def __init__(self, owner: KVPassModel, layers: list[_Layer], pos: Tensor, logits: Tensor, budget: int,
                 prompt_tokens: int, compressions: int) -> None:
        self.owner, self.policy, self.layers = owner, owner.policy, layers
        self.pos, self.logits, self.budget = pos, logits, budget
        self.prompt_tokens, self.compressions = prompt_tokens, compressions
        self.steps = 0
        self.prefill_seconds = self.decode_seconds = 0.0
        self.prefill_chunk: int | None = None         # set by a chunked prefill (kvpass/chunked_prefill.py)

    @property
    def batch(self) -> int:
        return self.logits.shape[0]

    @torch.no_grad()
    def step(self, tokens: Tensor) -> Tensor:
        """tokens: [B] int64 -> logits [B, V] for the position after them."""
        start = time.perf_counter()
        self._deferred_prompt_compression()
        whole: list[int] = []
        for i, lay in enumerate(self.layers):
            rows = lay.due_rows() if lay.compressible and not self._still_wide(lay) else []
            if not rows:
                continue
            if lay.whole(rows) or self._rows_in_one_call(lay):    # the whole layer in its own buffers
                whole.append(i)
            else:                                 # some rows, or rows of their own budgets: each as if alone
                self.owner._compress_rows_into(lay, rows)
                self.compressions += 1
        due = tuple(whole)
        if due and not self.owner.decode_step.graphed(self.logits.device, due):
            for i in due:                         # eager: compress, check the budget (a sync), then the step
                lay = self.layers[i]
                self._compress_layer(lay)
                lay.set_row_len(self.owner.heads.max(lay.cache.length.amax(-1)).tolist())
                self.owner._check_within_budget(lay)
            due_in_step: tuple[int, ...] = ()
        else:
            due_in_step = due                     # graphed: compression is part of the replayed step
        self.logits = self._device_step(tokens, due_in_step)
        for i in due:
            # the policy contract: a compressed row holds at most `budget` entries (checked when eager)
            lay = self.layers[i]
            lay.set_row_len([min(n, b) for n, b in zip(lay.row_len, lay.row_budgets, strict=True)])
            self.compressions += 1
        for lay in self.layers:
            self._advance_host(lay)
        self.pos = self.pos + 1
        self.steps += 1
        if self.policy.maintenance_due(self.steps):
            for site, lay in zip(self.owner.graphs.sites, self.layers, strict=True):
                if not lay.sliding:
                    load_into(lay.cache, self.policy.maintain(lay.cache, site.layer))
        self.decode_seconds += time.perf_counter() - start
        return self.logits

    def _rows_in_one_call(self, lay: _Layer) -> bool:
        """Whether the layer's rows, of budgets of their own, are compressed by one call of the policy
        (``Policy.rows_in_one_call``: every due row as alone, the others unchanged) rather than one budget at
        a time in copies (``KVPassModel._compress_rows_into``). Makes the per-row budget tensor now, before
        a CUDA-graphed step could capture it. ``KVPassModel.rows_in_one_call = False`` turns it off (the
        benchmark's before/after)."""
        if not (self.owner.rows_in_one_call and not any(lay.row_extra)
                and self.policy.rows_in_one_call(lay.row_budgets, lay.row_caps)):
            return False
        if not lay.one_budget:
            lay.keep_rows()
        return True

    def _compress_layer(self, lay: _Layer) -> None:
        """The whole layer in its own buffers: ``compress_rows_into`` at each row's own budget where the rows'
        budgets or capacities differ and ``_rows_in_one_call``, else ``compress_into`` at the layer's budget.
        No host sync."""
        if not lay.one_budget and self._rows_in_one_call(lay):
            self.policy.compress_rows_into(lay.cache, lay.keep_rows())
        else:
            self.policy.compress_into(lay.cache, lay.budget)

    def _still_wide(self, lay: _Layer) -> bool:
        """A layer whose prompt compression ``Policy.prompt_compression_deferred`` put off: its buffers
        still hold the whole prompt and the first decode step (wider than any row's budget + interval)."""
        return bool(lay.row_caps) and lay.cache.capacity > max(lay.row_caps)

    def _deferred_prompt_compression(self) -> None:
        """``Policy.prompt_compression_deferred``: a layer still holding its whole prompt and full after the
        first decode step is compressed now, eagerly, each row to its own budget (rows of one budget
        together), into buffers of the rows' largest budget + interval (new addresses: a CUDA-graphed
        step re-captures)."""
        if not self.policy.prompt_compression_deferred():
            return
        for lay in self.layers:
            if not (lay.compressible and self._still_wide(lay) and lay.host_len >= lay.cache.capacity):
                continue
            groups: dict[int, list[int]] = {}
            for b, keep in enumerate(lay.row_budgets):
                groups.setdefault(keep, []).append(b)
            out = None
            for keep, rows in groups.items():
                part = self.policy.compress(take_rows(lay.cache, rows), keep)
                part = with_capacity(part, max(lay.row_caps), check=False)   # live <= keep <= the capacity
                out = out if out is not None else empty_rows(part, self.batch)
                put_rows_at(out, part, rows)
            lay.cache = out
            lay.set_row_len(self.owner.heads.max(lay.cache.length.amax(-1)).tolist())
            self.owner._check_within_budget(lay)
            self.compressions += 1

    @torch.no_grad()
    def feed(self, tokens: Tensor) -> Tensor:
        """Teacher forcing: tokens [B, n] -> [B, n + 1, V], the logits held before the call followed
        by the logits after each fed token."""
        out = [self.logits]
        for i in range(tokens.shape[1]):
            out.append(self.step(tokens[:, i]))
        return torch.stack(out, dim=1)

    @torch.no_grad()
    def sample(self, max_new_tokens: int, eos_ids: Tensor, pad_id: int, streamer=None, output_logits: bool = False,
               **sampling) -> tuple[Tensor, tuple[Tensor, ...] | None]:
        """Sample up to ``max_new_tokens`` tokens -> ([B, n] tokens, per-step logits or None)."""
        unfinished = torch.ones(self.batch, dtype=torch.bool, device=self.logits.device)
        tokens, step_logits = [], []
        for i in range(max_new_tokens):
            if output_logits:
                step_logits.append(self.logits)
            tok = self.owner.heads.broadcast(next_token(self.logits, **sampling))   # rank 0's token (tensor parallel)
            tok = torch.where(unfinished, tok, torch.full_like(tok, pad_id))
            tokens.append(tok)
            if streamer is not None:
                streamer.put(tok.cpu())
            if len(eos_ids):
                unfinished &= ~torch.isin(tok, eos_ids)
                if not bool(unfinished.any()):
                    break
            if i < max_new_tokens - 1:
                self.step(tok)
        return torch.stack(tokens, dim=1), (tuple(step_logits) if output_logits else None)

    def _decode_inputs(self, lay: _Layer, slot: Tensor) -> list[Tensor]:
        cache = lay.cache
        if lay.sliding:                           # sliding-window layers always use the dense op
            return [cache.k, cache.v, cache.log_weight, slot, cache.position]
        extra = [cache.slot_meta[n] if n in cache.slot_meta else cache.state[n] for n in self.policy.decode_inputs]
        full = ([] if lay.full is None else
                [lay.full.k, lay.full.v, lay.full.log_weight, lay.full.length.clone(), lay.full.position])
        return [cache.k, cache.v, cache.log_weight, slot, cache.position, *extra, *full]

    def _device_step(self, tokens: Tensor, compress: tuple[int, ...] = ()) -> Tensor:
        """The device work of one step: compression of the layers ``compress`` names, slots, the decode
        graph (writes K, V, attends), score accumulation, lengths and positions. tokens: [B] -> logits
        [B, V] fp32. On CUDA it is replayed from a CUDA graph (decode_step.py), one per set of
        compressed layers: it reads and writes only the layers' cache tensors."""
        layers, graphs = self.layers, self.owner.graphs

        def step(tokens: Tensor, pos: Tensor) -> tuple[Tensor]:
            # a compressed layer's slot is its length after compression: written by compress_layers
            slots = [torch.empty_like(lay.cache.length) if i in compress else self._slot(lay, pos)
                     for i, lay in enumerate(layers)]
            self.compress_layers(compress, join=False, slots={i: slots[i] for i in compress})
            flat = [x for lay, slot in zip(layers, slots, strict=True) for x in self._decode_inputs(lay, slot)]
            outs = graphs.decode(tokens[:, None], pos, *flat)
            join_pending()
            if graphs.decode_scores:              # one multi-tensor launch per statistic, for every layer
                for stat in sorted(self.policy.stats & DECODE_STATS, key=lambda s: s.value):
                    metas = [layers[i].cache.slot_meta[stat.value] for i in graphs.decode_scores]
                    (torch._foreach_add_ if stat.accumulates else torch._foreach_copy_)(metas, list(outs[1:]))
            self._advance(layers)
            return (outs[0][:, -1].float(),)

        persistent = [t for lay in layers for c in lay.caches() for t in c.tensors()]
        if compress:                              # compression moves entries: everything is restored
            restore = persistent
        else:                                     # what a plain step advances (K, V: rewritten alike)
            big = {id(t) for lay in layers for c in lay.caches() for t in (c.k, c.v)}
            restore = [t for t in persistent if id(t) not in big]
        return self.owner.decode_step(step, [tokens, self.pos], persistent, restore, variant=compress)[0]

    def compress_layers(self, indices: Sequence[int], join: bool = True, slots: dict[int, Tensor] | None = None) -> None:
        """Compress the layers ``indices`` in their own buffers (the policy's ``compress_into``, no host
        sync), then set ``slots[i]`` [B, Hkv] (where given) to layer i's new length. On CUDA the layers run
        side by side on the decode step's side streams: joined before returning (``run_side_by_side``), or
        with ``join=False`` left for the decode graph to await layer by layer (``fork_side_by_side``; the
        step joins what is left after the graph)."""
        def compress(i: int) -> None:
            self._compress_layer(self.layers[i])
            if slots is not None and i in slots:
                slots[i].copy_(self.layers[i].cache.length)

        calls = [functools.partial(compress, i) for i in indices]
        if self.owner.heads.world > 1:            # tensor parallel: a policy's collectives run in one order
            for call in calls:
                call()
        elif calls and self.logits.is_cuda and not join:
            streams = self.owner.decode_step.side_streams(self.logits.device)
            fork_side_by_side([(self.layers[i].cache.k, c) for i, c in zip(indices, calls, strict=True)], streams)
        else:
            self.owner.decode_step.run_all(calls, self.logits.device)

    @staticmethod
    def _slot(lay: _Layer, pos: Tensor) -> Tensor:
        """Where this step's K, V go: [B, Hkv] int64."""
        if lay.window is not None:
            return (pos % lay.window).expand_as(lay.cache.length)
        return lay.cache.length.clone()

    @staticmethod
    def _advance(layers: Sequence[_Layer]) -> None:
        """lengths += 1 (a ring's clamped first) after the decode graph wrote the step's entries (and their
        positions, ``write_kv``): all layers in one multi-tensor launch (at batch 1 the step is launch-bound)."""
        grown: list[Tensor] = []
        rings: dict[int, list[Tensor]] = {}
        for lay in layers:
            if lay.window is not None:
                rings.setdefault(lay.window, []).append(lay.cache.length)
            grown.append(lay.cache.length)
            if lay.full is not None:            # every token stays
                grown.append(lay.full.length)
        for window, lengths in rings.items():
            torch._foreach_clamp_max_(lengths, window - 1)
        torch._foreach_add_(grown, 1)

    @staticmethod
    def _advance_host(lay: _Layer) -> None:
        """The host copy of the step's length change (no device sync)."""
        lay.host_len = min(lay.host_len + 1, lay.window) if lay.window is not None else lay.host_len + 1
        lay.row_len = [n + 1 for n in lay.row_len]
        lay.peak = max(lay.peak, lay.host_len)

    def report(self) -> GenerationReport:
        """Cache bytes and timings now; ``new_tokens`` counts the positions after the prompt (steps + 1)."""
        b, layers, new_tokens = self.batch, self.layers, self.steps + 1
        full = sum(2 * b * s.model_kv_heads * s.head_dim * (self.prompt_tokens + new_tokens) * lay.cache.k.element_size()
                   for s, lay in zip(self.owner.graphs.sites, layers, strict=True))
        tensors = [t for lay in layers for c in lay.caches() for t in c.tensors()]
        on_host = [self.owner.device.type != "cpu" and t.device.type == "cpu" for t in tensors]
        host = sum(t.numel() * t.element_size() for t, h in zip(tensors, on_host, strict=True) if h)
        device = sum(t.numel() * t.element_size() for t, h in zip(tensors, on_host, strict=True) if not h)
        return GenerationReport(
            policy=self.policy.name, batch=b, prompt_tokens=self.prompt_tokens, new_tokens=new_tokens,
            budget_tokens=self.budget,
            layer_budgets={i: lay.budget for i, lay in enumerate(layers) if lay.compressible},
            cache_bytes=device, full_cache_bytes=full, host_bytes=host,
            policy_stats=self.policy.report([lay.cache for lay in layers if not lay.sliding]),
            compressions=self.compressions, prefill_seconds=self.prefill_seconds,
            decode_seconds=self.decode_seconds, entries={i: lay.host_len for i, lay in enumerate(layers)},
            full_heads=dict(self.owner.graphs.full_heads),
            peak_entries={i: lay.peak for i, lay in enumerate(layers)}, prefill_chunk=self.prefill_chunk,
            row_layer_budgets=[{i: lay.row_budgets[r] for i, lay in enumerate(layers) if lay.compressible}
                               for r in range(b)])
