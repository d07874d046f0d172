"""Where chunked prefill's peak GPU memory goes (issue 29): the allocator's own record of every block live at
the peak, grouped by the kvpass code that allocated it.

    export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
    python benchmarks/probes/chunked_prefill_memory.py                    # -> $OUT/chunked-prefill-memory-<gpu>.json
    python benchmarks/probes/chunked_prefill_memory.py --smoke --out /tmp/m.json   # CPU, tiny model, no record

The model of ``benchmarks/chunked_prefill_gpu.py`` (Llama-3.1-8B shape, random bf16 weights, its ``build_model``),
batch 1, a prompt of ``--tokens`` (131072) random ids prefilled ``--chunk`` (4096) tokens at a time at budget
``--budget`` (0.2), then decoded ``--steps`` (20) greedy steps twice, per policy of ``--policies``
(d2o,streamingllm), each after a warm-up session of two chunks and as many steps (Triton compilation, and
Inductor's with ``--compile on``, the benchmark's setting: the default ``off`` decodes the eager graph under the
same CUDA-graph captures and saves ~90 s). Two recorded phases per policy, each with the peak counter reset
and the allocator's history (``torch.cuda.memory._record_memory_history``, Python stacks only) cleared before it:

* ``prefill``: ``KVPassModel.start`` (every chunk, every compression between chunks, the caches handed to decode);
* ``decode``: ``--steps`` steps, their CUDA-graph captures included (a step that compresses is captured: d2o
  compresses every step, streamingllm every 16). Until 5f72353 (2026-11-25) a capture's warm-up saved a copy of
  every cache tensor for a compressing step (the decode peak was weights + 2x the compressed cache); now its run is
  the step and nothing is saved (kvpass/decode_step.py).

Per phase: ``peak_allocated`` (``torch.cuda.max_memory_allocated``), the seconds of each step (synchronised), and
``analysis``: ``analyse_snapshot`` of the phase's snapshot, which replays the device trace (alloc and free events,
segment events for the reserved bytes) from the blocks live when the phase began, finds the event at which the
allocated bytes peaked and groups the blocks live then by the first stack frame inside kvpass/ (file:line:function)
and the frame above it, with bytes and counts, biggest first, and inside each group by the innermost kvpass or
generated (FX graph, Inductor) frame with its source line. Per policy also ``weights_bytes``,
``cache_buffers_bytes`` (what the chunked prefill's working buffers hold: every attention site's budget +
interval + chunk slots of K, V, log-weight, position and the policy's per-slot statistics, from the model),
``remainder_bytes`` = prefill peak - allocated before the prefill - cache buffers (the transients), and
``peak_over_full_cache`` as the benchmark computes it. Rows are written after each policy; no policy starts after
``--time-limit`` seconds.
"""

from __future__ import annotations

import argparse
import json
import linecache
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import kvpass  # noqa: E402
from benchmarks.bench.models import LLAMA_8B, TINY_LLAMA  # noqa: E402
from benchmarks.bench.timing import release_gpu_memory  # noqa: E402
from benchmarks.chunked_prefill_gpu import build_model, full_cache_bytes  # noqa: E402
from kvpass.budget import budget_tokens  # noqa: E402
from kvpass.rewrites import capture_model  # noqa: E402
from kvpass.rewrites.chunk_step import chunk_stats  # noqa: E402

GiB = 2**30
# files whose frames are generated code: an FX GraphModule's forward, Inductor's output code
GENERATED = ("<eval_with_key>", "fx_generated_", "torchinductor")
NO_STACK = "<no stack: allocated before recording>"


# --------------------------------------------------------------------------------------- analysis (pure)
def _short(filename: str, root: str) -> str:
    """A frame's file relative to the repository root, or after site-packages/, else as it is."""
    if root and filename.startswith(root.rstrip("/") + "/"):
        return filename[len(root.rstrip("/")) + 1:]
    if "site-packages/" in filename:
        return filename.split("site-packages/", 1)[1]
    return filename


def _frame(frame: dict, root: str) -> str:
    return f"{_short(frame['filename'], root)}:{frame['line']}:{frame['name']}"


def _inside(frame: dict, package_dir: str) -> bool:
    return frame["filename"].startswith(package_dir.rstrip("/") + "/")


def _generated(frame: dict) -> bool:
    return any(g in frame["filename"] for g in GENERATED)


def _library(frame: dict) -> bool:
    return "site-packages/" in frame["filename"] or "/lib/python" in frame["filename"]


def block_group(frames: list[dict], package_dir: str, root: str) -> tuple[str, str]:
    """(where, caller) of an allocation with stack ``frames`` (innermost first): the first frame inside
    ``package_dir`` and the frame above it (its caller); an allocation outside it: the innermost frame outside
    the Python libraries, marked "(outside kvpass)"; none recorded: ``NO_STACK``."""
    if not frames:
        return NO_STACK, ""
    for i, fr in enumerate(frames):
        if _inside(fr, package_dir):
            return _frame(fr, root), (_frame(frames[i + 1], root) if i + 1 < len(frames) else "")
    for i, fr in enumerate(frames):
        if not _library(fr) and not _generated(fr):
            return "(outside kvpass) " + _frame(fr, root), (_frame(frames[i + 1], root) if i + 1 < len(frames) else "")
    return "(outside kvpass) " + _frame(frames[0], root), ""


def block_site(frames: list[dict], package_dir: str, root: str,
               line_text: Callable[[str, int], str | None] | None = None) -> str:
    """The innermost frame of ``frames`` that is kvpass's or generated code (an FX graph's op, an Inductor
    kernel call), with its source line where ``line_text`` finds it (and the FX node where the snapshot was
    augmented with it); else the innermost frame."""
    if not frames:
        return NO_STACK
    pick = next((fr for fr in frames if _inside(fr, package_dir) or _generated(fr)), frames[0])
    text = _frame(pick, root)
    if pick.get("fx_node_name"):
        text += f" [{pick['fx_node_name']}]"
    line = line_text(pick["filename"], pick["line"]) if line_text is not None else None
    if line:
        text += " | " + " ".join(line.split())[:160]
    return text


def analyse_snapshot(snapshot: dict, package_dir: str, device: int = 0, top: int = 30, sites: int = 6,
                     line_text: Callable[[str, int], str | None] | None = None) -> dict:
    """The peak of allocated bytes in ``snapshot`` (``torch.cuda.memory._snapshot()``) and the blocks live then.

    Replays ``snapshot["device_traces"][device]`` (each event's stack frames innermost first): "alloc" adds a
    block, "free_requested" removes it (the allocator's allocated-bytes counter drops there; "free_completed"
    only hands the memory back to its cache), "segment_alloc"/"segment_map" and "segment_free"/"segment_unmap"
    move the reserved bytes. The blocks live before the first event are those the trace frees without
    allocating them and those live at the end ("active_allocated" blocks of ``snapshot["segments"]``) that it
    never allocates; they count from the start. Sizes are requested bytes (the trace's; torch's own counter
    counts blocks, rounded up to 512 bytes).

    Returns {"events", "start_allocated", "final_allocated", "consistent" (the replay ends at what the segments
    hold), "peak_allocated", "peak_event" (its index; -1: the start was the peak), "start_reserved",
    "reserved_at_peak", "peak_reserved", "live_at_peak": {"bytes", "count"}, "groups": [{"where", "caller",
    "bytes", "count", "largest", "sites": [{"site", "bytes", "count"}, ...]}, ...] (``block_group``; biggest
    first, ``top`` of them, the rest summed in "others"; each group's ``sites`` biggest ``block_site``s),
    "largest_blocks": [{"bytes", "where", "site"}, ...] (10), "peak_stack": [the frames of the event that made
    the peak, innermost first]}. ``package_dir``: the kvpass package's directory (its frames group the blocks;
    paths are shown relative to its parent)."""
    root = str(Path(package_dir).parent)
    traces = snapshot.get("device_traces", [])
    trace = list(traces[device]) if device < len(traces) else []
    end_live: dict[int, tuple[int, list[dict]]] = {}
    final_reserved = 0
    for seg in snapshot.get("segments", []):
        if seg.get("device", device) != device:
            continue
        final_reserved += seg["total_size"]
        for blk in seg.get("blocks", []):
            if blk["state"] == "active_allocated":
                end_live[blk["address"]] = (blk.get("requested_size", blk["size"]), blk.get("frames", []))

    # the blocks live before the first event, and the reserved bytes then
    start_live: dict[int, tuple[int, list[dict]]] = {}
    allocated_in_trace: set[int] = set()
    segments_net = 0
    for e in trace:
        action = e["action"]
        if action == "alloc":
            allocated_in_trace.add(e["addr"])
        elif action == "free_requested":
            if e["addr"] in allocated_in_trace:
                allocated_in_trace.discard(e["addr"])
            else:
                start_live[e["addr"]] = (e["size"], e.get("frames", []))
        elif action in ("segment_alloc", "segment_map"):
            segments_net += e["size"]
        elif action in ("segment_free", "segment_unmap"):
            segments_net -= e["size"]
    for addr, blk in end_live.items():
        if addr not in allocated_in_trace and addr not in start_live:
            start_live[addr] = blk
    start = sum(size for size, _ in start_live.values())
    start_reserved = final_reserved - segments_net

    # the replay: the peak and where it happened
    sizes = {addr: size for addr, (size, _) in start_live.items()}
    allocated, reserved = start, start_reserved
    peak, peak_at, reserved_at_peak, peak_reserved = start, -1, start_reserved, start_reserved
    for i, e in enumerate(trace):
        action = e["action"]
        if action == "alloc":
            sizes[e["addr"]] = e["size"]
            allocated += e["size"]
            if allocated > peak:
                peak, peak_at, reserved_at_peak = allocated, i, reserved
        elif action == "free_requested":
            allocated -= sizes.pop(e["addr"], 0)
        elif action in ("segment_alloc", "segment_map"):
            reserved += e["size"]
            peak_reserved = max(peak_reserved, reserved)
        elif action in ("segment_free", "segment_unmap"):
            reserved -= e["size"]
    final = sum(size for size, _ in end_live.values())

    # the blocks live at the peak, grouped
    live = dict(start_live)
    for e in trace[:peak_at + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], e.get("frames", []))
        elif e["action"] == "free_requested":
            live.pop(e["addr"], None)
    groups: dict[tuple[str, str], dict] = {}
    blocks = []
    for size, frames in live.values():
        where, caller = block_group(frames, package_dir, root)
        site = block_site(frames, package_dir, root, line_text)
        g = groups.setdefault((where, caller), {"where": where, "caller": caller, "bytes": 0, "count": 0,
                                                "largest": 0, "sites": {}})
        g["bytes"] += size
        g["count"] += 1
        g["largest"] = max(g["largest"], size)
        s = g["sites"].setdefault(site, {"site": site, "bytes": 0, "count": 0})
        s["bytes"] += size
        s["count"] += 1
        blocks.append({"bytes": size, "where": where, "site": site})
    ranked = sorted(groups.values(), key=lambda g: (-g["bytes"], g["where"], g["caller"]))
    for g in ranked:
        g["sites"] = sorted(g["sites"].values(), key=lambda s: (-s["bytes"], s["site"]))[:sites]
    rest = ranked[top:]
    peak_frames = trace[peak_at].get("frames", []) if peak_at >= 0 else []
    return {
        "events": len(trace), "start_allocated": start, "final_allocated": final, "consistent": allocated == final,
        "peak_allocated": peak, "peak_event": peak_at, "start_reserved": start_reserved,
        "reserved_at_peak": reserved_at_peak, "peak_reserved": peak_reserved,
        "live_at_peak": {"bytes": sum(size for size, _ in live.values()), "count": len(live)},
        "groups": ranked[:top],
        "others": {"groups": len(rest), "bytes": sum(g["bytes"] for g in rest), "count": sum(g["count"] for g in rest)},
        "largest_blocks": sorted(blocks, key=lambda b: (-b["bytes"], b["where"], b["site"]))[:10],
        "peak_stack": [block_site([fr], package_dir, root, line_text) for fr in peak_frames[:30]],
    }


# --------------------------------------------------------------------------------------- the model's numbers
def cache_buffer_bytes(kv, tokens: int, new: int, chunk: int, batch: int = 1) -> int:
    """Bytes of the chunked prefill's working buffers, from the model: every attention site's budget + interval +
    chunk slots (the whole prompt + new tokens for a policy that keeps every token), each slot holding K and V
    (the model's dtype), a log-weight (fp32), a position (int64) and the policy's per-slot statistics (fp32)
    per KV head. D2O's layer budgets differ but add up to the layers times the budget."""
    policy, total = kv.policy, tokens + new
    slots = budget_tokens(kv.budget, total) + getattr(policy, "interval", 1) + chunk if policy.compresses else total
    elem = next(kv.model.parameters()).element_size()
    per_head = lambda s: 2 * s.head_dim * elem + 4 + 8 + 4 * len(chunk_stats(policy))    # noqa: E731
    return sum(batch * s.n_kv_heads * per_head(s) * slots for s in kv.graphs.sites)


def generated_line(filename: str, line: int) -> str | None:
    """The source line of a frame (FX graphs register theirs with linecache; Inductor's are files)."""
    return linecache.getline(filename, line).strip() or None


# --------------------------------------------------------------------------------------- the run
class Recorder:
    """The allocator's history on CUDA (cleared at each ``begin``); on the CPU (``--smoke``) an empty one."""

    def __init__(self, device: torch.device, max_entries: int) -> None:
        self.cuda, self.max_entries = device.type == "cuda", max_entries
        self.device = device

    def begin(self) -> None:
        if not self.cuda:
            return
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        try:
            torch.cuda.memory._record_memory_history("all", context="alloc", stacks="python",
                                                     max_entries=self.max_entries, clear_history=True)
        except TypeError:                              # an older torch: no clear_history; stop and start again
            torch.cuda.memory._record_memory_history(None)
            torch.cuda.memory._record_memory_history("all", context="alloc", stacks="python",
                                                     max_entries=self.max_entries)

    def end(self) -> tuple[dict, int | None]:
        """(the snapshot, the peak allocated bytes since ``begin``)."""
        if not self.cuda:
            return {"segments": [], "device_traces": [[]]}, None
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        snap = torch.cuda.memory._snapshot()
        return snap, peak

    def stop(self) -> None:
        if self.cuda:
            torch.cuda.memory._record_memory_history(None)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _allocated(device: torch.device) -> int | None:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def _steps(session, tok: torch.Tensor, n: int, device: torch.device) -> tuple[torch.Tensor, list[float]]:
    seconds = []
    for _ in range(n):
        _sync(device)
        t0 = time.perf_counter()
        tok = session.step(tok).argmax(-1)
        _sync(device)
        seconds.append(round(time.perf_counter() - t0, 4))
    return tok, seconds


def _phase(recorder: Recorder, device: torch.device, weights: int, full: int, run: Callable[[], object],
           top: int) -> tuple[dict, object]:
    """Run ``run`` between ``recorder.begin`` and ``end``: (its row, what it returned)."""
    before = _allocated(device)
    recorder.begin()
    t0 = time.perf_counter()
    got = run()
    seconds = time.perf_counter() - t0
    snap, peak = recorder.end()
    t1 = time.perf_counter()
    analysis = analyse_snapshot(snap, str(Path(kvpass.__file__).parent), device.index or 0, top=top,
                                line_text=generated_line)
    del snap
    row = {"seconds": round(seconds, 3), "analysis_seconds": round(time.perf_counter() - t1, 2),
           "allocated_before": before, "peak_allocated": peak,
           "peak_over_full_cache": None if peak is None else round((peak - weights) / full, 4),
           "trace_may_be_cut": analysis["events"] >= recorder.max_entries, "analysis": analysis}
    return row, got


def run_policy(model, captured, policy: str, args, device: torch.device, recorder: Recorder, weights: int) -> dict:
    """Warm-up session, then the recorded prefill and decode phases of one policy."""
    kv = kvpass.apply(model, policy, args.budget, captured=captured, compile=args.compile)
    vocab = model.config.vocab_size
    new = 2 * args.steps + 2
    short = torch.randint(1, vocab, (1, 2 * args.chunk + 17), generator=torch.Generator().manual_seed(1)).to(device)
    t0 = time.perf_counter()
    warm = kv.start(short, max_new_tokens=new, prefill_chunk=args.chunk)
    _steps(warm, warm.logits.argmax(-1), 2 * args.steps, device)
    del warm
    warm_seconds = time.perf_counter() - t0
    release_gpu_memory(device)
    ids = torch.randint(1, vocab, (1, args.tokens), generator=torch.Generator().manual_seed(args.tokens)).to(device)
    full = full_cache_bytes(model.config, 1, args.tokens + new, next(model.parameters()).element_size())
    buffers = cache_buffer_bytes(kv, args.tokens, new, args.chunk)
    row = {"policy": policy, "tokens": args.tokens, "chunk": args.chunk, "budget": args.budget,
           "new_tokens": new, "warmup_seconds": round(warm_seconds, 1), "weights_bytes": weights,
           "full_cache_bytes": full, "cache_buffers_bytes": buffers,
           "cache_buffers_over_full_cache": round(buffers / full, 4),
           "chunk_kv_outputs_bytes": 2 * sum(s.n_kv_heads * s.head_dim for s in kv.graphs.sites) * args.chunk
           * next(model.parameters()).element_size()}
    allocated = _allocated(device)
    row["resident_before_bytes"] = None if allocated is None else allocated - weights   # besides the weights

    prefill, session = _phase(recorder, device, weights, full,
                              lambda: kv.start(ids, max_new_tokens=new, prefill_chunk=args.chunk), args.top)
    row["prefill"] = prefill
    if prefill["peak_allocated"] is not None:
        row["remainder_bytes"] = prefill["peak_allocated"] - prefill["allocated_before"] - buffers
        row["remainder_over_full_cache"] = round(row["remainder_bytes"] / full, 4)
    tok = session.logits.argmax(-1)

    decode, (tok, seconds) = _phase(recorder, device, weights, full,
                                    lambda: _steps(session, tok, args.steps, device), args.top)
    decode["step_seconds"] = seconds
    row["decode"] = decode
    report = session.report()
    row["cache_bytes_after"] = report.cache_bytes
    row["peak_entries_max"] = max(report.peak_entries.values())
    row["compressions"] = report.compressions
    if args.compile:                                   # Inductor's count of mutated inputs it could not reuse
        from torch._dynamo.utils import counters

        row["inductor_reinplace_counters"] = {k: v for k, v in counters.get("inductor", {}).items() if "reinplac" in k}
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="the JSON file (default $OUT/chunked-prefill-memory-<gpu>.json)")
    p.add_argument("--tokens", type=int, default=None, help="prompt tokens (default 131072; --smoke 160)")
    p.add_argument("--chunk", type=int, default=None, help="prefill_chunk (default 4096; --smoke 32)")
    p.add_argument("--budget", type=float, default=0.2)
    p.add_argument("--policies", default="d2o,streamingllm", help="comma-separated policy specs")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default the 8B model's 32)")
    p.add_argument("--steps", type=int, default=20,
                   help="decode steps per decode phase (20: streamingllm's interval of 16 brings a compressing step)")
    p.add_argument("--compile", choices=("on", "off"), default="off",
                   help="Inductor's decode step, as the benchmark's (default off: the same CUDA-graph captures "
                        "without its ~90 s of compilation; --smoke off)")
    p.add_argument("--max-entries", type=int, default=3_000_000, help="allocator history entries kept")
    p.add_argument("--top", type=int, default=30, help="groups listed per phase")
    p.add_argument("--time-limit", type=float, default=150.0, help="start no policy after this many seconds")
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU, nothing recorded (tests the script)")
    args = p.parse_args(argv)
    began = time.monotonic()
    if args.smoke:
        device, dtype, shape = torch.device("cpu"), torch.float32, dict(TINY_LLAMA)
        args.tokens, args.chunk, args.compile = args.tokens or 160, args.chunk or 32, False
    else:
        if not torch.cuda.is_available():
            p.error("needs a CUDA device (or --smoke)")
        device, dtype, shape = torch.device("cuda", torch.cuda.current_device()), torch.bfloat16, dict(LLAMA_8B)
        args.tokens, args.chunk, args.compile = args.tokens or 131072, args.chunk or 4096, args.compile == "on"
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    out = Path(args.out) if args.out else (Path(os.environ.get("OUT", ".")) /
                                           f"chunked-prefill-memory-{gpu.lower().replace(' ', '-')}.json")
    model = build_model(shape, device, dtype, args.tokens + 2 * args.steps + 16)
    captured = capture_model(model)
    weights = sum(t.numel() * t.element_size() for t in model.parameters())
    recorder = Recorder(device, args.max_entries)
    result = {"what": "chunked prefill (issue 29): the blocks live at the peak of each phase, by kvpass frame",
              "command": "python benchmarks/probes/chunked_prefill_memory.py "
              + " ".join(sys.argv[1:] if argv is None else argv),
              "device": gpu, "torch": torch.__version__, "dtype": str(dtype),
              "model": ("tiny Llama" if args.smoke else "Llama-3.1-8B-shaped, random weights")
              + f", {shape['num_hidden_layers']} layers",
              "tokens": args.tokens, "chunk": args.chunk, "budget": args.budget, "compile": args.compile,
              "weights_bytes": weights, "rows": []}
    for policy in [s.strip() for s in args.policies.split(",") if s.strip()]:
        if time.monotonic() - began > args.time_limit:
            result["rows"].append({"policy": policy, "skipped": f"time limit of {args.time_limit:.0f} s reached"})
            continue
        row = run_policy(model, captured, policy, args, device, recorder, weights)
        recorder.stop()
        result["rows"].append(row)
        result["seconds"] = round(time.monotonic() - began, 1)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        print(json.dumps(summary(row)), flush=True)
        release_gpu_memory(device)
    result["seconds"] = round(time.monotonic() - began, 1)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {out} ({result['seconds']} s)")
    return 0


def summary(row: dict) -> dict:
    """The row's headline numbers (GiB) and each phase's three biggest groups, for the log."""
    def gib(x):
        return None if x is None else round(x / GiB, 3)

    out = {"policy": row["policy"], "cache_buffers_gib": gib(row["cache_buffers_bytes"]),
           "remainder_gib": gib(row.get("remainder_bytes"))}
    for phase in ("prefill", "decode"):
        if phase in row:
            r = row[phase]
            out[phase] = {"peak_gib": gib(r["peak_allocated"]), "over_full": r["peak_over_full_cache"],
                          "top": [(g["where"], gib(g["bytes"])) for g in r["analysis"]["groups"][:3]]}
    return out


if __name__ == "__main__":
    raise SystemExit(main())
