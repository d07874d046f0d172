"""Choosing the next token from logits, with transformers' semantics for the usual knobs."""

from __future__ import annotations

import torch
from torch import Tensor


def next_token(logits: Tensor, do_sample: bool, temperature: float = 1.0, top_k: int | None = None,
               top_p: float | None = None, generator: torch.Generator | None = None) -> Tensor:
    """logits: [B, V] -> token ids [B]. Greedy unless ``do_sample``; sampling applies temperature,
    then top-k, then top-p (nucleus), as transformers' warpers do."""
    if not do_sample:
        return logits.argmax(dim=-1)
    scores = logits.float() / max(temperature, 1e-5)
    if top_k is not None and 0 < top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False, dim=-1)
        cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cum <= (1 - top_p)
        drop_sorted[:, -1] = False                                   # always keep the most likely token
        scores = scores.masked_fill(drop_sorted.scatter(1, order, drop_sorted), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
