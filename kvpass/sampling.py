"""Choosing the next token from logits, with transformers' semantics for the usual knobs.

Processors (``logits_processors``: repetition penalty, no-repeat n-grams, minimum lengths, then the caller's own)
see the whole sequence so far, ``input_ids`` [B, t] (prompt with its left padding, then the tokens generated);
warpers (``warp``: temperature, top-k, top-p) apply when sampling only, as in transformers' ``generate``; the
processed scores are what ``output_scores`` returns. Each is a plain function of (input_ids, scores [B, V]) ->
new scores, written here and tested against transformers' own classes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

Processor = Callable[[Tensor, Tensor], Tensor]


def repetition_penalty(penalty: float, pads: Tensor | None = None) -> Processor:
    """Every token already in ``input_ids``: its score divided by ``penalty`` where positive, multiplied where
    negative (CTRL's penalty; transformers' RepetitionPenaltyLogitsProcessor). ``pads`` [B]: each row's left
    padding, whose ids do not count (transformers passes the attention mask's)."""

    def apply(input_ids: Tensor, scores: Tensor) -> Tensor:
        b, v = scores.shape
        ids = input_ids
        if pads is not None:                          # padding -> a column past the vocabulary, dropped below
            ids = ids.masked_fill(torch.arange(ids.shape[1], device=ids.device)[None] < pads[:, None], v)
        seen = torch.zeros(b, v + 1, dtype=torch.bool, device=scores.device).scatter_(1, ids, True)[:, :v]
        return torch.where(seen, torch.where(scores < 0, scores * penalty, scores / penalty), scores)

    return apply


def no_repeat_ngram(n: int) -> Processor:
    """Ban (score -inf) every token that would complete an ``n``-gram already in the row (transformers'
    NoRepeatNGramLogitsProcessor); host-side, a row at a time."""

    def apply(input_ids: Tensor, scores: Tensor) -> Tensor:
        t = input_ids.shape[1]
        if t < n:                                   # no complete n-gram yet
            return scores
        out = scores.clone()
        for row, ids in enumerate(input_ids.tolist()):
            tail = tuple(ids[t - n + 1:]) if n > 1 else ()
            banned = {ids[i + n - 1] for i in range(t - n + 1) if tuple(ids[i:i + n - 1]) == tail}
            if banned:
                out[row, list(banned)] = -math.inf
        return out

    return apply


def no_eos_before(length: int, eos_ids: Sequence[int], skip: int = 0) -> Processor:
    """No end of sequence (eos scores -inf) while the row holds fewer than ``length`` tokens after the first
    ``skip`` (``min_length``: skip 0, counting the prompt; ``min_new_tokens``: skip = the prompt's length)."""

    def apply(input_ids: Tensor, scores: Tensor) -> Tensor:
        if input_ids.shape[1] - skip >= length:
            return scores
        out = scores.clone()
        out[:, list(eos_ids)] = -math.inf
        return out

    return apply


def logits_processors(repetition: float = 1.0, ngram: int = 0, min_length: int = 0, min_new_tokens: int = 0,
                      prompt_length: int = 0, eos_ids: Sequence[int] = (), extra: Sequence[Processor] = (),
                      pads: Tensor | None = None) -> list[Processor]:
    """The processors transformers' ``generate`` builds for these settings, in its order, then ``extra`` (the
    caller's ``logits_processor``). The minimum lengths apply only where there is an eos id; ``pads`` [B]: the
    prompt's left padding (the repetition penalty skips it)."""
    out: list[Processor] = []
    if repetition != 1.0:
        out.append(repetition_penalty(repetition, pads))
    if ngram > 0:
        out.append(no_repeat_ngram(ngram))
    if eos_ids and min_length > 0:
        out.append(no_eos_before(min_length, eos_ids))
    if eos_ids and min_new_tokens > 0:
        out.append(no_eos_before(min_new_tokens, eos_ids, skip=prompt_length))
    return out + list(extra)


def warp(scores: Tensor, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None) -> Tensor:
    """Sampling's warpers in transformers' order: temperature (if != 1), then top-k (if > 0), then top-p
    (nucleus, if < 1; the most likely token always stays). scores: [B, V] fp32 -> the same."""
    if temperature != 1.0:
        scores = scores / max(temperature, 1e-5)
    if top_k is not None and 0 < top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False, dim=-1)
        cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cum <= (1 - top_p)
        drop_sorted[:, -1] = False                                   # always keep the most likely token
        scores = scores.masked_fill(drop_sorted.scatter(1, order, drop_sorted), float("-inf"))
    return scores


def choose(scores: Tensor, do_sample: bool, generator: torch.Generator | None = None) -> Tensor:
    """scores [B, V] (processed, warped) -> token ids [B]: the argmax, or a draw from their softmax."""
    if not do_sample:
        return scores.argmax(dim=-1)
    return torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=generator).squeeze(-1)


def next_token(logits: Tensor, do_sample: bool, temperature: float = 1.0, top_k: int | None = None,
               top_p: float | None = None, generator: torch.Generator | None = None) -> Tensor:
    """logits: [B, V] -> token ids [B]. Greedy unless ``do_sample``; sampling applies temperature,
    then top-k, then top-p (nucleus), as transformers' warpers do."""
    if not do_sample:
        return logits.argmax(dim=-1)
    return choose(warp(logits.float(), temperature, top_k, top_p), True, generator)
