"""The cache buffers ``generate`` keeps from one call to the next, so the decode step's CUDA graphs do too.

A CUDA graph reads and writes the addresses it was recorded with (kvpass/decode_step.py), and every call of
``generate`` builds its caches anew: without this, each call captured its decode step again, the plain step
and the compressing one: 0.17-0.20 s a call for a Llama-3.1-8B shape at 32k on an H200, a third of what its
128 tokens' steps take (benchmarks/results/generate-step-times-nvidia-h200.json). So ``generate`` keeps the
buffers of its session at the end of a call (``keep``), and the next call whose caches have the same layout
(every layer's tensors of the same shapes, dtypes and strides, the same budgets per row) copies its freshly
built caches into them (``adopt``): same addresses, same host-side values, and the graphs recorded by the
earlier call replay as they are.

The cost is memory: the kept buffers (one compressed cache) stay allocated between calls and through the
next prefill. ``KVPassModel`` drops them (``release``) where memory matters more: before a chunked prefill
(which is there to lower the peak), when the prefill's memory check fails with them held, on an
out-of-memory error, and when ``reuse_decode_buffers`` is False; a policy that compresses the prompt at the
first decode step (new buffers then) never keeps them. Sessions a user holds (``start``) never use them:
only ``generate``'s, which never outlive the call.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from kvpass.cache import LayerCache, load_into
from kvpass.runtime.layers import Layer, recorded_params


def _tensor_layout(t: Tensor) -> tuple:
    return tuple(t.shape), t.stride(), t.dtype, t.device


def _cache_layout(cache: LayerCache) -> tuple:
    return (tuple(_tensor_layout(getattr(cache, n)) for n in ("k", "v", "log_weight", "length", "position")),
            tuple((n, _tensor_layout(t)) for n, t in cache.slot_meta.items()),
            tuple((n, _tensor_layout(t)) for n, t in cache.state.items()))


def layout(layers: Sequence[Layer]) -> tuple:
    """What two sessions' layers must share for one's buffers to serve the other, graphs included: every cache's
    tensors (shapes, strides, dtypes, devices; slot metadata and state by name) and the host-side values the
    decode step is recorded with (``recorded_params``)."""
    return (tuple((lay.compressible, lay.sliding, tuple(_cache_layout(c) for c in lay.caches())) for lay in layers),
            recorded_params(layers))


class DecodeBuffers:
    """The last ``generate`` call's cache buffers (and per-row budget tensors), by layer, with their layout."""

    def __init__(self) -> None:
        self._layout: tuple | None = None
        self._caches: list[list[LayerCache]] = []
        self._keep_rows: list[tuple[tuple, Tensor] | None] = []

    @property
    def held(self) -> bool:
        return self._layout is not None

    def nbytes(self) -> int:
        """Bytes the kept buffers hold."""
        return sum(c.nbytes() for caches in self._caches for c in caches)

    def keep(self, layers: Sequence[Layer]) -> None:
        """Keep ``layers``' buffers (a session at the end of its ``generate`` call) for the next call."""
        self._layout = layout(layers)
        self._caches = [lay.caches() for lay in layers]
        self._keep_rows = [lay._keep_rows for lay in layers]

    def release(self) -> None:
        """Drop the kept buffers (their memory goes back to the allocator once nothing else holds them)."""
        self._layout, self._caches, self._keep_rows = None, [], []

    def adopt(self, layers: Sequence[Layer]) -> bool:
        """Put a new session's ``layers`` into the kept buffers if their layout is the kept one: each cache copied
        in (``load_into``) and the layer pointed at the kept buffer, its own freed. Returns whether it did; a
        layout of its own drops the kept buffers instead (the new session's become the ones kept at its end)."""
        if self._layout is None:
            return False
        if layout(layers) != self._layout:
            self.release()
            return False
        for lay, kept, keep_rows in zip(layers, self._caches, self._keep_rows, strict=True):
            for dst, src in zip(kept, lay.caches(), strict=True):
                load_into(dst, src)
            lay.cache = kept[0]
            if lay.full is not None:
                lay.full = kept[1]
            lay._keep_rows = keep_rows
        return True
