"""benchmarks/kv_dtype_throughput_gpu.py runs end to end at tiny shapes on the CPU (``--tiny``): every row measured
at batch 1 and its largest batch (3 on the CPU), the fp8 rows' caches smaller than the bf16 ones."""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow
def test_tiny_run_writes_every_row(tmp_path) -> None:
    from benchmarks import kv_dtype_throughput_gpu as bench

    out = tmp_path / "tiny.json"
    assert bench.main(["--tiny", "--contexts", "96", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["contexts"]["96"]["rows"]
    assert set(rows) == {"transformers", *bench.ROWS}
    for name, row in rows.items():
        assert row["batch1"]["ms_per_token"] > 0 and row["largest"]["batch"] == 3, name
    for policy in ("default", "guard"):
        assert rows[f"{policy}/fp8"]["per_row_bytes"] < 0.55 * rows[f"{policy}/bf16"]["per_row_bytes"]
