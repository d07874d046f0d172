"""Deferred scores: a layer's ring of recent decode queries, and their attention rows added at once.

Where the decode graph keeps each step's query instead of returning its scores (``RewrittenGraphs.deferred_scores``;
``FusedDecodeStatistics.deferred_scores`` = m, D2O with ``interval`` m > 1), the layer's cache carries in its state

    recent_query    [B, Hq, m, D]  (the cache's dtype)  the steps' post-RoPE queries, at slot position mod m
    recent_position [B, m] int64                        their positions (-1: empty)

which the graph's ``kvpass::write_query`` fills. ``add_recent_rows`` adds the waiting queries' attention rows
to ``col_sum`` (``kvpass::recent_query_column_sums``: each query over the slots of positions <= its own, the
ones its step attended) and empties the ring. The session calls it before every compression of the layer (which
moves, merges and evicts slots: afterwards a row could no longer be rebuilt) and when m queries wait, so
``col_sum`` is the same as the per-step scores' sum, up to rounding, whenever the policy reads it.
"""

from __future__ import annotations

import torch

from kvpass.cache import LayerCache
from kvpass.policies.base import Stat
from kvpass.rewrites.attention_sites import AttentionSite
from kvpass.rewrites.decode_layout import RECENT_INPUTS

RECENT_QUERY, RECENT_POSITION = RECENT_INPUTS


def add_recent_queries(cache: LayerCache, n_heads: int, steps: int) -> None:
    """Give ``cache`` an empty ring of ``steps`` queries of ``n_heads`` heads (in its state: per batch row, so
    row operations carry it)."""
    b, _, _, d = cache.k.shape
    cache.state[RECENT_QUERY] = cache.k.new_zeros(b, n_heads, steps, d)
    cache.state[RECENT_POSITION] = torch.full((b, steps), -1, dtype=torch.long, device=cache.k.device)


def has_recent_queries(cache: LayerCache) -> bool:
    return RECENT_QUERY in cache.state


def recent_capacity(cache: LayerCache) -> int:
    """The ring's length m (the queries that may wait)."""
    return cache.state[RECENT_QUERY].shape[2]


def add_recent_rows(cache: LayerCache, site: AttentionSite) -> None:
    """col_sum [B, Hkv, C] += the waiting queries' attention rows, then the ring is emptied. No host sync."""
    ring, at = cache.state[RECENT_QUERY], cache.state[RECENT_POSITION]
    rows = torch.ops.kvpass.recent_query_column_sums(ring, at, cache.k, cache.log_weight, cache.position,
                                                     site.scale, site.softcap)
    cache.slot_meta[Stat.COLUMN_SUM.value].add_(rows)
    at.fill_(-1)
