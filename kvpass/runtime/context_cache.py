"""Compress once, ask many: a context prefilled and compressed once (``KVPassModel.compress_context``), then asked
any number of questions, each batch of them from copies of that compressed cache, never re-prefilling the context
(``KVPassModel.generate(question_ids, context=cache)``).

    context [1 or B rows] ─prefill + compression (the policy, budget x the context's tokens)─▶ ContextCache
    questions [B, Tq] ─▶ copies of the ContextCache's rows (one per question: rows of 1 are shared by every question)
                      ─the chunk step (kvpass/rewrites/chunk_step.py): the questions' tokens attend over the
                       compressed context and, causally, themselves─▶ their K, V appended ─▶ the answer decoded

**The budget rule.** The context is compressed to its budget once, when it is cached: a fraction budget is taken
of the context's own tokens (an int budget is the entries per layer). The question and the answer are appended
and never compressed: a question's tokens never evict the context they ask about, and the cache of one question
holds the compressed context + the question + the answer (``max_new_tokens``) entries per layer. This is also how
kvpress and KVzip answer after compression (the cache grows by the question). Sliding-window layers stay rings of
their window.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

from kvpass.cache import LayerCache, gather_slots, put_slots, take_rows, with_capacity
from kvpass.runtime.chunked_prefill import ChunkingModel, append_chunk
from kvpass.runtime.layers import Layer
from kvpass.runtime.session import DecodeSession
from kvpass.validation import as_input_ids, left_pads, refuse


@dataclass
class ContextCache:
    """A compressed context (``KVPassModel.compress_context``): its session, prefilled and compressed but never
    stepped (each question batch works on copies of its layers), each row's context tokens, and the policy and
    budget it was compressed with (the model answering from it must be the one that made it)."""

    session: DecodeSession
    tokens: list[int]
    owner_id: int

    @property
    def rows(self) -> int:
        return self.session.batch

    @property
    def cache_bytes(self) -> int:
        """The compressed context's cache tensors on the model's device (every row)."""
        return self.session.report().cache_bytes

    @property
    def prefill_seconds(self) -> float:
        return self.session.prefill_seconds


@torch.no_grad()
def compress_context(model: ChunkingModel, input_ids: Tensor, attention_mask: Tensor | None = None) -> ContextCache:
    """Prefill ``input_ids`` [B, T] (left-padded with ``attention_mask``) and compress every layer to its budget for
    the context's own tokens (the module's budget rule), once. ``model.prefill_chunk`` applies."""
    ids = as_input_ids(input_ids, model.device, model.vocab_size)
    mask, pad = left_pads(attention_mask, ids)
    session = model.start(ids, mask, max_new_tokens=0)
    return ContextCache(session, [int(ids.shape[1] - p) for p in pad.tolist()], id(model))


def _row_index(context: ContextCache, batch: int) -> list[int]:
    """Which context row each question row copies: row 0 for every question of a 1-row context, else row b."""
    if context.rows == 1:
        return [0] * batch
    if context.rows != batch:
        raise refuse("context.rows", got=batch, rows=context.rows)
    return list(range(batch))


def _question_layer(model: ChunkingModel, layer: int, lay: Layer, rows: list[int], extra: int) -> Layer:
    """A copy of a context layer for the question rows ``rows``, with ``extra`` free slots past its live entries
    (a ring keeps its window), never compressed."""
    if lay.full is not None:
        raise refuse("context.full_heads")
    cache = take_rows(lay.cache, rows)
    if lay.window is None:
        cache = with_capacity(cache, lay.host_len + extra)
        if layer in model.graphs.nearest_layers:      # the decode graph's state sized by the buffers (D2O's search)
            cache.state.update(model.policy.decode_state(cache))
    return Layer(cache, lay.window, False, lay.budget, lay.host_len, lay.sliding, None, peak=lay.host_len)


def _append(cache: LayerCache, k: Tensor, v: Tensor, pad: Tensor, pos: Tensor, window: int | None) -> None:
    """The question's real tokens (K, V [B, Hkv, T, D], ``pad`` [B] left pads, positions ``pos`` [B, T]) after the
    cache's live entries, in place (``append_chunk``); a ring of ``window`` slots takes token p in slot p % window
    (its last ``window`` tokens). New slots' policy statistics are 0 (they score as generated tokens do)."""
    meta = {n: torch.zeros(*k.shape[:3], *m.shape[3:], dtype=m.dtype, device=m.device)
            for n, m in cache.slot_meta.items()}
    if window is None:
        append_chunk(cache, k, v, pad, pos, meta)
        return
    b, h, t = k.shape[:3]
    ar = torch.arange(t, device=k.device)
    n = t - pad                                                                  # [B] real tokens
    src = (ar[None, :] + pad[:, None]).clamp(max=t - 1)                          # left-aligned real tokens
    writes = (ar[None, :] < n[:, None]) & (ar[None, :] >= (n - window)[:, None])  # the last `window` of them
    p = torch.gather(pos, 1, src)                                                # [B, T] their positions
    slot = torch.where(writes, p % window, window)[:, None, :].expand(b, h, t)   # the rest into a spare slot
    take = src[:, None, :].expand(b, h, t)
    values = {"k": gather_slots(k, take), "v": gather_slots(v, take),
              "log_weight": torch.zeros(b, h, t, device=k.device),
              "position": p[:, None, :].expand(b, h, t).contiguous(), **meta}
    targets = {"k": cache.k, "v": cache.v, "log_weight": cache.log_weight, "position": cache.position,
               **cache.slot_meta}
    for name, x in targets.items():
        spare = torch.cat([x, x[:, :, :1]], dim=2)
        put_slots(spare, slot, values[name].to(x.dtype))
        x.copy_(spare[:, :, :window])
    cache.length.copy_((cache.length + writes.sum(-1, keepdim=True)).clamp(max=window))


@torch.no_grad()
def ask(model: ChunkingModel, context: ContextCache, question_ids: Tensor, attention_mask: Tensor | None,
        max_new_tokens: int) -> DecodeSession:
    """The session that answers ``question_ids`` [B, Tq] (left-padded with ``attention_mask``) from copies of
    ``context``'s compressed cache: the questions prefilled over it in one chunk step and appended (module
    docstring), ready to ``sample`` ``max_new_tokens``. ``context`` is left unchanged."""
    from kvpass.runtime.chunked_prefill import chunk_step_graph

    if not isinstance(context, ContextCache):
        raise refuse("context.type", got=type(context).__name__)
    if context.owner_id != id(model):
        raise refuse("context.model")
    ids = as_input_ids(question_ids, model.device, model.vocab_size)
    mask, pad = left_pads(attention_mask, ids)
    b, t = ids.shape
    rows = _row_index(context, b)
    longest = max(context.tokens[r] for r in rows) + t - int(pad.min()) + max_new_tokens
    if longest > model.captured.context_length:
        raise refuse("max_new_tokens.context", prompt=longest - max_new_tokens, got=max_new_tokens,
                     context=model.captured.context_length)
    began = time.perf_counter()
    layers = [_question_layer(model, site.layer, lay, rows, t + max_new_tokens)
              for site, lay in zip(model.graphs.sites, context.session.layers, strict=True)]
    first = context.session.pos[rows]                                         # [B, 1]: the next position per row
    pos = first + (torch.arange(t, device=ids.device)[None, :] - pad[:, None]).clamp(min=0)
    gm, _ = chunk_step_graph(model)
    flat = [x for lay in layers for x in (lay.cache.k, lay.cache.v, lay.cache.log_weight, lay.cache.position)]
    outs = gm(ids, pos, pad, *flat)
    for site, lay in zip(model.graphs.sites, layers, strict=True):
        _append(lay.cache, outs[1 + 2 * site.layer], outs[2 + 2 * site.layer], pad, pos, lay.window)
        lay.host_len = min(lay.host_len + t, lay.window) if lay.window is not None else lay.host_len + t
        lay.peak = max(lay.peak, lay.host_len)
    session = DecodeSession(model, layers, pos[:, -1:] + 1, outs[0][:, -1].float(), context.session.budget,
                            max(context.tokens[r] for r in rows) + t - int(pad.min()), 0)
    session.prefill_seconds = time.perf_counter() - began
    return session
