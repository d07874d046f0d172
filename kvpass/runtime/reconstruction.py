"""KVzip's context reconstruction (docs/policies.md §6.13): after the prefill, the model is asked to repeat the
prompt, chunk by chunk, over the prompt's whole cache, and every cached entry is scored by the most attention it
receives while it does (``Stat.RECONSTRUCTION``). The score asks which entries the model needs to reproduce the
context, so it does not depend on a question: the query-agnostic score.

    prompt (T tokens) ─prefill─▶ K, V of every layer (uncompressed)
    for each chunk [a, a + chunk) of every row's real tokens:
        repeat input = instruction (+ the previous chunk's last ``tail`` tokens) + chat suffix + the chunk's tokens
        ─the reconstruction step (kvpass/rewrites/chunk_step.py, ``RECONSTRUCTION_STAT_OPS``)─▶ per layer
        [B, Hkv, T] the most attention each entry got from the repeat's queries (``kvpass::chunk_attention_max``);
        the repeat's own K, V are dropped
    score = the max over the chunks, laid out as the prefill's statistics ([B, Hkv, T], padded columns)

The repeat's positions follow the row's prompt (positions n, n + 1, ... for a row of n real tokens), as they would
if the model wrote the repetition after it. Each chunk's queries attend over the prompt's cache and, causally, the
repeat itself; normalised over all of that (the chunk's true attention). Cost: about one more prefill of the prompt
(the linear layers of T repeat tokens, and T x T attention in all) plus a second q . k pass for the maxima.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from kvpass.cache import EMPTY, LayerCache, entries_from_prompt, keep_slots
from kvpass.policies.base import Stat
from kvpass.runtime.chunked_prefill import ChunkingModel

FIRST = "\n\nRepeat the previous context exactly."
LATER = "\n\nRepeat the part of the previous context exactly, starting with"
_MARK = "\u2063KVPASS-CONTEXT\u2063"


@dataclass(frozen=True)
class ReconstructionPrompt:
    """Token ids of the repeat request: ``first`` (before the first chunk), ``later`` (before a later chunk, followed
    by the previous chunk's last tokens), ``suffix`` (what the chat template puts between a user's message and the
    assistant's answer; empty without a template)."""

    first: tuple[int, ...]
    later: tuple[int, ...]
    suffix: tuple[int, ...]

    @classmethod
    def bare(cls) -> ReconstructionPrompt:
        """No request: the repetition is the context's tokens alone (a model given no tokenizer)."""
        return cls((), (), ())

    @classmethod
    def from_tokenizer(cls, tokenizer) -> ReconstructionPrompt:
        encode = lambda text: tuple(tokenizer(text, add_special_tokens=False)["input_ids"])   # noqa: E731
        suffix: tuple[int, ...] = ()
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template([{"role": "user", "content": _MARK}], add_generation_prompt=True,
                                                 tokenize=False)
            suffix = encode(text.split(_MARK, 1)[1])
        else:
            suffix = encode("\n")
        return cls(encode(FIRST), encode(LATER), suffix)


def _repeat_inputs(rows: list[list[int]], a: int, chunk: int, tail: int, prompt: ReconstructionPrompt,
                   device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """The repeat of every row's tokens [a, a + chunk), left-padded to one length: (ids [B, L], positions [B, L],
    pads [B]). Row b's positions start after its own prompt."""
    seqs, starts = [], []
    for ids in rows:
        part = ids[a:a + chunk]
        head = list(prompt.first) if a == 0 else list(prompt.later) + ids[max(0, a - tail):a]
        seqs.append(head + list(prompt.suffix) + part if part else [])
        starts.append(len(ids))
    width = max(1, max(len(s) for s in seqs))
    pad = torch.tensor([width - len(s) for s in seqs], dtype=torch.long, device=device)
    ids = torch.tensor([[0] * (width - len(s)) + s for s in seqs], dtype=torch.long, device=device)
    ar = torch.arange(width, device=device)
    start = torch.tensor(starts, dtype=torch.long, device=device)
    pos = start[:, None] + (ar[None, :] - pad[:, None]).clamp(min=0)
    return ids, pos, pad


def reconstruction_step(model: ChunkingModel):
    """(the reconstruction step GraphModule, its statistics' (layer, Stat) keys), built on first use."""
    if getattr(model, "_reconstruction_step", None) is None:
        from kvpass.rewrites.chunk_step import RECONSTRUCTION_STAT_OPS
        from kvpass.rewrites.pipeline import compile_chunk_step

        model._reconstruction_step = compile_chunk_step(model.captured, _ReconstructionStats(), model.graphs.sites,
                                                        model.fused_linears, RECONSTRUCTION_STAT_OPS)
    return model._reconstruction_step


@dataclass(frozen=True)
class _ReconstructionStats:
    """What the chunk-step builder reads of a policy: the one statistic, no options."""

    name = "reconstruction"
    compresses = True
    stats = frozenset({Stat.RECONSTRUCTION})

    def stat_options(self, stat: Stat) -> dict[str, object]:
        return {}


def _span_caches(caches: list[LayerCache], a: int, chunk: int, tail: int, sinks: int
                 ) -> tuple[list[LayerCache], Tensor]:
    """Each layer's cache cut to the first ``sinks`` slots and the chunk's own span [a - tail, a + chunk) of every
    row (``scope="span"``), and the slots they hold [B, Hkv, S] (-1 where a row has none: empty)."""
    first = caches[0]
    n = first.length[:, :1]                                                       # [B, 1] each row's entries
    lo = torch.arange(sinks, device=n.device)[None, :].expand(n.shape[0], -1)
    span = torch.arange(max(0, a - tail), a + chunk, device=n.device)[None, :]
    span = torch.where(span >= sinks, span, -1).expand(n.shape[0], -1)             # sinks are not counted twice
    slot = torch.cat([lo, span], dim=1)
    slot = torch.where(slot < n, slot, -1)[:, None, :].expand(*first.length.shape, slot.shape[1])
    out = []
    for cache in caches:
        part = keep_slots(cache, slot.clamp(min=0))
        part.log_weight = torch.where(slot >= 0, part.log_weight, EMPTY)
        part.position = torch.where(slot >= 0, part.position, -1)
        out.append(part)
    return out, slot


@torch.no_grad()
def reconstruction_scores(model: ChunkingModel, ids: Tensor, pad: Tensor, kv: list[Tensor],
                          prompt: ReconstructionPrompt, chunk: int = 2048, tail: int = 8, scope: str = "span",
                          sinks: int = 4) -> dict[int, Tensor]:
    """{layer: [B, Hkv, T] fp32} for every full-attention layer: each prompt entry's most attention over the repeat
    of its row (module docstring), in the prefill's layout (padded columns; pad columns 0). ids: [B, T] with ``pad``
    [B] left pads; kv: the prefill's [k_0, v_0, ...], each [B, Hkv, T, D]. ``scope``: what a chunk's repeat attends
    over besides itself: the whole prompt ("full"), or its first ``sinks`` entries and the chunk's own span of the
    prompt ("span": a chunk's cost no longer grows with the prompt)."""
    gm, keys = reconstruction_step(model)
    sites = list(model.graphs.sites)
    t = ids.shape[1]
    caches: list[LayerCache] = [entries_from_prompt(kv[2 * s.layer], kv[2 * s.layer + 1], pad, {}) for s in sites]
    rows = [ids[b, int(p):].tolist() for b, p in enumerate(pad.tolist())]
    top = {s.layer: caches[0].log_weight.new_zeros(caches[i].log_weight.shape) for i, s in enumerate(sites)}
    for a in range(0, max(len(r) for r in rows), chunk):
        rep, pos, rep_pad = _repeat_inputs(rows, a, chunk, tail, prompt, ids.device)
        if scope == "span":
            seen, slot = _span_caches(caches, a, chunk, tail, sinks)
        else:
            seen, slot = caches, None
        flat = [x for c in seen for x in (c.k, c.v, c.log_weight, c.position)]
        outs = gm(rep, pos, rep_pad, *flat)
        for (layer, _), score in zip(keys, outs[1 + 2 * len(sites):], strict=True):
            if slot is None:
                top[layer] = torch.maximum(top[layer], score)
            else:                                   # back to the slots the span came from (empty ones to a spare)
                spare = torch.cat([top[layer], top[layer][..., :1]], dim=-1)
                at = torch.where(slot >= 0, slot, spare.shape[-1] - 1)
                spare.scatter_reduce_(-1, at, score, reduce="amax")
                top[layer] = spare[..., :-1]
    # compacted slots -> the prefill's padded columns: row b's slot s is column pad[b] + s
    col = (torch.arange(t, device=ids.device)[None, :] - pad[:, None])                    # [B, T]
    src = col.clamp(min=0)[:, None, :]
    return {layer: torch.where(col[:, None, :] >= 0, score.gather(-1, src.expand_as(score)), 0.0)
            for layer, score in top.items() if layer in {k[0] for k in keys}}


def add_after_prefill_stats(model: ChunkingModel, asker, ids: Tensor, pad: Tensor, kv: list[Tensor],
                            stats: dict[int, dict[str, Tensor]]) -> None:
    """Add to ``stats`` (the prefill's {layer: {name: [B, Hkv, T]}}) the statistics ``asker`` (a policy, or the
    statistics union of a shared prefill) wants that the prefill graph does not compute (``Stat.after_prefill``)."""
    if not getattr(asker, "compresses", True) or Stat.RECONSTRUCTION not in asker.stats:
        return
    opts = asker.stat_options(Stat.RECONSTRUCTION)
    if opts.get("method") == "predicted":                     # no pass: the surrogate of the scores
        surrogate = _surrogate(str(opts["surrogate"]))
        for site in model.graphs.sites:
            if site.window is None:
                k, v = kv[2 * site.layer], kv[2 * site.layer + 1]
                live = (torch.arange(k.shape[2], device=k.device)[None, :] >= pad[:, None])[:, None, :]
                score = surrogate.predict(site.layer, k, v) * live
                stats.setdefault(site.layer, {})[Stat.RECONSTRUCTION.value] = score
        return
    prompt = model.reconstruction_prompt or ReconstructionPrompt.bare()
    scores = reconstruction_scores(model, ids, pad, kv, prompt, chunk=int(opts.get("chunk", 2048)),
                                   scope=str(opts.get("scope", "span")), sinks=int(opts.get("sinks", 4)))
    for layer, score in scores.items():
        stats.setdefault(layer, {})[Stat.RECONSTRUCTION.value] = score


@functools.lru_cache(maxsize=8)
def _surrogate(name_or_path: str):
    from kvpass.policies.kvzip_surrogate import KVzipSurrogate

    return KVzipSurrogate.load(name_or_path)
