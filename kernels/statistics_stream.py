"""Prefill statistics on a side stream, so they overlap the rest of the prefill.

Inside ``statistics_side_stream(device)`` the CUDA implementations of the statistics ops
(``attention_column_sums``, ``attention_column_sums_and_head_variance``, ``attention_head_variance``)
queue their kernels on one side stream, after the work the current stream has queued so far (their
q, k and lse are ready then). The current stream goes on with the next layers at once; leaving the
block makes it wait for the side stream, so every statistic is ready on the current stream after it.
Outside the block (the default, and for anyone calling the ops directly) and during a CUDA graph
capture they run on the current stream like any op. The runtime wraps its prefill graph in the block (``KVPassModel.prefill``).

The caching allocator is told who uses what: the inputs are recorded on the side stream (their
memory is not reused before the side kernels have read it), the outputs on the current stream.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import torch
from torch import Tensor

_state = threading.local()
T = TypeVar("T", Tensor, tuple[Tensor, ...])


@contextlib.contextmanager
def statistics_side_stream(device: torch.device) -> Iterator[None]:
    """Within: statistics ops on CUDA run on a side stream; on exit the current stream waits for it.
    A no-op off CUDA. Not re-entrant (an inner block would join the outer one's stream early)."""
    if device.type != "cuda":
        yield
        return
    side = torch.cuda.Stream(device)
    _state.stream = side
    try:
        yield
    finally:
        _state.stream = None
        torch.cuda.current_stream(device).wait_stream(side)


def on_statistics_stream(fn: Callable[[], T], inputs: Sequence[Tensor | None]) -> T:
    """``fn()`` (a tensor or a tuple of tensors), on the statistics side stream when a
    ``statistics_side_stream`` block is open, else on the current stream. ``inputs``: the tensors
    ``fn`` reads (None entries are skipped)."""
    side = getattr(_state, "stream", None)
    if side is None or torch.cuda.is_current_stream_capturing():     # a capture must not end unjoined
        return fn()
    main = torch.cuda.current_stream(side.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        out = fn()
    for t in inputs:
        if t is not None:
            t.record_stream(side)
    for t in out if isinstance(out, tuple) else (out,):
        t.record_stream(main)
    return out
