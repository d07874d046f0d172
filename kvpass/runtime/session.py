"""The decode session: the caches of one batch after prefill, stepped a token at a time (each step's due
compressions, the decode graph, replayed from a CUDA graph on CUDA), sampled from, and reported on
(``GenerationReport``); ``stack_sessions`` joins the sessions of groups of rows prefilled apart."""

from __future__ import annotations

import functools
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from kvpass.cache import (
    LayerCache,
    empty_rows,
    load_into,
    put_rows,
    put_rows_at,
    take_rows,
    with_capacity,
)
from kvpass.decode_step import fork_side_by_side, join_pending
from kvpass.policies.capabilities import (
    compress_layers_into,
    gathers_across_heads,
    nearest_candidates,
    rows_in_one_call,
)
from kvpass.quantization.cache import entry_dtype
from kvpass.quantization.policy import kv_dtype_of
from kvpass.rewrites.attention_sites import AttentionSite
from kvpass.rewrites.insert_compressed_cache import DECODE_STATS
from kvpass.runtime.layers import (
    Layer,
    RuntimeModel,
    check_within_budget,
    compress_rows_into,
    recorded_params,
)
from kvpass.runtime.recent_queries import add_recent_rows, has_recent_queries, recent_capacity
from kvpass.sampling import next_token


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
    # the decode step ran Inductor's compiled graph (``kvpass.apply(compile=...)``); the compilations this call
    # triggered and their seconds (part of ``decode_seconds``: a model compiles once or twice, then never again)
    compiled: bool = False
    compilations: int = 0
    compile_seconds: float = 0.0
    # the decode step's CUDA-graph captures this call made and their seconds (part of ``decode_seconds``; 0 off
    # CUDA), and whether it ran in the buffers the last ``generate`` kept (kvpass/runtime/decode_buffers.py),
    # replaying that call's graphs instead of capturing
    graph_captures: int = 0
    capture_seconds: float = 0.0
    reused_buffers: bool = False
    # the format the cache's entries were stored in (``kvpass.apply(..., kv_dtype=...)``: "int8", "fp8_e4m3"), or None
    # (the model's dtype); ``cache_bytes`` counts the codes and their scales
    kv_dtype: str | None = None

    @property
    def tokens_per_second(self) -> float:
        return self.batch * self.new_tokens / max(self.prefill_seconds + self.decode_seconds, 1e-9)

    @property
    def compression_ratio(self) -> float:
        return self.cache_bytes / max(self.full_cache_bytes, 1)


def stack_sessions(groups: Iterable[DecodeSession], batch: int) -> DecodeSession:
    """Sessions of groups of rows prefilled one after the other (``prefill_rows``), as one batch of ``batch``
    rows: the first group's caches give the layout of batch-sized buffers (``empty_rows``), and every group's
    rows are copied in (``put_rows``) before the next group is prefilled, so at most one group's session is
    alive beside the batch's caches."""
    out: DecodeSession | None = None
    pos, logits = [], []
    start = 0
    for session in groups:
        if out is None:
            layers = [Layer(empty_rows(lay.cache, batch), lay.window, lay.compressible, lay.budget, 0, lay.sliding,
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

    def __init__(self, owner: RuntimeModel, layers: list[Layer], pos: Tensor, logits: Tensor, budget: int,
                 prompt_tokens: int, compressions: int) -> None:
        self.owner, self.policy, self.layers = owner, owner.policy, layers
        self.pos, self.logits, self.budget = pos, logits, budget
        self.prompt_tokens, self.compressions = prompt_tokens, compressions
        self.steps = 0
        self.prefill_seconds = self.decode_seconds = 0.0
        self.prefill_chunk: int | None = None         # set by a chunked prefill (kvpass/runtime/chunked_prefill.py)
        compiled = getattr(owner, "compiled_decode", None)
        self._compiled_before = len(getattr(compiled, "compilations", ()))
        self._captures_before = (owner.decode_step.captures, owner.decode_step.capture_seconds)
        self.reused_buffers = False               # set by generate (KVPassModel.decode_buffers.adopt)

    @property
    def batch(self) -> int:
        return self.logits.shape[0]

    @torch.no_grad()
    def step(self, tokens: Tensor) -> Tensor:
        """tokens: [B] int64 -> logits [B, V] for the position after them."""
        start = time.perf_counter()
        self._deferred_prompt_compression()
        whole: list[int] = []
        due_rows: dict[int, set[int]] = {}
        for i, (site, lay) in enumerate(zip(self.owner.graphs.sites, self.layers, strict=True)):
            rows = lay.due_rows() if lay.compressible and not self._prompt_buffers(lay) else []
            self._add_waiting_rows(site, lay, compressing=bool(rows))
            if not rows:
                continue
            if lay.whole(rows) or self._rows_in_one_call(lay):    # the whole layer in its own buffers
                whole.append(i)
                due_rows[i] = set(rows)
            else:                                 # some rows, or rows of their own budgets: each as if alone
                compress_rows_into(self.owner, lay, rows)
                self.compressions += 1
        due = tuple(whole)
        if due and not self.owner.decode_step.graphed(self.logits.device, due):
            if self._gathers_over_ranks():
                self.compress_layers(due)         # tensor parallel: one call (D2O gathers once for all)
            else:
                for i in due:
                    self._compress_layer(self.layers[i])
            for i in due:                         # eager: compress, check the budget (a sync), then the step
                lay = self.layers[i]
                lay.set_row_len(self.owner.heads.max(lay.cache.length.amax(-1)).tolist())
                check_within_budget(self.owner, lay)
            due_in_step: tuple[int, ...] = ()
        else:
            due_in_step = due                     # graphed: compression is part of the replayed step
        self.logits = self._device_step(tokens, due_in_step)
        for i in due:
            # the policy contract: a compressed row holds at most `budget` entries (checked when eager); a row
            # that was not due is left as it is (``RaggedRows.rows_in_one_call``: it may hold more, below its capacity)
            lay = self.layers[i]
            lay.set_row_len([min(n, b) if r in due_rows[i] else n
                             for r, (n, b) in enumerate(zip(lay.row_len, lay.row_budgets, strict=True))])
            self.compressions += 1
        for lay in self.layers:
            self._advance_host(lay)
            if has_recent_queries(lay.cache):
                lay.queries_waiting += 1
        self.pos = self.pos + 1
        self.steps += 1
        if self.policy.maintenance_due(self.steps):
            for site, lay in zip(self.owner.graphs.sites, self.layers, strict=True):
                if not lay.sliding:
                    load_into(lay.cache, self.policy.maintain(lay.cache, site.layer))
        self.decode_seconds += time.perf_counter() - start
        return self.logits

    @staticmethod
    def _add_waiting_rows(site: AttentionSite, lay: Layer, compressing: bool) -> None:
        """Deferred scores (kvpass/runtime/recent_queries.py): the rows of the layer's waiting queries go into its
        ``col_sum`` before it is compressed (``compressing``), and when its ring is full. Eager, before the step
        (replayed or not) on the same stream: no host sync."""
        if not (lay.queries_waiting and has_recent_queries(lay.cache)):
            return
        if compressing or lay.queries_waiting >= recent_capacity(lay.cache):
            add_recent_rows(lay.cache, site)
            lay.queries_waiting = 0

    def _rows_in_one_call(self, lay: Layer) -> bool:
        """Whether the layer's rows, of budgets of their own, are compressed by one call of the policy
        (``RaggedRows.rows_in_one_call``: every due row as alone, the others unchanged) rather than one budget at
        a time in copies (``kvpass.runtime.layers.compress_rows_into``). Makes the per-row budget tensor now, before
        a CUDA-graphed step could capture it."""
        if any(lay.row_extra) or not rows_in_one_call(self.policy, lay.row_budgets, lay.row_caps):
            return False
        if self._per_row_due(lay):
            lay.keep_rows()
        return True

    def _per_row_due(self, lay: Layer) -> bool:
        """Whether a one-call compression of the layer must leave the rows that are not due as they are: rows of
        budgets or capacities of their own, or (``interval`` > 1) rows that may fill their buffers at steps of
        their own, which ``compress_into`` (every row over the budget) would compress early. Static per layer:
        the CUDA-graphed step takes the same call whichever rows are due."""
        return not lay.one_budget or getattr(self.policy, "interval", 1) > 1

    def _gathers_over_ranks(self) -> bool:
        """Tensor parallel with a policy whose compression gathers across heads: its layers compress in one call,
        one after another, every rank's collectives in one order (``GathersAcrossHeads``)."""
        return self.owner.heads.world > 1 and gathers_across_heads(self.policy)

    def _compress_layer(self, lay: Layer) -> None:
        """The whole layer in its own buffers (``_compress_job``: ``compress_rows_into`` at each row's own budget,
        only the due rows evicting, or ``compress_into`` at the layer's budget). No host sync. Under tensor
        parallelism, a policy that says its compression gathers nothing across heads (whose layers
        ``compress_layers`` runs side by side) is held to it: a collective asked for is refused here, at its first
        compression, where side by side it could meet the other ranks' collectives out of order."""
        asked = self.owner.heads.collectives
        compress_layers_into(self.policy, [self._compress_job(lay)])
        if self.owner.heads.collectives != asked and not gathers_across_heads(self.policy):
            raise RuntimeError(f"{self.policy.name}: its compression asked the other ranks for heads' statistics, but "
                               "it does not declare GathersAcrossHeads with gathers_across_heads() True "
                               "(kvpass/policies/capabilities.py)")

    def _compress_job(self, lay: Layer) -> tuple[LayerCache, int | Tensor]:
        """(cache, keep) of ``compress_layers_into`` for the whole layer: the rows' own budgets ([B] int64)
        where ``_per_row_due`` and ``_rows_in_one_call``, else the layer's budget."""
        if self._per_row_due(lay) and self._rows_in_one_call(lay):
            return lay.cache, lay.keep_rows()
        return lay.cache, lay.budget

    def _prompt_buffers(self, lay: Layer) -> bool:
        """A layer whose prompt compression ``Policy.prompt_compression_deferred`` put off: its buffers are still
        the prefill's, the whole prompt and the first decode step, not the rows' largest budget + interval (wider,
        or narrower where budget + interval exceeds prompt + 1)."""
        return bool(lay.row_caps) and lay.cache.capacity != max(lay.row_caps)

    def _deferred_prompt_compression(self) -> None:
        """``Policy.prompt_compression_deferred``: a layer still holding its whole prompt and full after the
        first decode step is compressed now, eagerly, each row to its own budget (rows of one budget
        together), into buffers of the rows' largest budget + interval (new addresses: a CUDA-graphed
        step re-captures)."""
        if not self.policy.prompt_compression_deferred():
            return
        for site, lay in zip(self.owner.graphs.sites, self.layers, strict=True):
            if not (lay.compressible and self._prompt_buffers(lay) and lay.host_len >= lay.cache.capacity):
                continue
            self._add_waiting_rows(site, lay, compressing=True)
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
            if nearest_candidates(self.policy) and site.layer in self.owner.graphs.nearest_layers:
                lay.cache.state.update(self.policy.decode_state(lay.cache))    # made anew for the new buffers
            lay.set_row_len(self.owner.heads.max(lay.cache.length.amax(-1)).tolist())
            check_within_budget(self.owner, lay)
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

    def _device_step(self, tokens: Tensor, compress: tuple[int, ...] = ()) -> Tensor:
        """The device work of one step: compression of the layers ``compress`` names, slots, the decode
        graph (writes K, V, attends), score accumulation, lengths and positions. tokens: [B] -> logits
        [B, V] fp32. On CUDA it is replayed from a CUDA graph (decode_step.py), one per set of
        compressed layers: it reads and writes only the layers' cache tensors."""
        layers, graphs = self.layers, self.owner.graphs
        decode = getattr(self.owner, "compiled_decode", None) or graphs.decode     # Inductor's (kvpass.compiled_decode) or eager

        def step(tokens: Tensor, pos: Tensor) -> tuple[Tensor]:
            # a layer's slot is its length tensor itself: write_kv reads it after the layer's compression (awaited
            # just before it) and before ``_advance`` adds 1; a copy would be a memcpy node a layer in the graph
            slots = [self._slot(lay, pos) for lay in layers]
            self.compress_layers(compress, join=False)
            flat = [x for inputs, lay, slot in zip(graphs.decode_layout.layers, layers, slots, strict=True)
                    for x in inputs.tensors(lay.cache, lay.full, slot)]
            outs = decode(tokens[:, None], pos, *flat)
            join_pending()
            if graphs.decode_scores:              # one multi-tensor launch per statistic, for every layer
                for stat in sorted(self.policy.stats & DECODE_STATS, key=lambda s: s.value):
                    metas = [layers[i].cache.slot_meta[stat.value] for i in graphs.decode_scores]
                    (torch._foreach_add_ if stat.accumulates else torch._foreach_copy_)(metas, list(outs[1:]))
            self._advance(layers)
            return (outs[0][:, -1].float(),)

        persistent = [t for lay in layers for c in lay.caches() for t in c.tensors()]
        persistent += [lay.keep_rows() for lay in layers if lay.row_budgets]    # what compress_rows_into reads
        if compress:                              # compression moves entries: everything is restored
            restore = persistent
        else:                                     # what a plain step advances (K, V: rewritten alike)
            big = {id(t) for lay in layers for c in lay.caches() for t in (c.k, c.v)}
            restore = [t for t in persistent if id(t) not in big]
        return self.owner.decode_step(step, [tokens, self.pos], persistent, restore, variant=compress,
                                      params=recorded_params(layers))[0]

    def compress_layers(self, indices: Sequence[int], join: bool = True) -> None:
        """Compress the layers ``indices`` in their own buffers (the policy's ``compress_into``, no host
        sync; the length tensor stays the same tensor, so it is the decode step's slot). On CUDA the layers run
        side by side on the decode step's side streams: joined before returning (``run_side_by_side``), or
        with ``join=False`` left for the decode graph to await layer by layer (``fork_side_by_side``; the
        step joins what is left after the graph). Under tensor parallelism too, unless the policy's compression
        gathers across heads (``Policy.gathers_across_heads``): then one layer after another, every rank's
        collectives in one order."""
        if self._gathers_over_ranks():
            # tensor parallel: the policy's collectives in one order, in one call (it may gather once for all)
            compress_layers_into(self.policy, [self._compress_job(self.layers[i]) for i in indices])
            return
        calls = [functools.partial(self._compress_layer, self.layers[i]) for i in indices]
        if calls and self.logits.is_cuda and not join:
            streams = self.owner.decode_step.fork_streams(self.logits.device, self.logits.shape[0],
                                                          getattr(self.policy, "interval", 1))
            fork_side_by_side([(self.layers[i].cache.k, c) for i, c in zip(indices, calls, strict=True)], streams)
        else:
            self.owner.decode_step.run_all(calls, self.logits.device)

    @staticmethod
    def _slot(lay: Layer, pos: Tensor) -> Tensor:
        """Where this step's K, V go: [B, Hkv] int64. A ring's slot is position % window; any other layer's is its
        length, the tensor itself (read by write_kv before ``_advance`` grows it)."""
        if lay.window is not None:
            return (pos % lay.window).expand_as(lay.cache.length)
        return lay.cache.length

    @staticmethod
    def _advance(layers: Sequence[Layer]) -> None:
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
    def _advance_host(lay: Layer) -> None:
        """The host copy of the step's length change (no device sync)."""
        lay.host_len = min(lay.host_len + 1, lay.window) if lay.window is not None else lay.host_len + 1
        lay.row_len = [n + 1 for n in lay.row_len]
        lay.peak = max(lay.peak, lay.host_len)

    def _compile_report(self) -> dict:
        """The report's ``compiled``, ``compilations`` and ``compile_seconds``: this session's share."""
        compiled = getattr(self.owner, "compiled_decode", None)
        if not hasattr(compiled, "compilations"):      # eager, or a plain callable put there (tests)
            return {}
        new = compiled.compilations[self._compiled_before:]
        return dict(compiled=compiled.failure is None, compilations=len(new),
                    compile_seconds=sum(c.seconds for c in new))

    def report(self) -> GenerationReport:
        """Cache bytes and timings now; ``new_tokens`` counts the positions after the prompt (steps + 1)."""
        b, layers, new_tokens = self.batch, self.layers, self.steps + 1
        full = sum(2 * b * s.model_kv_heads * s.head_dim * (self.prompt_tokens + new_tokens) * entry_dtype(lay.cache).itemsize
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
            **self._compile_report(), reused_buffers=self.reused_buffers,
            graph_captures=self.owner.decode_step.captures - self._captures_before[0],
            capture_seconds=self.owner.decode_step.capture_seconds - self._captures_before[1],
            kv_dtype=kv_dtype_of(self.policy),
            row_layer_budgets=[{i: lay.row_budgets[r] for i, lay in enumerate(layers) if lay.compressible}
                               for r in range(b)])
