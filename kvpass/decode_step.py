"""The decode step under a CUDA graph: fixed buffers, one graph replay per token.

A decode step launches hundreds of small kernels (per layer: norms, projections, RoPE, write_kv,
decode attention, MLP, and the runtime's slot and length bookkeeping); at batch 1 their launch
overhead, not memory traffic, bounds eager decoding (architecture.md, "Performance model").
``StaticDecodeStep`` captures the device work of one step, ``fn(*step_inputs)``, in a CUDA graph (one
per variant: the plain step, and the step that first compresses the layers whose buffers are full)
and replays it every step.

* step inputs (the token ids [B] and positions [B, 1]) are new tensors every step: they are copied
  into static buffers owned by the step before each replay;
* the layers compressed in a step run side by side, on side streams forked from the step's stream
  (``fork_side_by_side``; how many: ``forked_branches``): independent, short work, replayed in parallel, and
  overlapped with the step itself: the decode graph waits for layer l's compression only where layer l writes its
  K, V (the ``kvpass::await_compression`` op before each write_kv);
* persistent tensors (every layer's cache tensors: K, V, log-weights, lengths, positions, policy
  slot metadata and state) are read and written in place at the addresses the graph was captured
  with. Compression keeps them (``cache.load_into`` copies into the same buffers). When one of them
  is a different tensor (a new session's caches, a policy that replaced a buffer), a step input
  changes shape, or a host-side value the step's work was recorded with changes (``params``: the layers'
  budgets), the step re-captures (``capture_key``). ``generate`` keeps its caches' buffers for the next call
  of the same layout (kvpass/runtime/decode_buffers.py), so repeated calls replay what the first captured.

Capture first runs ``fn`` eagerly (warm-up: Triton compilation, library handles), and that run is the
step itself: its outputs are returned and the graph, recorded after it (recording runs nothing), first
replays at the next step. So nothing is saved or put back for it; a step that compresses, which moves
entries, would otherwise need a copy of every cache tensor, K and V included, for that moment (the decode
peak of a 128k prompt at budget 0.2 was weights + 2x the compressed cache, issue 29). Only with
``warmup`` > 1 do the extra runs, before the step's, save and put back the tensors they advance
(``restore``: every cache tensor when the step compresses, else lengths, positions, log-weights,
accumulated scores and the like; K and V are rewritten identically).

Recording does not empty the allocator's cache (``torch.cuda.graph`` does, at every capture: the next
prefill would then allocate its gigabytes from the driver again). ``captures`` and ``capture_seconds`` count
what capturing cost (warm-up and recording; ``GenerationReport.graph_captures``).

The returned first output (the logits) is a copy; later outputs are the graph's static tensors,
overwritten by the next replay. On CPU, with ``KVPASS_CUDA_GRAPH=0``, with ``enabled = False``, or if
capture fails (an op that synchronises, say), or where a persistent tensor lives on another device than the
step inputs (a host-resident cache), ``fn`` runs eagerly: same inputs, same outputs. A failed
capture's memory pool is given back (``release_failed_capture``), and where the driver has less memory free
than the allocator's cache holds unused, the cache is emptied before recording (``make_room_for_capture``).
"""

from __future__ import annotations

import gc
import logging
import os
import time
import traceback
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor

from kvpass.kernels.await_compression import PENDING

log = logging.getLogger(__name__)

Key = tuple


def capture_key(step_inputs: Sequence[Tensor], persistent: Sequence[Tensor], params: Key = ()) -> Key:
    """What a captured graph depends on: shapes and dtypes of the step inputs, the identity (address, shape,
    strides, dtype) of the persistent tensors, and ``params`` (host-side values the recorded work was built
    with, e.g. the layers' budgets). A new key means re-capture."""
    steps = tuple((tuple(x.shape), x.dtype, x.device) for x in step_inputs)
    state = tuple((x.data_ptr(), tuple(x.shape), x.stride(), x.dtype, x.device) for x in persistent)
    return steps, (state, params)


def graphs_enabled(device: torch.device) -> bool:
    return device.type == "cuda" and os.environ.get("KVPASS_CUDA_GRAPH", "1") != "0"


class StaticDecodeStep:
    """``step(fn, step_inputs, persistent, restore, variant, params)`` = ``fn(*step_inputs)``, replayed from a
    CUDA graph on CUDA. One graph per ``variant`` (the plain step, or a step that first compresses a
    given set of layers) for the current persistent tensors and ``params``; new ones drop them all.
    A variant whose capture fails runs eagerly from then on (``graphed`` says which). ``captures``
    counts captures and ``capture_seconds`` their wall time (reports, tests and benchmarks read them)."""

    def __init__(self, enabled: bool = True, warmup: int = 1, branches: int = 8) -> None:
        self.enabled, self.warmup, self.branches = enabled, warmup, branches
        self.fork_branches: int | None = None     # streams for forked compressions; None: ``forked_branches``
        self._side: dict[tuple[torch.device, int], list[torch.cuda.Stream]] = {}
        self.captures = 0
        self.capture_seconds = 0.0
        self._state_key: Key | None = None
        self._graphs: dict[Key, tuple[object, list[Tensor], tuple[Tensor, ...]]] = {}
        self._eager: set[Key] = set()

    def side_streams(self, device: torch.device, count: int | None = None) -> list[torch.cuda.Stream]:
        """``count`` (default ``branches``) streams on ``device`` for ``run_side_by_side`` and
        ``fork_side_by_side`` (made once per device and count, reused by every capture)."""
        key = (device, count or self.branches)
        if key not in self._side:
            self._side[key] = [torch.cuda.Stream(device) for _ in range(key[1])]
        return self._side[key]

    def fork_streams(self, device: torch.device, batch: int, interval: int) -> list[torch.cuda.Stream]:
        """The side streams a step's forked compressions run on: ``fork_branches`` where set (probes), else
        ``forked_branches(batch, interval, branches)``."""
        return self.side_streams(device, self.fork_branches or forked_branches(batch, interval, self.branches))

    def run_all(self, calls: Sequence[Callable[[], object]], device: torch.device) -> None:
        """Run independent ``calls``: side by side on this step's side streams (``run_side_by_side``) on CUDA
        when there are several, else one after the other on the current stream."""
        if len(calls) > 1 and device.type == "cuda":
            run_side_by_side(calls, self.side_streams(device))
        else:
            for call in calls:
                call()

    def reset(self) -> None:
        """Drop every captured graph (and its memory pool)."""
        self._state_key, self._graphs = None, {}

    def graphed(self, device: torch.device, variant: Key = ()) -> bool:
        """Whether ``variant`` would be replayed from a graph on ``device`` (False: eager)."""
        return self.enabled and graphs_enabled(device) and variant not in self._eager

    def __call__(self, fn: Callable[..., Sequence[Tensor]], step_inputs: Sequence[Tensor],
                 persistent: Sequence[Tensor], restore: Sequence[Tensor] = (), variant: Key = (),
                 params: Key = ()) -> tuple[Tensor, ...]:
        if not self.graphed(step_inputs[0].device, variant):
            return tuple(fn(*step_inputs))
        steps, state = capture_key(step_inputs, persistent, params)
        if state != self._state_key:
            self.reset()
            self._state_key = state
        key = (variant, steps)
        if key not in self._graphs:
            if any(t.device != step_inputs[0].device for t in persistent):
                # a host-resident cache (ClusterKV's): the step's host work would not replay, and its copies to
                # pageable host memory fail the capture; a failed capture is not free (release_failed_capture)
                log.info("the decode step reads tensors on another device than its inputs: it runs eagerly")
                self._eager.add(variant)
                return tuple(fn(*step_inputs))
            return self._capture(fn, step_inputs, restore, key)
        graph, static, outs = self._graphs[key]
        for s, x in zip(static, step_inputs, strict=True):
            s.copy_(x)
        graph.replay()
        return (outs[0].clone(), *outs[1:])

    def _capture(self, fn, step_inputs: Sequence[Tensor], restore: Sequence[Tensor], key: Key) -> tuple[Tensor, ...]:
        """Warm up (the last run is this step: its outputs are returned), then record the graph the next steps
        replay. A recording that fails leaves the variant eager from then on (the step already happened)."""
        if step_inputs[0].is_cuda:         # the queued work before the step (a prefill's tail) is not the capture's
            torch.cuda.synchronize()
        started = time.perf_counter()
        static = [x.clone(memory_format=torch.contiguous_format) for x in step_inputs]
        outs = self._warm_up(fn, static, restore)
        try:
            graph, graph_outs = self._record(fn, static)
        except Exception as exc:    # noqa: BLE001  (any capture failure: stay correct, run eagerly)
            log.warning("CUDA graph capture of the decode step %s failed (%s); running it eagerly", key[0], str(exc))
            self._eager.add(key[0])
            if static[0].is_cuda:
                torch.cuda.synchronize()
            return outs
        finally:
            self.capture_seconds += time.perf_counter() - started
        self._graphs[key] = (graph, static, graph_outs)
        self.captures += 1
        return outs

    def _warm_up(self, fn, static: Sequence[Tensor], restore: Sequence[Tensor]) -> tuple[Tensor, ...]:
        """Run ``fn`` ``warmup`` times on a side stream on CUDA (as capture wants): the runs before the last put
        back the tensors they advanced (``restore``); the last is the step itself, whose outputs are returned."""
        cuda = static[0].device.type == "cuda"
        side = torch.cuda.Stream() if cuda else None
        if cuda:
            side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side) if cuda else _null():
            for _ in range(self.warmup - 1):
                saved = [t.clone() for t in restore]
                fn(*static)
                for t, s in zip(restore, saved, strict=True):
                    t.copy_(s)
                del saved
            outs = tuple(fn(*static))
        if cuda:
            main = torch.cuda.current_stream()
            main.wait_stream(side)
            for t in outs:                      # made on the side stream, used on this one from now on
                t.record_stream(main)
        return outs

    def _record(self, fn, static: Sequence[Tensor]):
        """Capture ``fn(*static)``: returns the graph (``.replay()``) and its static outputs. As
        ``torch.cuda.graph`` does (on a side stream, after the device finished the warm-up), but without
        emptying the allocator's cache: that releases every cached block to the driver, and the next call's
        prefill would allocate them again."""
        graph, capture = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        torch.cuda.synchronize()
        make_room_for_capture(static[0].device)
        pool = torch.cuda.graph_pool_handle()    # ours, not graph.pool(): that refuses a failed capture
        failure = None
        try:
            with torch.cuda.stream(capture):
                graph.capture_begin(pool=pool)
                try:
                    outs = tuple(fn(*static))
                finally:
                    graph.capture_end()
        except Exception as exc:    # noqa: BLE001  (its traceback holds the capture's tensors: let them go first)
            failure = f"{type(exc).__name__}: {exc}"
            log.debug("the capture's traceback (as text):\n%s", traceback.format_exc())
        if failure is not None:
            release_failed_capture(graph, pool, static[0].device)
            raise CaptureFailed(failure)
        torch.cuda.current_stream().wait_stream(capture)
        return graph, outs


class CaptureFailed(RuntimeError):
    """A CUDA graph capture of the decode step failed (the message is the cause's); its memory pool was given back."""


def make_room_for_capture(device: torch.device) -> None:
    """Empty the allocator's cache before a capture where the driver has less memory free than the cache holds
    unused. A capture allocates from a pool of its own, which cannot take the cache's unused blocks, and the
    allocator cannot give them back to the driver while a capture runs (that invalidates the capture: an H100
    at batch 53, 32k, failed so, as "capturing stream has unjoined work"). Otherwise the cache is kept, so that
    the next prefill does not allocate its gigabytes from the driver again."""
    free, _ = torch.cuda.mem_get_info(device)
    unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if free < unused:
        torch.cuda.empty_cache()


def release_failed_capture(graph: torch.cuda.CUDAGraph, pool: tuple[int, int], device: torch.device) -> None:
    """Give back the memory pool of a capture that failed. torch before pytorch/pytorch#190348 never drops a
    failed capture's use of its pool, so the pool's memory stays reserved until the process exits (where
    the capture failed for want of memory, every later call then fails too). After the graph's own
    ``reset`` and an emptied cache, where the pool keeps segments that are all free (nothing of it in use: torch
    kept the capture's use), that use is dropped here and the cache emptied again. Where its segments still
    hold live tensors the pool is left alone: a torch that drops the use itself (2.11) has already made the pool
    freeable, and a second drop sent its use count below zero, after which every ``torch.cuda.empty_cache()``
    of the process failed an internal assert (on an H100 with torch 2.11: ClusterKV's host-resident cache
    fails every capture). ``pool``: the id the capture was begun with (``torch.cuda.graph_pool_handle()``)."""
    pool, index = tuple(pool), device.index or 0
    try:                                         # torch before #180395: an end of capture that failed left
        torch._C._cuda_endAllocateToPool(index, pool)    # the allocator routing to the pool
    except (AttributeError, RuntimeError):       # routing had ended (the usual case)
        pass
    restore_generator_after_capture(device)      # after the routing ended: its scratch is not the pool's
    try:
        graph.reset()
    except RuntimeError as exc:
        log.debug("reset of a failed capture: %s", exc)
    gc.collect()
    torch.cuda.empty_cache()
    total, active = pool_bytes(device, pool)
    if not total:
        return
    if active:
        log.debug("the failed capture's pool still holds live tensors: left to torch, which frees it when they go")
        return
    try:
        torch._C._cuda_releasePool(index, pool)
    except (AttributeError, RuntimeError) as exc:   # a torch without it, or the pool already released
        log.warning("could not release the memory pool of a failed CUDA graph capture: %s", exc)
    torch.cuda.empty_cache()


def restore_generator_after_capture(device: torch.device) -> None:
    """End the CUDA generator's capture state that a failed capture left. A capture registers the default generator
    (its offsets then advance in the graph), and ``capture_end`` unregisters it only after the capture ended well:
    after one that failed, every later random draw outside a capture (sampling, ``torch.nn.init``) raised "Offset
    increment outside graph capture encountered unexpectedly" (H100, torch 2.11). One capture of a tiny kernel that
    succeeds runs that ending again."""
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream(device)
    scratch = torch.zeros(1, device=device)
    try:
        with torch.cuda.stream(side):
            graph.capture_begin()
            scratch.add_(1)
            graph.capture_end()
    except RuntimeError as exc:
        log.warning("could not end the CUDA generator's state of a failed capture: %s", exc)
    finally:
        graph.reset()


def pool_bytes(device: torch.device, pool: tuple[int, int]) -> tuple[int, int]:
    """(total, active) bytes of the allocator's segments that belong to memory pool ``pool`` on ``device``, from
    one snapshot: all of them, and those in use (allocated to live tensors, or freed but awaiting a stream)."""
    index = device.index or 0
    ours = [s for s in torch.cuda.memory_snapshot()
            if s.get("device", index) == index and tuple(s.get("segment_pool_id", ())) == pool]
    return sum(s["total_size"] for s in ours), sum(s.get("active_size", 0) for s in ours)


def _branches(calls: Sequence[Callable[[], object]], streams: Sequence[torch.cuda.Stream]) -> Iterator[torch.cuda.Stream]:
    """Run ``calls`` round robin over ``streams``, each stream first waiting for the current one; yields
    the stream of each call once it is launched."""
    main = torch.cuda.current_stream()
    used = list(streams[: len(calls)])
    for s in used:
        s.wait_stream(main)
    for j, call in enumerate(calls):
        with torch.cuda.stream(used[j % len(used)]):
            call()
        yield used[j % len(used)]


def run_side_by_side(calls: Sequence[Callable[[], object]], streams: Sequence[torch.cuda.Stream]) -> None:
    """Run independent ``calls`` (each reading and writing only its own tensors, e.g. one layer's
    compression) forked over ``streams`` (round robin) and joined back to the current stream. Captured
    in a CUDA graph, the branches replay side by side: a layer's compression is a few short, latency-bound
    kernels, and one stream would run every layer's one after the other."""
    main = torch.cuda.current_stream()
    for s in {id(s): s for s in _branches(calls, streams)}.values():
        main.wait_stream(s)


# Compressions forked by ``fork_side_by_side`` and not yet awaited (K buffer address -> event): the dict
# the ``kvpass::await_compression`` op reads, which lives with the other ops (kvpass.kernels).
_PENDING = PENDING


# Streams for the compressions forked at a step's start. Each layer's attention waits for its own layer's
# compression, and the forked kernels run beside the step's first GEMVs. A one-in-one-out eviction (interval 1:
# every layer, every step, one entry a row) is short: on fewer streams the first layers' evictions meet less of
# the others' and finish sooner, and the rest still end long before their layers. Compiled D2O steps, 32k, H200
# (benchmarks/results/side-streams-in-step-*-nvidia-h200.json), ms a step on 1 / 2 / 8 streams: batch 1 4.744 /
# 4.780 / 4.815, batch 4 6.454 / 6.461 / 6.559, batch 8 7.620 / 7.614 / 7.734, batch 16 (2 / 4 / 8) 9.906 /
# 9.977 / 10.03; at batch 32 (runs that drifted with time) 8 streams were the fastest of each round. A
# compression of many entries a layer (interval > 1: every layer at one step in ``interval``) keeps ``most``
# (side_stream_branches.py: 1 stream took twice as long as 4-32 for all layers).
def forked_branches(batch: int, interval: int, most: int) -> int:
    """Side streams for a step's forked compressions of ``batch`` rows under a policy of ``interval``."""
    if interval > 1:
        return most
    return min(most, 1 if batch <= 4 else 2 if batch <= 16 else most)


def fork_side_by_side(calls: Sequence[tuple[Tensor, Callable[[], object]]],
                      streams: Sequence[torch.cuda.Stream]) -> None:
    """Like ``run_side_by_side``, but not joined: each (k_cache, call) runs on a side stream and records
    an event, which the decode graph waits for just before that layer writes its K, V
    (``await_compression``). So the compression of layer l overlaps the step's layers before l. Whatever
    is left pending is joined by ``join_pending`` (the step calls it after the graph)."""
    _PENDING.clear()                          # left by a failed capture, if any: every step joins its own
    for (k_cache, _), stream in zip(calls, _branches([c for _, c in calls], streams), strict=True):
        event = torch.cuda.Event()
        event.record(stream)
        _PENDING[k_cache.data_ptr()] = event


def join_pending() -> None:
    """The current stream waits for every compression still pending."""
    if _PENDING:
        main = torch.cuda.current_stream()
        for event in _PENDING.values():
            main.wait_event(event)
        _PENDING.clear()


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False
