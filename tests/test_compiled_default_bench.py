"""benchmarks/compiled_default_gpu.py's CPU smoke path (Inductor on the CPU, one policy, three sweep prompts), so
the GPU script cannot bit-rot between GPU runs."""

from __future__ import annotations

import json
import time

import pytest

from benchmarks.compiled_default_gpu import main, split_specs


def test_split_specs_keeps_commas_inside_brackets():
    assert split_specs("d2o, snapkv[kernel=31,window=8],full") == ["d2o", "snapkv[kernel=31,window=8]", "full"]


@pytest.mark.inductor
def test_smoke_writes_speed_floor_and_sweep(tmp_path, capfd):
    out = tmp_path / "smoke.json"
    assert main(["--smoke", "--out", str(out), "--policies", "streamingllm", "--sweep-policy", "streamingllm",
                 "--sweep", "3", "--steps", "8", "--generate-new", "12", "--row-watchdog", "0.25"]) == 0
    # the row ran longer than its watchdog: its stacks were printed, naming this script; none after it ended
    assert "compiled_default_gpu.py" in capfd.readouterr().err
    time.sleep(0.6)
    assert "most recent call first" not in capfd.readouterr().err
    results = json.loads(out.read_text())
    row = results["speed"]["streamingllm"]
    assert row["compiled"] and row["ms_per_token"] > 0 and row["generate_ms_per_token"] > 0
    assert row["over_floor"] == pytest.approx(row["ms_per_token"] / row["floor_ms"])
    assert row["new_tokens"] == results["config"]["generate_new"] == 12     # the timed generate call's length
    assert row["compile"]["compilations"] == 1 and row["compile"]["compile_seconds"] > 0
    assert row["cache_bytes"] < row["full_cache_bytes"]
    sweep = results["sweep"]
    assert sweep["prompts_run"] == 3 and len({r["prompt"] for r in sweep["rows"]}) == 3
    assert sweep["compilations"] == 0 and sweep["compilations_in_all"] == 1    # the speed row's graph serves all
    assert results["config"]["layers"] == 2 and results["config"]["compile_argument"] is True
