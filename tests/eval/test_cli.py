"""``kvpass eval leaderboard`` end to end on the tiny model: files, rows, header, resume, status."""

from __future__ import annotations

import json

import pytest

from kvpass.cli import main
from kvpass.eval.store import read_json

ARGS = ["eval", "leaderboard", "--model", "tiny", "--policies", "full", "streamingllm", "--budgets", "0.5",
        "--lengths", "30", "--depths", "0", "1", "--max-new-tokens", "4", "--prefix", "40", "--steps", "6",
        "--probes", "1"]


@pytest.fixture
def tiny_cli(loaded, monkeypatch):
    monkeypatch.setattr("kvpass.eval.common.load", lambda name, device="cpu", dtype=None: loaded)


def test_leaderboard_writes_table_json_and_plots(tiny_cli, tmp_path, capsys):
    out = tmp_path / "res"
    assert main([*ARGS, "--out-dir", str(out)]) == 0
    data = json.loads((out / "quality-tiny.json").read_text())
    assert data["meta"]["command"].startswith("kvpass eval leaderboard --model tiny")
    assert data["meta"]["complete"] is True
    rows = {(r["policy"], r["budget"]): r for r in data["rows"]}
    assert set(rows) == {("transformers", None), ("full", None), ("streamingllm", 0.5)}
    row = rows[("streamingllm", 0.5)]
    assert row["niah_query_aware_cases"] == row["niah_query_agnostic_cases"] == 2
    assert row["ppl_ratio"] > 0 and row["attn_rel_err"] > 0 and row["niah_cache_ratio"] < 1
    assert rows[("full", None)]["ppl_ratio"] == pytest.approx(1.0)
    assert data["meta"]["full_vs_transformers"]["query_aware"] == {"cases": 2, "same_tokens": 2, "same_score": 2}
    md = (out / "quality-tiny.md").read_text()
    assert "Produced by: `kvpass eval leaderboard --model tiny" in md and "Status: complete" in md
    assert "| streamingllm | 0.5 |" in md
    for name in ["niah-tiny-streamingllm-0.5-query_aware.png", "ppl-tiny.png", "fidelity-tiny.png"]:
        assert (out / name).stat().st_size > 1000
    cases = read_json(out / "quality-tiny-cases.json.gz")["cases"]            # the default store: gzipped
    assert len(cases) == 2 * 5 + 3          # niah: 2 specs x (ref + full x2 + streaming x2); lm: ref, full, streaming

    # a wider grid on the same store: only the new cases run, the table says partial until done
    capsys.readouterr()
    assert main([*ARGS, "--out-dir", str(out), "--part", "lm", "--budgets", "0.5", "0.25"]) == 0
    assert main([*ARGS, "--out-dir", str(out), "--part", "lm", "--budgets", "0.5", "0.25"]) == 0
    shards = list(out.glob("quality-tiny-cases.shard-lm*"))
    assert [s.name for s in shards] == ["quality-tiny-cases.shard-lm.json.gz"]
    added = read_json(shards[0])["cases"]
    assert len([c for c in added if c["budget"] == 0.25]) == 1


def test_niah_quick_grid_command(tiny_cli, tmp_path):
    out = tmp_path / "n"
    assert main(["eval", "niah", "--model", "tiny", "--policies", "full", "--lengths", "20", "--depths", "0.5",
                 "--max-new-tokens", "3", "--modes", "query_agnostic", "--no-reference", "--out-dir", str(out)]) == 0
    md = (out / "niah-tiny.md").read_text()
    assert "| full | - | query_agnostic | 1 | 1 |" in md
    assert (out / "niah-tiny-full-query_agnostic-n1.png").exists()


def test_recorded_command_drops_part_and_report_only():
    from kvpass.eval.leaderboard import recorded_argv

    assert recorded_argv(["eval", "leaderboard", "--part", "lm", "--steps", "6", "--report-only", "--part=niah"]) == [
        "eval", "leaderboard", "--steps", "6"]


def test_report_only_runs_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr("kvpass.eval.common.load", lambda name, device="cpu", dtype=None: pytest.fail("a model was loaded"))
    out = tmp_path / "r"
    assert main([*ARGS, "--out-dir", str(out), "--report-only"]) == 0
    data = json.loads((out / "quality-tiny.json").read_text())
    assert data["meta"]["complete"] is False
    assert all(r["niah_query_aware_cases"] == 0 and r["ppl"] is None for r in data["rows"])
    assert {(r["policy"], r["budget"]) for r in data["rows"]} == {("transformers", None), ("full", None), ("streamingllm", 0.5)}
