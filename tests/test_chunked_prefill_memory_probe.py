"""benchmarks/probes/chunked_prefill_memory.py: its snapshot analysis on a small synthetic allocator trace, its
count of the working buffers against a real chunked prefill's, and its CPU smoke run (nothing recorded)."""

from __future__ import annotations

import json

import pytest
import torch

import kvpass
import kvpass.runtime.chunked_prefill as cp
from benchmarks.bench.models import TINY_LLAMA, build_model
from benchmarks.probes.chunked_prefill_memory import NO_STACK, analyse_snapshot, cache_buffer_bytes, main

PACKAGE = "/w/kvpass/kvpass"          # a checkout named like the package: its benchmarks/ are not "inside kvpass"


def fr(filename: str, line: int, name: str) -> dict:
    return {"filename": filename, "line": line, "name": name}


GRAPH_OP = [fr("<eval_with_key>.3", 10, "forward"), fr("/v/lib/python3.11/site-packages/torch/fx/graph_module.py", 5, "__call__"),
            fr(f"{PACKAGE}/runtime/chunked_prefill.py", 200, "step"),
            fr(f"{PACKAGE}/runtime/chunked_prefill.py", 380, "start_chunked")]
MERGE = [fr(f"{PACKAGE}/kernels/chunk_attention.py", 150, "merge_by_lse"),
         fr(f"{PACKAGE}/kernels/chunk_attention.py", 170, "chunk_attention_cuda")]
PROBE = [fr("/v/lib/python3.11/site-packages/torch/random.py", 1, "randint"), fr("/w/kvpass/benchmarks/probes/x.py", 5, "main")]


def snapshot() -> dict:
    """Blocks P (100 bytes, live throughout, no stack) and R (70, freed in the trace) predate it; Q (50) is
    allocated and freed, X (300) stays, Y (400) is freed again, Z (10) comes last. The peak: P R Q X Y = 920."""
    events = [
        {"action": "alloc", "addr": 200, "size": 50, "frames": MERGE},                  # Q        220
        {"action": "segment_alloc", "addr": 4096, "size": 4096, "frames": []},
        {"action": "alloc", "addr": 4096, "size": 300, "frames": GRAPH_OP},             # X        520
        {"action": "alloc", "addr": 4500, "size": 400, "frames": GRAPH_OP},             # Y        920: the peak
        {"action": "free_requested", "addr": 4500, "size": 400, "frames": GRAPH_OP},    #          520
        {"action": "free_completed", "addr": 4500, "size": 400, "frames": GRAPH_OP},
        {"action": "free_requested", "addr": 600, "size": 70, "frames": PROBE},         # R        450
        {"action": "free_requested", "addr": 200, "size": 50, "frames": MERGE},         # Q        400
        {"action": "alloc", "addr": 4500, "size": 10, "frames": PROBE},                 # Z        410
    ]
    blocks_a = [{"address": 0, "size": 512, "requested_size": 100, "state": "active_allocated", "frames": []},
                {"address": 512, "size": 1536, "requested_size": 0, "state": "inactive"}]
    blocks_b = [{"address": 4096, "size": 512, "requested_size": 300, "state": "active_allocated", "frames": GRAPH_OP},
                {"address": 4500, "size": 512, "requested_size": 10, "state": "active_allocated", "frames": PROBE},
                {"address": 5012, "size": 3180, "requested_size": 0, "state": "inactive"}]
    return {"segments": [{"device": 0, "address": 0, "total_size": 2048, "blocks": blocks_a},
                         {"device": 0, "address": 4096, "total_size": 4096, "blocks": blocks_b},
                         {"device": 1, "address": 0, "total_size": 1 << 20, "blocks": []}],
            "device_traces": [events, []]}


def line_text(filename: str, line: int) -> str | None:
    return "linear_3 = torch.ops.aten.linear.default(x, w);  x = None" if filename.startswith("<eval") else None


def test_analysis_finds_the_peak_and_groups_the_blocks_live_then():
    got = analyse_snapshot(snapshot(), PACKAGE, device=0, line_text=line_text)
    assert (got["events"], got["start_allocated"], got["final_allocated"], got["consistent"]) == (9, 170, 410, True)
    assert (got["peak_allocated"], got["peak_event"]) == (920, 3)
    assert (got["start_reserved"], got["reserved_at_peak"], got["peak_reserved"]) == (2048, 6144, 6144)
    assert got["live_at_peak"] == {"bytes": 920, "count": 5}
    rows = [(g["where"], g["caller"], g["bytes"], g["count"], g["largest"]) for g in got["groups"]]
    assert rows == [
        ("kvpass/runtime/chunked_prefill.py:200:step", "kvpass/runtime/chunked_prefill.py:380:start_chunked", 700, 2, 400),
        (NO_STACK, "", 100, 1, 100),
        ("(outside kvpass) benchmarks/probes/x.py:5:main", "", 70, 1, 70),
        ("kvpass/kernels/chunk_attention.py:150:merge_by_lse", "kvpass/kernels/chunk_attention.py:170:chunk_attention_cuda",
         50, 1, 50)]
    assert got["groups"][0]["sites"] == [{"site": "<eval_with_key>.3:10:forward | linear_3 = torch.ops.aten.linear"
                                                  ".default(x, w); x = None", "bytes": 700, "count": 2}]
    assert got["groups"][3]["sites"][0]["site"] == "kvpass/kernels/chunk_attention.py:150:merge_by_lse"
    assert [b["bytes"] for b in got["largest_blocks"]] == [400, 300, 100, 70, 50]
    assert got["peak_stack"][0].startswith("<eval_with_key>.3:10:forward") and len(got["peak_stack"]) == 4
    assert got["others"] == {"groups": 0, "bytes": 0, "count": 0}


def test_analysis_keeps_the_top_groups_and_sums_the_rest():
    got = analyse_snapshot(snapshot(), PACKAGE, top=2)
    assert [g["bytes"] for g in got["groups"]] == [700, 100]
    assert got["others"] == {"groups": 2, "bytes": 120, "count": 2}


def test_analysis_of_an_empty_or_other_device_trace():
    empty = analyse_snapshot({"segments": [], "device_traces": [[]]}, PACKAGE)
    assert (empty["peak_allocated"], empty["peak_event"], empty["groups"], empty["consistent"]) == (0, -1, [], True)
    other = analyse_snapshot(snapshot(), PACKAGE, device=1)               # no events: the start is the peak
    assert (other["events"], other["peak_allocated"], other["start_reserved"]) == (0, 0, 1 << 20)


@pytest.mark.parametrize("policy", ["d2o", "streamingllm"])
def test_cache_buffer_bytes_counts_the_working_buffers(monkeypatch, policy):
    """The probe's count (budget + interval + chunk slots a layer) against the buffers a chunked prefill really
    holds (each layer's budget + the largest chunk): they differ by the interval's slots alone."""
    torch.manual_seed(0)
    model = build_model(TINY_LLAMA, torch.device("cpu"), torch.float32)
    kv = kvpass.apply(model, policy=policy, budget=0.2)
    seen = []
    compress = cp._ChunkedPrefill.compress

    def spy(self):
        seen.append(sum(t.numel() * t.element_size() for c in self.caches
                        for t in (c.k, c.v, c.log_weight, c.position, *c.slot_meta.values())))
        compress(self)

    monkeypatch.setattr(cp._ChunkedPrefill, "compress", spy)
    ids = torch.randint(1, TINY_LLAMA["vocab_size"], (1, 160))
    kv.start(ids, max_new_tokens=6, prefill_chunk=32)
    slot = sum(s.n_kv_heads * (2 * s.head_dim * 4 + 4 + 8 + 4 * (policy == "d2o")) for s in kv.graphs.sites)
    assert len(seen) == 5 and len(set(seen)) == 1
    assert cache_buffer_bytes(kv, 160, 6, 32) - seen[0] == getattr(kv.policy, "interval", 1) * slot


def test_smoke_run_writes_every_phase(tmp_path):
    out = tmp_path / "probe.json"
    assert main(["--smoke", "--out", str(out), "--policies", "d2o,streamingllm", "--steps", "2"]) == 0
    result = json.loads(out.read_text())
    assert result["command"].endswith("--smoke --out " + str(out) + " --policies d2o,streamingllm --steps 2")
    assert [r["policy"] for r in result["rows"]] == ["d2o", "streamingllm"]
    for row in result["rows"]:
        assert row["cache_buffers_bytes"] > 0 and row["compressions"] > 0 and "remainder_bytes" not in row
        for phase in ("prefill", "decode"):
            assert row[phase]["analysis"]["events"] == 0 and row[phase]["peak_allocated"] is None
        assert len(row["decode"]["step_seconds"]) == 2
