"""Write one new token's key and value into the cache, in place.

For every (b, g): k_cache[b, g, slot[b, g]] = k_new[b, g, 0], likewise v, and
log_weight[b, g, slot[b, g]] = 0 (a plain, live entry). ``slot`` is the cache length for a
growing layer and ``position % window`` for a sliding-window ring.

Shapes: k_cache, v_cache: [B, Hkv, C, D]; log_weight: [B, Hkv, C] fp32; slot: [B, Hkv] int64;
k_new, v_new: [B, Hkv, 1, D]. The cache buffers may live on another device than the new token
(a recall policy's host-resident K, V; ``Policy.host_resident``). Traffic: 2*B*Hkv*D elements written.
"""

from __future__ import annotations

import torch
from torch import Tensor


def write_kv_reference(k_cache: Tensor, v_cache: Tensor, log_weight: Tensor, slot: Tensor,
                       k_new: Tensor, v_new: Tensor) -> None:
    idx = slot.to(k_cache.device)[:, :, None, None].expand(-1, -1, 1, k_cache.shape[-1])
    k_cache.scatter_(2, idx, k_new.to(k_cache.device, k_cache.dtype))      # k, v may be host-resident
    v_cache.scatter_(2, idx, v_new.to(v_cache.device, v_cache.dtype))
    log_weight.scatter_(2, slot.to(log_weight.device)[:, :, None], 0.0)


@torch.library.custom_op("kvpass::write_kv", mutates_args=("k_cache", "v_cache", "log_weight"))
def write_kv(k_cache: Tensor, v_cache: Tensor, log_weight: Tensor, slot: Tensor,
             k_new: Tensor, v_new: Tensor) -> None:
    write_kv_reference(k_cache, v_cache, log_weight, slot, k_new, v_new)


@write_kv.register_fake
def _(k_cache, v_cache, log_weight, slot, k_new, v_new):
    return None
