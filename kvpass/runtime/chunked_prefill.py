"""Chunked prefill with compression between chunks (issue 29): the prompt is prefilled ``prefill_chunk`` tokens
at a time and every compressible layer is compressed back to its budget after each chunk, so a layer holds
at most about budget + chunk entries during prefill instead of the whole prompt.

    chunk 0     ─▶ the prefill graph (as an unchunked prefill of those tokens) ─▶ per-layer caches with the
                   policy's statistics; the layer budgets are decided here, once (see below)
    chunk i > 0 ─▶ the chunk-step graph (kvpass/rewrites/chunk_step.py): each layer's queries attend over
                   the layer's cache and, causally, the chunk itself (``kvpass::chunk_attention``) ─▶ the
                   chunk's K, V and statistics appended to the cache; the cache's own statistics updated
    between chunks: each compressible layer whose rows hold more than their budget is compressed
                   (in place where the policy can, rows of one budget together), lengths read back once a chunk
    after the last chunk: the caches go through the runtime's usual prompt compression, budgets, capacities
                   and ``prepare`` (``kvpass.runtime.layers.build_layers``), then decode as usual.

Chunks are balanced: ceil(T / chunk) chunks whose sizes differ by at most one token (all <= chunk), so the
last one is never a sliver and holds SnapKV's observation window whenever the window is <= chunk / 2. A prompt
of at most ``chunk`` tokens is prefilled exactly as without chunking. What each statistic becomes:

* ``col_sum`` (H2O, D2O, CaM, KVMerger): accumulated, as over decode steps: every chunk's queries add their
  attention (normalised over the compressed cache + the chunk) to the entries they see. Without compression
  it is the unchunked prefill's column sum; with it, evicted tokens' attention is lost, as in decode.
* ``window_scores`` (SnapKV, PyramidKV, AdaKV, D2O scores="window"): replaced at every chunk by the chunk's
  own observation window (its last ``window`` queries) over every entry still cached; so each compression
  ranks by the window of the chunk just prefilled, and the last chunk's window ranks the whole kept set at the
  end, as the prompt's last window does unchunked. Pooling runs over the kept entries in sequence order.
* ``last_attn`` (TOVA): replaced by the chunk's last query's attention.
* ``attn_var`` (D2O's layer budgets): from the first chunk only. The layer budgets are fixed there (rows whose
  first chunk holds fewer than two real tokens take the longest row's variances), with the whole prompt's
  length, so every compression of the prefill uses the budgets decode will.
* D2O's EMA threshold, Chelsea's step counters and other per-head state carry over from compression to
  compression as in decode; D2O with first_compression="decode" compresses between chunks and defers only the
  last compression to after the first decode step.

Refused (``prefill_chunk.policy``): EMS (``Policy.prefill_chunks`` False: its first compression builds the slot
table its decode op expands through), full-cache KV heads (Chelsea's calibrated outlier heads) and tensor
parallelism. Policies that keep every token (full, Quest, ClusterKV) prefill in chunks without compressing:
only the activations shrink. Sliding-window layers keep their last ``window`` entries between chunks.
"""

from __future__ import annotations

import math
import time
import weakref
from typing import Protocol

import torch
from torch import Tensor

from kvpass.budget import budget_tokens
from kvpass.cache import (
    EMPTY,
    LayerCache,
    gather_slots,
    keep_slots,
    put_rows_at,
    put_slots,
    take_rows,
    with_capacity,
)
from kvpass.policies.base import Stat
from kvpass.policies.capabilities import compress_in_place
from kvpass.rewrites.insert_compressed_cache import prompt_cache
from kvpass.rewrites.pipeline import compile_chunk_step
from kvpass.runtime.inputs import PrefillingModel, check_prefill_memory, prepare_inputs
from kvpass.runtime.layers import PromptCaches, build_layers, check_min_budget, row_budgets, row_layer_budgets
from kvpass.runtime.session import DecodeSession
from kvpass.validation import check_memory, estimate_prefill_bytes, refuse


class ChunkingModel(PrefillingModel, Protocol):
    """What the chunked prefill reads of a ``KVPassModel`` (kvpass/runtime/model.py, which imports this module)."""

    fused_linears: bool

    def prefill(self, input_ids: Tensor, attention_mask: Tensor | None = None, max_new_tokens: int = 0): ...

    def start_from(self, prefill, layer_budgets: list[int] | None = None) -> DecodeSession: ...


# model -> its chunk-step graph and keys, built on first use (the graph lives as long as the model)
_CHUNK_STEPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

# statistics a chunk adds to what the cache holds; every other one replaces it (a window of the newest queries)
ACCUMULATED = frozenset({Stat.COLUMN_SUM})


def check_prefill_chunk_value(chunk: object) -> None:
    """Refuse a ``prefill_chunk`` that is not None or an int >= 1."""
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int)):
        raise refuse("prefill_chunk.type", got=chunk)
    if chunk is not None and chunk < 1:
        raise refuse("prefill_chunk.range", got=chunk)


def check_prefill_chunk(chunk: object, model: ChunkingModel) -> None:
    """Refuse a ``prefill_chunk`` that is not None or an int >= 1, or that the model's policy cannot use."""
    check_prefill_chunk_value(chunk)
    if chunk is None:
        return
    policy = model.policy
    if policy.compresses and Stat.RECONSTRUCTION in policy.stats:
        reason = (f"policy {policy.name}: it scores entries by the model repeating the whole prompt over the prompt's "
                  "uncompressed cache (docs/policies.md §6.13)")
    elif not policy.prefill_chunks:
        reason = (f"policy {policy.name}: its first compression turns the cache into entries its decode attention "
                  "expands (Policy.prefill_chunks is False)")
    elif policy.compresses and model.graphs.full_heads:
        reason = f"policy {policy.name} with full-cache KV heads (a calibration's outlier heads)"
    else:
        return
    raise refuse("prefill_chunk.policy", got=chunk, reason=reason)


def chunk_bounds(tokens: int, chunk: int) -> list[tuple[int, int]]:
    """[start, stop) of ceil(tokens / chunk) consecutive chunks whose sizes differ by at most one (all <= chunk)."""
    n = max(1, math.ceil(tokens / chunk))
    cuts = [i * tokens // n for i in range(n + 1)]
    return list(zip(cuts[:-1], cuts[1:], strict=True))


def append_chunk(cache: LayerCache, k: Tensor, v: Tensor, pad: Tensor, pos: Tensor, meta: dict[str, Tensor]) -> None:
    """Append a chunk's real tokens to every (row, KV head) of ``cache`` in place, after its live entries: the
    chunk's K, V [B, Hkv, T, D] (``pad`` [B] left pads, positions ``pos`` [B, T]) and per-slot statistics
    ``meta`` {name: [B, Hkv, T]}. The cache must have ``length + T`` slots in every row (the caller sizes it)."""
    b, h, t = k.shape[:3]
    ar = torch.arange(t, device=k.device)
    src = (ar[None, :] + pad[:, None]).clamp(max=t - 1)                       # [B, T]: the real tokens, left-aligned
    real = (ar[None, :] < (t - pad)[:, None])[:, None, :].expand(b, h, t)      # [B, Hkv, T]
    take = src[:, None, :].expand(b, h, t)
    slots = cache.length[:, :, None] + ar                                      # [B, Hkv, T]
    put_slots(cache.k, slots, gather_slots(k, take))
    put_slots(cache.v, slots, gather_slots(v, take))
    put_slots(cache.log_weight, slots, torch.where(real, 0.0, EMPTY).float())
    put_slots(cache.position, slots, torch.where(real, torch.gather(pos, 1, src)[:, None, :], -1))
    for name, x in meta.items():
        put_slots(cache.slot_meta[name], slots, torch.where(real, gather_slots(x, take), 0.0).to(x.dtype))
    cache.length += (t - pad)[:, None]


def last_entries(cache: LayerCache, window: int, capacity: int) -> LayerCache:
    """Each (row, KV head)'s newest ``window`` entries, in buffers of ``capacity`` slots (a sliding-window layer
    between chunks)."""
    first = (cache.length - window).clamp(min=0)
    idx = first[:, :, None] + torch.arange(window, device=cache.k.device)
    return with_capacity(keep_slots(with_capacity(cache, max(cache.capacity, window)), idx), capacity)


def ring_of(cache: LayerCache, window: int) -> LayerCache:
    """A sliding-window ring of ``window`` slots (the token at position p in slot p % window, as
    ``cache.ring_from_prompt``) from a cache holding each row's newest <= ``window`` entries in order."""
    cache = with_capacity(cache, max(cache.capacity, window))
    first = cache.position[:, :, :1]                                           # [B, Hkv, 1]
    slot = torch.arange(window, device=cache.k.device)[None, None, :]
    src = torch.remainder(slot - first, window)                                # the entry whose position % W is slot
    ok = src < cache.length[:, :, None]
    ring = keep_slots(cache, src)
    ring.log_weight = torch.where(ok, ring.log_weight, EMPTY)
    ring.position = torch.where(ok, ring.position, -1)
    ring.length = ok.sum(-1)
    return ring


def chunk_step_graph(model: ChunkingModel):
    """(the chunk-step GraphModule, its statistics' (layer, Stat) keys) of ``model``, built on first use."""
    if model not in _CHUNK_STEPS:
        _CHUNK_STEPS[model] = compile_chunk_step(model.captured, model.policy, model.graphs.sites, model.fused_linears)
    return _CHUNK_STEPS[model]


class _ChunkedPrefill:
    """The state of one chunked prefill: per attention site its cache, whether it is compressed, its rows'
    budgets and head capacities (compressed layers), its rows' live entries and its peak, on the host."""

    def __init__(self, model: ChunkingModel, pad: Tensor, total: int, tokens: int, chunk: int) -> None:
        self.model, self.policy, self.sites = model, model.policy, list(model.graphs.sites)
        self.pad, self.total, self.tokens, self.chunk = pad, total, tokens, chunk
        full_attention = [s.layer for s in self.sites if s.window is None]
        kept_whole = {full_attention[i] for i in self.policy.uncompressed_layers(len(full_attention))}
        self.compressible = [self.policy.compresses and s.window is None and s.layer not in kept_whole
                             for s in self.sites]
        self.ring = [s.window is not None and s.window < total for s in self.sites]
        self.caches: list[LayerCache] = []
        self.entries: list[list[int]] = []    # per site, per row: live entries as the runtime counts them
        self.longest: list[list[int]] = []    # per site, per row: the most live entries of one KV head
        self.peaks: list[int] = []
        self.budgets: list[list[int]] = [[] for _ in self.sites]       # per site: each row's budget
        self.caps: list[list[int]] = [[] for _ in self.sites]          # per site: each row's most entries per head
        self.row_layer_budgets: list[list[int]] | None = None
        self.compressions = 0

    # ------------------------------------------------------------------ chunk 0
    def first(self, ids: Tensor, pos: Tensor, layer_budgets: list[int] | None) -> Tensor:
        """Prefill the first chunk (``ids``, ``pos`` [B, T0]) with the prefill graph, build the caches and decide
        the budgets; returns the logits [B, V] fp32 of the chunk's last position."""
        graphs, t0 = self.model.graphs, ids.shape[1]
        pad = self.pad.clamp(max=t0)
        logits, kv, stats = graphs.split_prefill(graphs.prefill(ids, pos, pad))
        wanted = {s.value for s in self.policy.stats} if self.policy.compresses else set()
        for site in self.sites:
            got = {name: x for name, x in stats.get(site.layer, {}).items() if name in wanted}
            self.caches.append(prompt_cache(kv[2 * site.layer], kv[2 * site.layer + 1], pad, got))
            self.entries.append([t0 - p for p in pad.tolist()])
        self.longest = [list(e) for e in self.entries]
        self.peaks = [max(e) for e in self.entries]
        self._decide_budgets(t0, layer_budgets)
        largest = max(b - a for a, b in chunk_bounds(self.tokens, self.chunk))
        longest = self.tokens - int(self.pad.min())
        for i, cache in enumerate(self.caches):
            if self.ring[i]:
                capacity = self.sites[i].window + largest
                self.caches[i] = last_entries(cache, self.sites[i].window, capacity)
                self.entries[i] = [min(n, self.sites[i].window) for n in self.entries[i]]
                self.longest[i] = list(self.entries[i])
            else:
                capacity = (max(self.caps[i]) if self.compressible[i] else longest) + largest
                self.caches[i] = with_capacity(cache, max(capacity, max(self.entries[i])))
        return logits[:, -1].float()

    def _decide_budgets(self, t0: int, layer_budgets: list[int] | None) -> None:
        """Each row's budget per compressed layer, from its whole prompt + new tokens and (D2O, PyramidKV) the
        policy's ``layer_budgets`` of the first chunk's caches standing for the prompt (each row's prompt length;
        a row whose first chunk holds fewer than two real tokens takes the longest row's per-head statistics)."""
        model, pad = self.model, self.pad
        compressed = [i for i, c in enumerate(self.compressible) if c]
        if not compressed:
            return
        row_tokens = [self.tokens - p for p in pad.tolist()]
        row_total = [n + self.total - self.tokens for n in row_tokens]
        row_budget = row_budgets(model, self.total, row_total)
        if layer_budgets:
            per_row = [list(layer_budgets)] * len(row_tokens)
        else:
            thin = [b for b, p in enumerate(pad.tolist()) if t0 - p < 2]
            donor = int(pad.argmin())
            stand_in = []
            for i in compressed:
                cache = self.caches[i]
                state = {name: _rows_from(x, thin, donor) for name, x in cache.state.items()}
                length = torch.tensor(row_tokens, device=cache.length.device)[:, None].expand_as(cache.length)
                stand_in.append(LayerCache(cache.k, cache.v, cache.log_weight, length.contiguous(), cache.position,
                                           dict(cache.slot_meta), state))
            per_row = row_layer_budgets(model, row_budget, stand_in)
        self.row_layer_budgets = [list(r) for r in per_row]
        for j, i in enumerate(compressed):
            heads = self.caches[i].length.shape[1]
            self.budgets[i] = [int(r[j]) for r in per_row]
            self.caps[i] = [self.policy.head_capacity(b, heads) for b in self.budgets[i]]

    # ------------------------------------------------------------------ chunks 1, 2, ...
    def step(self, ids: Tensor, pos: Tensor, start: int) -> Tensor:
        """Prefill the chunk ``ids``, ``pos`` [B, T] starting at padded column ``start`` over the caches and append
        it to them; returns the logits [B, V] fp32 of its last position."""
        gm, keys = chunk_step_graph(self.model)
        t = ids.shape[1]
        pad = (self.pad - start).clamp(min=0, max=t)
        flat = [x for c in self.caches for x in (c.k, c.v, c.log_weight, c.position)]
        outs = gm(ids, pos, pad, *flat)
        n = len(self.sites)
        stats: dict[int, dict[Stat, Tensor]] = {}
        for (layer, stat), value in zip(keys, outs[1 + 2 * n:], strict=True):
            stats.setdefault(layer, {})[stat] = value
        added = (t - pad).tolist()
        for i, (site, cache) in enumerate(zip(self.sites, self.caches, strict=True)):
            c = cache.capacity
            fresh: dict[str, Tensor] = {}
            for stat, value in stats.get(site.layer, {}).items():
                if stat.value not in cache.slot_meta:
                    continue
                old = cache.slot_meta[stat.value]
                if stat in ACCUMULATED:
                    old += value[..., :c].to(old.dtype)
                else:
                    old.copy_(value[..., :c])
                fresh[stat.value] = value[..., c:]
            for name, old in cache.slot_meta.items():       # a statistic the chunk does not give starts at 0
                fresh.setdefault(name, torch.zeros(old.shape[0], old.shape[1], t, dtype=old.dtype, device=old.device))
            append_chunk(cache, outs[1 + 2 * site.layer], outs[2 + 2 * site.layer], pad, pos, fresh)
            self.entries[i] = [e + a for e, a in zip(self.entries[i], added, strict=True)]
            self.longest[i] = [e + a for e, a in zip(self.longest[i], added, strict=True)]
            self.peaks[i] = max(self.peaks[i], max(self.longest[i]))
            if self.ring[i]:
                self.caches[i] = last_entries(cache, site.window, cache.capacity)
                self.entries[i] = [min(e, site.window) for e in self.entries[i]]
                self.longest[i] = list(self.entries[i])
        return outs[0][:, -1].float()

    # ------------------------------------------------------------------ between chunks
    def compress(self) -> None:
        """Compress every compressible layer whose rows hold more than their budget (rows of one budget together:
        the whole layer in its own buffers where every row is over one budget), then read every compressed
        layer's lengths back (one sync) and check the policy's contract."""
        done = []
        for i, cache in enumerate(self.caches):
            if not self.compressible[i]:
                continue
            over = [b for b, (n, keep) in enumerate(zip(self.entries[i], self.budgets[i], strict=True)) if n > keep]
            if not over:
                continue
            groups: dict[int, list[int]] = {}
            for b in over:
                groups.setdefault(self.budgets[i][b], []).append(b)
            if len(groups) == 1 and len(over) == len(self.entries[i]):
                compress_in_place(self.policy, cache, next(iter(groups)))
            else:
                for keep, rows in groups.items():
                    part = take_rows(cache, rows)
                    compress_in_place(self.policy, part, keep)
                    put_rows_at(cache, part, rows)
            done.append(i)
            self.compressions += 1
        if not done:
            return
        longest = torch.stack([self.caches[i].length.amax(-1) for i in done]).tolist()     # [layers, B]: one sync
        for i, lengths in zip(done, longest, strict=True):
            for b, (n, cap) in enumerate(zip(lengths, self.caps[i], strict=True)):
                if n > cap:
                    raise RuntimeError(f"policy {self.policy.name} left {n} entries in a KV head of batch row {b} "
                                       f"for a budget of {self.budgets[i][b]} (at most {cap} in one head)")
            # the runtime's count (``Layer.row_len``): a head may hold up to the head capacity, the row is counted
            # at its budget after a compression (``kvpass.runtime.layers.check_within_budget``); ``longest`` the real most
            self.longest[i] = [int(n) for n in lengths]
            self.entries[i] = [min(int(n), keep) for n, keep in zip(lengths, self.budgets[i], strict=True)]

    def prompt_caches(self) -> PromptCaches:
        """The caches for ``kvpass.runtime.layers.build_layers``, handed over: this state keeps no reference to them (each
        working buffer is freed when its layer's decode buffers replace it, not all at the end)."""
        caches = [ring_of(c, s.window) if ring else c for c, s, ring in zip(self.caches, self.sites, self.ring,
                                                                              strict=True)]
        self.caches = []
        return PromptCaches(caches, self.entries, self.peaks, self.tokens)


def _rows_from(x: Tensor, rows: list[int], donor: int) -> Tensor:
    """``x`` with its batch rows ``rows`` replaced by row ``donor`` (per-row state; other tensors unchanged)."""
    if not rows or x.dim() == 0 or x.shape[0] <= max(rows):
        return x
    out = x.clone()
    out[rows] = x[donor]
    return out


def _check_chunk_memory(model: ChunkingModel, batch: int, chunk: int, tokens: int, total: int, slots: int) -> None:
    """Refuse before the prefill when a chunk's prefill and the working caches (``slots`` per layer) need more
    device memory than is free (CUDA; ``validation.check_memory``)."""
    if model.device.type != "cuda" and model.free_bytes is None:
        return
    kv_width = sum(s.n_kv_heads * s.head_dim for s in model.graphs.sites)
    need = estimate_prefill_bytes(model.config, batch, chunk, total, slots, next(model.model.parameters()).dtype,
                                  kv_width)
    check_memory(need, model.device, batch, tokens, model.free_bytes)


@torch.no_grad()
def start_chunked(model: ChunkingModel, input_ids: Tensor, attention_mask: Tensor | None, max_new_tokens: int,
                  chunk: int, layer_budgets: list[int] | None = None) -> DecodeSession:
    """``KVPassModel.start`` with the prompt prefilled ``chunk`` tokens at a time (module docstring); a prompt of
    at most ``chunk`` tokens is prefilled in one piece. ``layer_budgets``: the compressed layers' budgets to use
    instead of the policy's choice (groups of rows prefilled apart, ``prefill_rows``)."""
    check_prefill_chunk(chunk, model)
    ids, pad, pos = prepare_inputs(model, input_ids, attention_mask, max_new_tokens)
    t = ids.shape[1]
    bounds = chunk_bounds(t, chunk)
    total = t + max_new_tokens
    budget = check_min_budget(model, total)
    if len(bounds) == 1:
        check_prefill_memory(model, ids.shape[0], t, total)
        session = model.start_from(model.prefill(input_ids, attention_mask, max_new_tokens), layer_budgets)
        session.prefill_chunk = chunk
        return session
    interval = getattr(model.policy, "interval", 1)
    slots = (budget + interval + chunk) if model.policy.compresses else total
    _check_chunk_memory(model, ids.shape[0], chunk, t, total, slots)
    started = time.perf_counter()
    state = _ChunkedPrefill(model, pad, total, t, chunk)
    logits = None
    deferred = model.policy.prompt_compression_deferred()
    for n, (a, b) in enumerate(bounds):
        if n == 0:
            logits = state.first(ids[:, a:b], pos[:, a:b], layer_budgets)
        else:
            logits = state.step(ids[:, a:b], pos[:, a:b], a)
        if n < len(bounds) - 1 or not deferred:     # the last one too, in place: no second copy of every layer
            state.compress()
    layers, compressions = build_layers(model, None, {}, pad, total, budget, budget_tokens(model.budget, total),
                                        state.row_layer_budgets, state.prompt_caches())
    session = DecodeSession(model, layers, pos[:, -1:] + 1, logits, budget, int(t - pad.min()),
                            state.compressions + compressions)
    session.prefill_seconds = time.perf_counter() - started
    session.prefill_chunk = chunk
    return session
