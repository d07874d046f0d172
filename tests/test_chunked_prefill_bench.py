"""benchmarks/chunked_prefill_gpu.py's CPU smoke mode (tiny model, short prompts), so the GPU script cannot
bit-rot between GPU runs: every planned row runs and its chunked rows hold about budget + chunk entries."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("chunked_prefill_gpu", ROOT / "benchmarks" / "chunked_prefill_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_smoke_run_writes_every_row(tmp_path):
    script = _script()
    out = tmp_path / "chunked.json"
    assert script.main(["--smoke", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [(r["prompt"], r["batch"], r["policy"], r["prefill_chunk"]) for r in rows] == script.plan([96, 160], 32, 2)
    assert all("error" not in r and "skipped" not in r for r in rows), rows
    for r in rows:
        assert r["ttft_s"] > 0 and r["ms_per_token"] > 0 and r["tokens_per_s"] > 0
        if r["prefill_chunk"] is None:
            assert r["peak_entries_max"] >= r["prompt"]                    # the unchunked prefill holds the prompt
        else:                                                              # budget + one chunk (balanced: <= 32)
            assert r["peak_entries_max"] <= r["layer_budget_max"] + 32 < r["prompt"]
    assert result["chunk"] == 32 and result["model"].startswith("tiny Llama")
