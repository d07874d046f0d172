"""The tensor-parallel benchmark's CPU path (benchmarks/bench/tp.py, benchmarks/tp_gpu.py) at tiny shapes:
``torchrun --nproc-per-node 2`` with gloo; and the CLI's --tp refusal outside torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kvpass.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]


def test_tp_gpu_script_runs_on_cpu_with_gloo(tmp_path: Path) -> None:
    env = {**os.environ, "KVPASS_TP_CPU": "1", "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "benchmarks" / "tp_gpu.py"), "--smoke", "--out", str(tmp_path),
           "--sections", "correctness,8b", "--methods", "d2o"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(next(tmp_path.glob("tp-*-x2-correctness-8b.json")).read_text())
    assert results["world"] == 2 and not results["errors"]
    assert results["correctness"]["tokens_equal"] is True
    rows = results["rows"]
    assert {(r["tp"], r["batch"]) for r in rows} == {(1, 1), (1, 2), (2, 1), (2, 2)}
    by_tp = {r["tp"]: r for r in rows if r["batch"] == 1}
    # each rank holds half the projection weights and half the KV heads' cache (per-row policy state, a few
    # bytes, is whole on every rank)
    assert by_tp[2]["weight_bytes_per_rank"] < by_tp[1]["weight_bytes_per_rank"]
    assert 0.5 <= by_tp[2]["cache_bytes_per_rank"] / by_tp[1]["cache_bytes_per_rank"] < 0.51
    assert all(r["tpot_ms"] > 0 and r["ttft_s"] > 0 and r["floor_ms"] > 0 for r in rows)
    # a batch's row (its TTFT and cache bytes from the stepped decode's start) holds every row's cache
    for r in rows:
        if r["batch"] == 2:
            assert 1.9 < r["cache_bytes_per_rank"] / by_tp[r["tp"]]["cache_bytes_per_rank"] < 2.1


def test_cli_tp_outside_torchrun_is_refused(capsys, monkeypatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    assert cli_main(["generate", "--tp", "2"]) == 2
    assert "torchrun --nproc-per-node 2" in capsys.readouterr().err


def test_model_of_views_holds_no_weight_until_copied() -> None:
    """The 70B section's model (benchmarks/bench/models.py): weights are views of small random vectors (a few
    bytes a matrix) until copied, and once copied it computes what an ordinary model of those weights does."""
    import torch

    from benchmarks.bench.models import TINY_LLAMA, build_model, build_model_of_views, materialise_views

    views = build_model_of_views(TINY_LLAMA, torch.device("cpu"), torch.float32, seed=3)
    logical = sum(p.numel() * p.element_size() for p in views.parameters())
    held = sum(p.untyped_storage().nbytes() for p in views.parameters())
    assert held < logical / 10
    w = views.model.layers[0].mlp.up_proj.weight
    assert torch.equal(w[1, :-1], w[0, 1:]) and w.std() > 0          # W[i, j] = s[i + j], random
    ids = torch.randint(1, TINY_LLAMA["vocab_size"], (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = views(ids).logits
    assert materialise_views(views) == logical - sum(p.numel() * 4 for p in views.parameters() if p.dim() == 1)
    assert all(p.is_contiguous() and p.untyped_storage().nbytes() == p.numel() * 4 for p in views.parameters())
    plain = build_model(TINY_LLAMA, torch.device("cpu"), torch.float32)
    plain.load_state_dict(views.state_dict())
    with torch.no_grad():
        # fp32 tolerances, not bitwise: with more than one thread the matmul's sums follow the weight's layout
        # (a view's contiguous temporary against the copy), ~1e-7 apart at 2 threads
        torch.testing.assert_close(views(ids).logits, before)
        torch.testing.assert_close(plain(ids).logits, before)


def _counting(sleeps: list[float]):
    calls = []

    def fn() -> None:
        import time
        time.sleep(sleeps[len(calls) % len(sleeps)])
        calls.append(1)
    return fn, calls


def test_fixed_runs_call_the_same_number_of_times_however_slow() -> None:
    """Under tp every rank must call a timed function holding collectives equally often (do_bench's count
    follows the rank's own clock: at tp=4 two ranks finished D2O's compression timing and two hung)."""
    import torch

    from benchmarks.bench.timing import median_of_fixed_runs

    counts = []
    for sleeps in ([0.0], [0.004, 0.0]):
        fn, calls = _counting(sleeps)
        seconds = median_of_fixed_runs(fn, torch.device("cpu"), warm=2, runs=7)
        counts.append(len(calls))
        assert seconds >= 0.0
    assert counts == [9, 9]


def test_time_fn_under_tp_takes_the_fixed_count(monkeypatch) -> None:
    import pytest
    import torch

    from benchmarks.bench import timing

    if not torch.cuda.is_available():
        pytest.skip("the CUDA branch of time_fn (CPU timing is a fixed count already)")
    monkeypatch.setattr(timing, "_ranks", lambda: 2)
    fn, calls = _counting([0.0])
    timing.time_fn(fn, torch.device("cuda"), graph=False)
    assert len(calls) == 5 + 25


def test_rows_that_fit_take_a_row_as_its_cache_past_batch_2() -> None:
    from benchmarks.bench.tp import rows_that_fit

    gib = 2**30
    one = {"peak_memory_gib": 13.0, "cache_bytes_per_rank": 0.5 * gib}
    two = {"peak_memory_gib": 14.0, "cache_bytes_per_rank": 1.0 * gib}
    fits, per_row = rows_that_fit(one, two, 100 * gib, 0.9)
    assert per_row == 0.5 * gib and fits == 2 + 152   # (90 - 14) GiB left at 0.5 GiB a row
    fits, _ = rows_that_fit(one, {**two, "peak_memory_gib": 95.0}, 100 * gib, 0.9)
    assert fits == 1                                   # batch 2 is already past the fill


def test_batch_in_time_is_the_largest_whose_estimate_fits() -> None:
    from benchmarks.bench.tp import batch_in_time

    # (batch + 1) x 2 s of prefills + 100 s: batch 49 needs exactly 200 s, batch 50 would need 202
    assert batch_in_time(200.0, 2.0, 100.0) == 49
    assert batch_in_time(201.9, 2.0, 100.0) == 49
    assert batch_in_time(202.0, 2.0, 100.0) == 50
    assert batch_in_time(50.0, 2.0, 100.0) == 0        # not even the fixed part fits
