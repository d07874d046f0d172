"""The layer state of D2O's fused nearest-key search (``kvpass::decode_attention_nearest``; docs/policies.md §5.8).

The one-in-one-out step names, a step ahead, the ``CANDIDATES`` entries of lowest score the next step may evict;
the decode attention finds their nearest keys from its own read of K, and the next eviction takes that result
where its entry was named (at batch >= 4: ``fuses_at``). On SmolLM2 the next evicted entry was among the 4 lowest
in every one of 16,740 steps; at 32k batch 32 on an H200 a step took 15.94 against 18.44 ms scanning
(docs/speed.md). The state: the next step's candidates and first target slot, the keys' inverse norms
(written by the eviction; +0.8% of the cache at head size 128), then the attention's results.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvpass.cache import LayerCache
from kvpass.kernels.decode_attention_nearest import NEAREST_INPUTS

CANDIDATES = 4


def nearest_state(cache: LayerCache, m: int = CANDIDATES) -> dict[str, Tensor]:
    """The empty state of the search for ``cache``'s buffers: no candidates (-1), so the first eviction scans, and
    no known norms (NaN: the first scan of a row computes them). [B, Hkv, m] int64, [B, Hkv] int64, [B, Hkv, C]
    fp32, [B, Hkv, m] int64, [B, Hkv, m] fp32, [B, Hkv, m] int64."""
    b, h, c = cache.k.shape[:3]
    dev = cache.k.device
    none = torch.full((b, h, m), -1, dtype=torch.long, device=dev)
    return dict(nearest_next=none, nearest_from=torch.zeros(b, h, dtype=torch.long, device=dev),
                nearest_inv_norm=torch.full((b, h, c), float("nan"), device=dev), nearest_cand=none.clone(),
                nearest_best=torch.full((b, h, m), float("-inf"), device=dev), nearest_slot=torch.zeros_like(none))


def layer_nearest(cache: LayerCache) -> list[Tensor]:
    """The layer's state of the search in ``NEAREST_INPUTS`` order, or [] where it has none."""
    return [cache.state[n] for n in NEAREST_INPUTS] if NEAREST_INPUTS[0] in cache.state else []


def forget_candidates(cache: LayerCache) -> None:
    """After a compression of a path that keeps no norms: the next step names no candidates, so the eviction after
    it scans (and computes the norms) again."""
    if NEAREST_INPUTS[0] in cache.state:
        cache.state["nearest_next"].fill_(-1)
