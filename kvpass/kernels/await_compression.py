"""``kvpass::await_compression``: the decode graph's wait for a layer's forked compression.

The runtime may compress the layers whose buffers are full on side CUDA streams, forked from the
decode step's stream (``kvpass.decode_step.fork_side_by_side``), and record one event per layer in
``PENDING`` (keyed by the layer's K buffer address). The rewritten decode graph calls this op just
before a layer writes its K, V, so the step waits for that layer's compression only there.

slot: [B, Hkv] int64, where the step's K, V go (declared mutated, never written, so that compilers
keep the op before ``write_kv``, which reads it); k_cache: [B, Hkv, C, D].

The op lives here, beside the other ops, so that the graph passes (``kvpass.rewrites``) can insert it
without importing the runtime; the event bookkeeping that fills ``PENDING`` stays in
``kvpass.decode_step``. With nothing pending (CPU, eager steps) it does nothing: that is its
reference.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Compressions forked and not yet awaited: K buffer address -> event recorded on the side stream after
# the layer's compression (filled by ``kvpass.decode_step.fork_side_by_side``).
PENDING: dict[int, torch.cuda.Event] = {}


def await_compression_reference(slot: Tensor, k_cache: Tensor) -> None:
    """The op's meaning without side streams: nothing to wait for, nothing written."""
    return None


@torch.library.custom_op("kvpass::await_compression", mutates_args=("slot",))
def await_compression(slot: Tensor, k_cache: Tensor) -> None:
    """The current stream waits for the compression of ``k_cache``'s layer, if one is pending."""
    event = PENDING.pop(k_cache.data_ptr(), None)
    if event is not None:
        torch.cuda.current_stream(k_cache.device).wait_event(event)


@await_compression.register_fake
def _(slot: Tensor, k_cache: Tensor) -> None:
    return None
