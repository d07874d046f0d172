"""The GPU benchmark's CPU smoke mode, so the script cannot bit-rot between GPU runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.bench.report import markdown
from benchmarks.bench.timing import Deadline, slug

ROOT = Path(__file__).resolve().parents[1]


def test_smoke_run_writes_json_markdown_and_plot(tmp_path):
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "speed.py"), "--smoke", "--out", str(tmp_path),
                           "--prompts", "64", "--total-s", "240"],
                          env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (js,) = tmp_path.glob("speed-*.json")
    results = json.loads(js.read_text())
    assert "errors" not in results, results.get("errors")
    assert results["correctness"]["all_ok"]
    assert any("triton_us" in r and "sdpa_us" in r for r in results["kernels"]["rows"])
    timed = {r["op"] for r in results["kernels"]["compression"] if "bytes_per_s" in r}
    assert timed == {"cosine_kmeans_assign", "cosine_kmeans_update", "cluster_gather"}
    assert timed <= {r["op"] for r in results["correctness"]["rows"]}
    methods = {r["method"] for r in results["e2e"]["rows"] if "tpot_ms" in r}
    assert {"transformers", "kvpass-full", "kvpass-streamingllm"} <= methods
    measured = {r["method"] for r in results["throughput"]["rows"] if "tokens_per_s" in r}
    assert {"transformers", "kvpass-full", "kvpass-streamingllm", "kvpass-d2o"} <= measured
    assert set(results["throughput"]["over_transformers"]) == measured - {"transformers"}
    assert js.with_suffix(".md").exists() and js.with_suffix(".png").stat().st_size > 0
    assert "| 64 | kvpass-streamingllm |" in proc.stdout                # the table is printed last


def test_report_survives_failed_sections():
    md = markdown({"env": {"device": "X"}, "errors": {"kernels": "Traceback...\nRuntimeError: boom"}})
    assert "kernels: RuntimeError: boom" in md
    assert slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert Deadline(10).allows(5) and not Deadline(1).allows(5)


def test_speed_script_loads_kvpass_from_a_plain_checkout():
    """The GPU machine has no kvpass installed: the script puts the checkout on sys.path (the folders are
    the import paths). The child process first forgets this machine's install (its editable finder and
    any path entry for the checkout), so only the script can make the import work."""
    code = ("import runpy, sys\n"
            "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f)]\n"
            f"sys.path[:] = [p for p in sys.path if p not in ('', {str(ROOT)!r})]\n"
            "try:\n    import kvpass\n    raise SystemExit('kvpass importable before the script ran')\n"
            "except ImportError: pass\n"
            "sys.argv = ['speed.py', '--help']\n"
            f"try: runpy.run_path({str(ROOT / 'benchmarks' / 'speed.py')!r}, run_name='__main__')\n"
            "except SystemExit: pass\n"
            "import kvpass.kernels, kvpass.rewrites, benchmarks.bench.main\n"
            "print(kvpass.kernels.__file__)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=ROOT / "docs")
    assert proc.returncode == 0, proc.stderr[-2000:] + proc.stdout[-2000:]
    assert proc.stdout.strip().endswith(str(Path("kvpass") / "kernels" / "__init__.py"))


def test_prefill_cost_compares_compiled_rows_with_the_compiled_full_row():
    from benchmarks.bench.report import prefill_cost

    rows = [{"method": "kvpass-full", "prompt": 8, "ttft_s": 1.5}, {"method": "kvpass-full-compiled", "prompt": 8,
                                                                   "ttft_s": 1.25},
            {"method": "kvpass-d2o", "prompt": 8, "ttft_s": 2.0}, {"method": "kvpass-d2o-compiled", "prompt": 8,
                                                                  "ttft_s": 1.75}]
    assert prefill_cost(rows[2], rows) == (0.25, "TTFT minus kvpass-full's")
    assert prefill_cost(rows[3], rows) == (0.5 / 1.75, "TTFT minus kvpass-full-compiled's")
    assert prefill_cost(rows[3], rows[2:])[0] is None                      # no compiled full row: not measured
