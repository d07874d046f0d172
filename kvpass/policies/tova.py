"""TOVA, Token Omission Via Attention (Oren et al. 2024; docs/policies.md §6.10)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvpass.cache import LayerCache, keep_slots
from kvpass.policies.base import Policy, Stat, require
from kvpass.policies.selection import kept_slots, select_kept


@dataclass(frozen=True)
class TOVA(Policy):
    """Keep the ``keep`` entries the newest query attends to most (§6.10), re-scored at every
    compression: ``Stat.LAST_ATTENTION`` holds, per entry, the attention of the last query only (the
    prompt's last row after prefill, then each decode step's row, replacing the previous one), averaged
    over the query heads of the KV head's group (§0.5; the paper averages over all heads of the layer).
    One eviction per decode step by default, as the paper. The first ``sinks`` entries are always kept
    [OURS option; the paper: none]. Plain attention, nothing merged.

    Parameters
    ----------
    sinks: first tokens always kept (paper: 0).
    interval: decode steps between compressions; 1 = the paper's one-in-one-out.
    """

    name: ClassVar[str] = "tova"
    section: ClassVar[str] = "§6.10"
    summary: ClassVar[str] = "keep the entries the newest query attends to most"
    stats: ClassVar[frozenset[Stat]] = frozenset({Stat.LAST_ATTENTION})
    sinks: int = 0
    interval: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        require(isinstance(self.sinks, int) and self.sinks >= 0, f"tova: sinks must be an int >= 0, got {self.sinks!r}")

    def min_budget(self) -> int:
        return self.sinks + 1

    def stat_options(self, stat: Stat) -> dict[str, object]:
        """The prompt's last query row over every key, unpooled (the window-scores op, window 1)."""
        return {"obs_window": 1, "kernel": 1, "pool": "avg", "include_window": True}

    def compress(self, cache: LayerCache, keep: int) -> LayerCache:
        """cache: k, v [B, Hkv, C, D]; slot_meta['last_attn'] [B, Hkv, C] fp32 -> capacity min(keep, C)."""
        sinks = min(self.sinks, keep)
        kept = select_kept(cache.slot_meta[Stat.LAST_ATTENTION.value], cache.length, keep, sinks, 0)
        return keep_slots(cache, kept_slots(kept, keep))
