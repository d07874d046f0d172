"""Budget semantics.

A budget is either a fraction in (0, 1] (a ``float``) of the tokens a sequence will hold, prompt
plus generated (``prompt_tokens + max_new_tokens``, the longest prompt of a batch), or a number of
tokens (an ``int`` >= 1). It is the number of entries each compressed layer keeps after a
compression; between compressions a layer grows by at most the policy's ``interval``. Policies with
per-layer budgets (D2O, PyramidKV) keep the same total over the layers. Sliding-window layers keep
their window and do not count against the budget.
"""

from __future__ import annotations

import argparse
import math


def check_budget(budget: float | int) -> None:
    """Raise for a budget that is neither a fraction in (0, 1] nor a token count >= 1 (``kvpass.validation``:
    InvalidType / InvalidValue, a TypeError / ValueError)."""
    from kvpass.validation import check_budget as check

    check(budget)


def budget_tokens(budget: float | int, total_tokens: int) -> int:
    """Entries per compressed layer for sequences of ``total_tokens`` (prompt + new tokens)."""
    check_budget(budget)
    if isinstance(budget, float):
        return max(1, math.floor(budget * total_tokens))
    return budget


def budget_with_full_heads(budget: float | int, total_tokens: int, heads: int, full_heads: int) -> int:
    """Entries per compressed KV head when ``full_heads`` of the ``heads`` KV heads of the compressible
    layers keep all ``total_tokens`` (Chelsea's outlier heads, docs/policies.md §1.10), so that the total
    stays what ``budget`` gives every head: R' = (R * heads - full_heads) / (heads - full_heads) of
    ``total_tokens`` for a fraction R; (b * heads - full_heads * total) / (heads - full_heads) for a
    token count b. Rounds down. Raises ValueError when the full heads alone exceed the total."""
    check_budget(budget)
    if full_heads == 0:
        return budget_tokens(budget, total_tokens)
    if not 0 < full_heads < heads:
        raise ValueError(f"{full_heads} full-cache heads out of {heads}: at least one head must be compressed")
    if isinstance(budget, float):
        ratio = (budget * heads - full_heads) / (heads - full_heads)
        kept = math.floor(ratio * total_tokens + 1e-9)
    else:
        kept = (budget * heads - full_heads * total_tokens) // (heads - full_heads)
    if kept < 1:
        raise ValueError(f"budget {budget!r} of {total_tokens} tokens cannot keep {full_heads} of {heads} KV heads "
                         f"full: they alone need {full_heads / heads:.1%} of the full cache; raise the budget")
    return kept

def parse_budget(text: str) -> float | int:
    """Command-line budget: '0.2' -> 0.2 (a fraction); '512' -> 512 (tokens). Shared by ``kvpass``
    and ``kvpass eval`` (argparse ``type=``)."""
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"budget {text!r} is neither a fraction like 0.2 nor a token count") from None
