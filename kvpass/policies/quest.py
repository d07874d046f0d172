"""Quest (Tang et al. 2024): query-aware page recall over the full cache (docs/policies.md §6.6)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvpass.cache import LayerCache, with_capacity
from kvpass.kernels.page_recall_attention import page_summaries
from kvpass.policies.base import Attention, Policy, require

FULL_BUDGET = 2**62          # a budget no cache reaches: every page selected (full attention)


@dataclass(frozen=True)
class Quest(Policy):
    """Page-level recallable baseline (docs/policies.md §6.6). Nothing is evicted: the cache keeps every
    token; each decode step attends exactly over the top max(3, budget // page_size) pages of every
    query head, pages scored by the per-channel min/max key bound (``kvpass::page_recall_attention``).
    The first ``full_layers`` layers use full attention, as the reference; prefill is full attention.

    Parameters
    ----------
    page_size: P = 16 tokens per page.
    full_layers: layers attending to every token (reference: layers 0 and 1).
    force_last_page: always select the newest page ([OURS] flag quest_force_last_page of §6.6).
    """

    name: ClassVar[str] = "quest"
    section: ClassVar[str] = "§6.6"
    summary: ClassVar[str] = "recall the top pages by a min/max key bound; full cache kept"
    attention: ClassVar[Attention] = Attention.PAGE_RECALL
    compresses: ClassVar[bool] = False
    decode_inputs: ClassVar[tuple[str, ...]] = ("page_max", "page_min", "recall_budget", "force_last_page")
    page_size: int = 16
    full_layers: int = 2
    force_last_page: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        require(isinstance(self.page_size, int) and self.page_size >= 1,
                f"quest: page_size must be an int >= 1, got {self.page_size!r}")
        require(isinstance(self.full_layers, int) and self.full_layers >= 0,
                f"quest: full_layers must be an int >= 0, got {self.full_layers!r}")

    def prepare(self, cache: LayerCache, layer: int, budget: int) -> LayerCache:
        """Pad the capacity to whole pages and summarise the prompt's pages: state ``page_max``,
        ``page_min`` [B, Hkv, C / P, D] fp32, ``recall_budget`` [B, Hkv] int64 (tokens per step),
        ``force_last_page`` [B, Hkv] bool."""
        pages = -(-cache.capacity // self.page_size)
        cache = with_capacity(cache, pages * self.page_size)
        page_max, page_min = page_summaries(cache.k, cache.live, pages)
        shape = cache.length.shape
        per_row = torch.as_tensor(budget, dtype=torch.long, device=cache.k.device).reshape(-1, 1)   # [B or 1, 1]
        budget_t = (torch.full(shape, FULL_BUDGET, dtype=torch.long, device=cache.k.device) if layer < self.full_layers
                    else per_row.expand(shape).contiguous())
        cache.state = {**cache.state, "page_max": page_max, "page_min": page_min, "recall_budget": budget_t,
                       "force_last_page": torch.full(shape, self.force_last_page, device=cache.k.device)}
        return cache

    def compress(self, cache: LayerCache, keep: int) -> LayerCache:
        return cache
