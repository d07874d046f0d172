"""TOVA, Token Omission Via Attention (Oren et al. 2024; docs/policies.md §6.10)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

from kvpass.cache import LayerCache, keep_slots
from kvpass.policies.base import Policy, Stat, require
from kvpass.policies.capabilities import GathersAcrossHeads
from kvpass.policies.selection import kept_slots, select_kept

SCORE_HEADS = ("layer", "group")


@dataclass(frozen=True)
class TOVA(Policy, GathersAcrossHeads):
    """Keep the ``keep`` entries the newest query attends to most (§6.10), re-scored at every
    compression. ``Stat.LAST_ATTENTION`` holds, per entry, the attention of the last query only (the
    prompt's last row after prefill, then each decode step's row, replacing the previous one), already
    averaged over the query heads of each KV head's group (§0.5).

    ``score_heads="layer"`` (default, the paper's rule and kvpress's TOVAPress): the score is the mean
    over every query head of the layer, so all KV heads of a layer keep the same tokens. ``"group"``
    [OURS, the §0.5 default of other policies]: each KV head keeps its own group's top entries; on
    SmolLM2 (G = 3) this loses the needle that the layer-wide rule keeps (§6.10). One eviction per
    decode step by default, as the paper. The first ``sinks`` entries are always kept [OURS option; the
    paper: none]. Plain attention, nothing merged.

    Parameters
    ----------
    sinks: first tokens always kept (paper: 0).
    interval: decode steps between compressions; 1 = the paper's one-in-one-out.
    score_heads: "layer" (paper) or "group" (per KV head).
    """

    name: ClassVar[str] = "tova"
    section: ClassVar[str] = "§6.10"
    summary: ClassVar[str] = "keep the entries the newest query attends to most"
    stats: ClassVar[frozenset[Stat]] = frozenset({Stat.LAST_ATTENTION})
    sinks: int = 0
    interval: int = 1
    score_heads: str = "layer"

    def __post_init__(self) -> None:
        super().__post_init__()
        require(isinstance(self.sinks, int) and self.sinks >= 0, f"tova: sinks must be an int >= 0, got {self.sinks!r}")
        require(self.score_heads in SCORE_HEADS,
                f"tova: score_heads must be one of {SCORE_HEADS}, got {self.score_heads!r}")

    def min_budget(self) -> int:
        return self.sinks + 1

    def gathers_across_heads(self) -> bool:
        return self.score_heads == "layer"          # the layer's mean score over every KV head

    def stat_options(self, stat: Stat) -> dict[str, object]:
        """The prompt's last query row over every key, unpooled (the window-scores op, window 1)."""
        return {"obs_window": 1, "kernel": 1, "pool": "avg", "include_window": True}

    def layer_score(self, cache: LayerCache) -> Tensor:
        """With ``score_heads="layer"``: the mean of ``last_attn`` over every KV head of the layer (every
        rank's, ``heads.gather``), i.e. over all its query heads since the groups are equal. [B, 1, C] fp32.
        Slot j holds the same token in every head of a row: a layer-wide selection keeps them aligned."""
        return self.heads.gather(cache.slot_meta[Stat.LAST_ATTENTION.value]).mean(dim=1, keepdim=True)

    def compress(self, cache: LayerCache, keep: int) -> LayerCache:
        """cache: k, v [B, Hkv, C, D]; slot_meta['last_attn'] [B, Hkv, C] fp32 -> capacity min(keep, C).
        "layer": one selection per row (from its first head's length, which every head shares), applied
        to every head; "group": each head selects on its own."""
        sinks = min(self.sinks, keep)
        if self.score_heads == "group":
            kept = select_kept(cache.slot_meta[Stat.LAST_ATTENTION.value], cache.length, keep, sinks, 0)
        else:
            kept = select_kept(self.layer_score(cache), cache.length[:, :1], keep, sinks, 0)
            kept = kept.expand(-1, cache.length.shape[1], -1)
        return keep_slots(cache, kept_slots(kept, keep))
