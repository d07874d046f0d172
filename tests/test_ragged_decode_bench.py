"""The ragged-batch decode benchmark's token comparison (benchmarks/ragged_decode_gpu.py) and its CPU smoke mode."""

from __future__ import annotations

import json

import torch

from benchmarks.ragged_decode_gpu import first_difference, main


def test_first_difference_names_the_step_the_rows_and_the_margins_before_it():
    a = [torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6]), torch.tensor([7, 8, 9])]
    b = [torch.tensor([1, 2, 3]), torch.tensor([4, 0, 6]), torch.tensor([0, 8, 0])]
    margins_a = [torch.tensor([0.5, 0.0, 1.0]), torch.tensor([0.1, 0.2, 0.3]), torch.tensor([9.0, 9.0, 9.0])]
    margins_b = [torch.tensor([0.5, 0.25, 1.0]), torch.tensor([0.1, 0.2, 0.3]), torch.tensor([9.0, 9.0, 9.0])]
    got = first_difference(a, b, margins_a, margins_b)
    assert got == {"step": 1, "rows": [1], "margin_one_call": [0.0], "margin_per_row": [0.25]}
    assert first_difference(a, a, margins_a, margins_a) is None
    assert first_difference(a[1:], b[1:], margins_a, margins_b) == {"step": 0, "rows": [1]}   # no step before it


def test_smoke_run_compares_every_step_of_both_paths(tmp_path):
    out = tmp_path / "ragged.json"
    assert main(["--smoke", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    compared = [r for r in rows if r["label"] in ("d2o", "streamingllm") and "ms_per_token_mean" in r]
    assert len(compared) == 4                                       # two batches x two policies
    for r in compared:
        assert r[f"{r['label']}_tokens_equal_between_paths"] is True    # on CPU in fp32 the two paths agree
        assert r[f"{r['label']}_first_difference"] is None
