"""PyramidKV (Cai et al. 2024; docs/policies.md §6.5)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvpass.cache import LayerCache
from kvpass.policies.base import require
from kvpass.policies.snapkv import SnapKV


@dataclass(frozen=True)
class PyramidKV(SnapKV):
    """SnapKV selection (same scores and window) with per-layer budgets decreasing linearly with depth
    (§6.5, KVCache-Factory's PyramidKVCluster). With average budget C, window w, n prompt tokens and
    L compressed layers: min = (C - w) // beta, max = 2 (C - w) - min; if max >= n - w then max = n - w
    and min = 2 (C - w) - max; step = (max - min) // (L - 1); layer l keeps w + max - l * step. If
    n < C, n < 2 (C - w) or C <= w every layer keeps C. The integer steps can overshoot L * C: the
    excess is taken from the largest (shallowest) layers, one entry each, so the total is exactly
    L * C [OURS]. Shares SnapKV's decode rule and parameters.

    Parameters
    ----------
    beta: steepness of the pyramid (official: 20).
    window, kernel, pool, interval: as SnapKV (KVCache-Factory: window 32, avg pooling).
    """

    name: ClassVar[str] = "pyramidkv"
    section: ClassVar[str] = "§6.5"
    summary: ClassVar[str] = "SnapKV with pyramidal (depth-decreasing) layer budgets"
    beta: float = 20.0

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.beta >= 1, f"pyramidkv: beta must be >= 1, got {self.beta!r}")

    def layer_budgets(self, budget: int, caches: list[LayerCache]) -> list[int]:
        n_layers = len(caches)
        n = max(int(c.length.max()) for c in caches)
        w, c = self.window, budget
        if n_layers < 2 or c <= w or n < c or n < 2 * (c - w):
            return [c] * n_layers
        lo = int((c - w) // self.beta)
        hi = 2 * (c - w) - lo
        if hi >= n - w:
            hi = n - w
            lo = 2 * (c - w) - hi
        step = (hi - lo) // (n_layers - 1)
        out = [w + hi - layer * step for layer in range(n_layers)]
        excess = sum(out) - n_layers * c
        layer = 0
        while excess > 0:
            out[layer % n_layers] -= 1
            excess -= 1
            layer += 1
        return out
