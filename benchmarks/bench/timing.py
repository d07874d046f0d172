"""Timers and small helpers of the speed benchmark: deadlines, CUDA-graph replays timed by Triton's
``do_bench``, copy bandwidth, ``generate`` differences and stepped decoding (kvpass and transformers)."""

from __future__ import annotations

import gc
import platform
import re
import statistics
import time
import traceback
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


class Deadline:
    """A wall-clock budget: ``left()`` seconds remain; ``allows(est)`` if an item of ``est`` seconds fits."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def allows(self, estimate: float = 0.0) -> bool:
        return self.left() > estimate


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn: Callable[[], object], device: torch.device, graph: bool = True) -> float:
    """Median seconds of ``fn``. CUDA: captured in a CUDA graph (no launch overhead, as in the decode
    step) and timed by triton's do_bench (median, L2 flushed before each run). CPU: a few runs."""
    if device.type != "cuda":
        return median_of_fixed_runs(fn, device, warm=1, runs=3)
    from triton.testing import do_bench

    run = fn
    if graph:
        fn()                                                   # warm up (compiles) outside the capture
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        run = g.replay
    if _ranks() > 1:              # do_bench's run count follows this rank's clock: ranks would disagree
        return median_of_fixed_runs(run, device)
    ms = do_bench(run, warmup=10, rep=40, quantiles=[0.5])
    ms = ms[0] if isinstance(ms, (list, tuple)) else ms
    return float(ms) * 1e-3


def _ranks() -> int:
    """Processes of the default process group (1 outside torch.distributed)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def median_of_fixed_runs(fn: Callable[[], object], device: torch.device, warm: int = 5, runs: int = 25) -> float:
    """Median seconds of ``runs`` calls of ``fn`` after ``warm`` untimed ones: the same count on every rank,
    which a ``fn`` holding collectives needs (``do_bench`` sizes its runs from each rank's own first timing:
    timing D2O's compression, which all-gathers, at tp=4 on H200s, two ranks finished and two waited until
    killed). CUDA: each call between two events, L2 flushed before it as ``do_bench`` does."""
    for _ in range(warm):
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    flush = torch.empty(256 << 20, dtype=torch.int8, device=device)
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(runs)]
    for start, end in pairs:
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return statistics.median(start.elapsed_time(end) for start, end in pairs) * 1e-3


def time_graphed_or_eager(fn: Callable[[], object], device: torch.device) -> tuple[float, bool]:
    """``time_fn(fn)`` from a CUDA graph, or, where ``fn`` cannot be captured (it synchronises with the
    host, as Chelsea's compression does), timed eagerly with its launches. Returns (seconds, graphed)."""
    try:
        return time_fn(fn, device), device.type == "cuda"
    except RuntimeError:                        # a failed capture (torch.AcceleratorError is a RuntimeError)
        sync(device)
        return time_fn(fn, device, graph=False), False


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    if not bool(torch.isfinite(got).all()):
        return float("nan")
    return float((got - want).norm() / want.norm().clamp(min=1e-30))


def release_gpu_memory(device: torch.device) -> None:
    """On CUDA, give the GPU its memory back between rows: a full collection, then the allocator's cache emptied.
    Elsewhere nothing (a full collection takes seconds in a test process that keeps millions of objects)."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def gpu_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu-{platform.machine()}"


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def guarded(results: dict, name: str, fn: Callable[[], object]) -> None:
    """Run one section; record its output, or its exception, and its wall time."""
    t0 = time.monotonic()
    print(f"[bench] section {name} ...", flush=True)
    try:
        results[name] = fn()
    except Exception as exc:  # noqa: BLE001  (any failure of one section must not stop the others)
        results.setdefault("errors", {})[name] = "".join(traceback.format_exception(exc))[-4000:]
        print(f"[bench] section {name} FAILED: {exc!r}", flush=True)
    results.setdefault("section_seconds", {})[name] = round(time.monotonic() - t0, 2)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes/s of a device-to-device copy (counting bytes read + bytes written)."""
    n = nbytes // 2
    src = torch.randn(n, device=device, dtype=torch.float32).to(torch.bfloat16)
    dst = torch.empty_like(src)
    t = time_fn(lambda: dst.copy_(src), device, graph=False)
    return 2 * src.numel() * src.element_size() / t


def timed(device: torch.device, fn: Callable[[], object]) -> float:
    return timed_call(device, fn)[0]


def timed_call(device: torch.device, fn: Callable[[], T]) -> tuple[float, T]:
    """(wall seconds of ``fn()``, synchronised with the device before and after, its result)."""
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t0, out


def measure_generate(device, gen: Callable[[int], object], n1: int, n2: int, warm: Callable[[], object]) -> dict:
    """TTFT (generate 1 token: the median of 3, so the first call at the prompt's length, which builds
    plans and grows the allocator, does not decide it), time per output token (difference of n2 and n1
    tokens), peak memory. ``warm`` runs first on a short prompt (Triton compilation, cuBLAS handles)."""
    warm()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    ttft = statistics.median(timed(device, lambda: gen(1)) for _ in range(3))
    t1 = timed(device, lambda: gen(n1))
    t2 = timed(device, lambda: gen(n2))
    tpot = max(t2 - t1, 1e-9) / (n2 - n1)
    out = {"ttft_s": ttft, "tpot_ms": tpot * 1e3, "decode_tokens_per_s": 1.0 / tpot,
           "tokens_per_s_n2": n2 / t2}
    if device.type == "cuda":
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return out


def greedy_step_seconds(step: Callable[[torch.Tensor], torch.Tensor], tok: torch.Tensor, device: torch.device,
                         warm: int, steps: int) -> float:
    """Mean seconds of ``tok = step(tok)`` over ``steps`` synchronised steps, after ``warm`` untimed ones."""
    for _ in range(warm):
        tok = step(tok)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        tok = step(tok)
    sync(device)
    return (time.perf_counter() - t0) / steps


def stepped_tpot(kv, ids: torch.Tensor, device: torch.device, warm: int = 8, steps: int = 48) -> dict:
    """kvpass's time per output token without prefill noise: after ``start`` (its wall seconds: ``start_s``, the
    prefill, prompt compression and first logits of the batch; the cache bytes then: ``start_cache_bytes``),
    ``warm`` steps (CUDA
    graph captures, the first compressions), then the mean of ``steps`` timed steps (greedy tokens).
    A policy compressing every ``interval`` > 1 steps gets ``interval`` more warm-up steps (its first
    compression and that step's graph capture) and at least 2 x ``interval`` timed steps, so the timed
    steps hold whole periods. Then, for a compressing policy, one decode-time compression of every
    compressed layer (``DecodeSession.compress_layers``, what the steps run) timed on its own from a
    CUDA graph: before each timed call every layer's lengths are set back to its capacity (a full
    buffer, as when a step compresses), else every call after the first would find nothing to evict;
    that re-arming is timed alone and subtracted. ``memory`` (CUDA; None elsewhere): the peak allocated bytes up to the
    end of ``start`` (the caller's reset onwards), after it, the peak of the steps, and of the compression's timing
    (each phase's peak is reset before it; the caller's overall peak is their max)."""
    interval = getattr(kv.policy, "interval", 1) if kv.policy.compresses else 1
    if interval > 1:
        warm, steps = warm + interval, max(steps, 2 * interval)
    start_s, session = timed_call(device, lambda: kv.start(ids, max_new_tokens=warm + steps))
    start_cache_bytes = session.report().cache_bytes     # as ``generate(max_new_tokens=1)``'s: the prompt compressed
    memory = {"start_peak_bytes": _peak_bytes(device, reset=True), "start_allocated_bytes": _allocated_bytes(device)}
    tpot = greedy_step_seconds(lambda tok: session.step(tok).argmax(-1), session.logits.argmax(-1), device,
                                warm, steps)
    memory["steps_peak_bytes"] = _peak_bytes(device)
    out = {"tpot_ms": tpot * 1e3, "decode_tokens_per_s": ids.shape[0] / tpot, "tpot_method": f"{steps} stepped tokens",
           "interval": interval, "start_s": start_s, "start_cache_bytes": start_cache_bytes, "memory": memory}
    due = [i for i, lay in enumerate(session.layers) if lay.compressible]
    layers = [session.layers[i] for i in due]
    if layers:
        def arm() -> None:
            for lay in layers:
                lay.cache.length.fill_(lay.cache.capacity)

        def compress_all() -> None:                                     # as a step does: side by side on CUDA
            arm()
            session.compress_layers(due)

        seconds, graphed = time_graphed_or_eager(compress_all, device)   # the step runs it eagerly too where not graphed
        arm_seconds = time_fn(arm, device, graph=graphed)
        ms = max(seconds - arm_seconds, 0.0) * 1e3
        how = "CUDA graph" if graphed else "eager (capture failed)" if device.type == "cuda" else "eager"
        out.update(decode_compress_ms=ms, decode_compress_frac_of_tpot=ms / interval / out["tpot_ms"],
                   decode_compress_timed=how)
        memory["compress_timing_peak_bytes"] = _peak_bytes(device)
    return out


def _peak_bytes(device: torch.device, reset: bool = False) -> int | None:
    """CUDA's peak allocated bytes since the last reset (then reset it when ``reset``); None off CUDA."""
    if device.type != "cuda":
        return None
    peak = torch.cuda.max_memory_allocated(device)
    if reset:
        torch.cuda.reset_peak_memory_stats(device)
    return peak


def _allocated_bytes(device: torch.device) -> int | None:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def transformers_stepped_tpot(model, ids: torch.Tensor, device: torch.device, warm: int = 8, steps: int = 48) -> float:
    """Plain transformers' ms per output token without ``generate`` or prefill noise: the model's own
    forward and its own cache (greedy), ``warm`` steps, then the mean of ``steps`` timed steps. (The
    ``generate`` difference of two lengths swings between runs: 30 to 100 ms at 32k on one H100.)"""
    with torch.no_grad():
        out = model(ids, use_cache=True, logits_to_keep=1)
        cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        del out

        def step(tok: torch.Tensor) -> torch.Tensor:
            return model(tok, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)

        return greedy_step_seconds(step, tok, device, warm, steps) * 1e3

