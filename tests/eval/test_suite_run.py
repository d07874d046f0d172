"""The suite's runner end to end on the tiny model: both modes, full equals transformers case for
case, resume, the time limit, the CLI's report and calibration."""

from __future__ import annotations

import json

import pytest

from kvpass.cli import main
from kvpass.eval import niah, suite
from kvpass.eval.store import Store, read_json

FAMILIES = ["variable_tracking", "essay_qa"]     # no preamble: they fit the tiny model's 256 positions
LENGTH = 120


@pytest.fixture(scope="module")
def items(tokenizer):
    from dataclasses import replace

    return [replace(c, max_new_tokens=4) for c in suite.cases(tokenizer, FAMILIES, [LENGTH], 2)]


@pytest.fixture(scope="module")
def finished(loaded, items, tmp_path_factory):
    store = Store(tmp_path_factory.mktemp("suite") / "suite.json")
    cells = suite.cells(["full", "streamingllm"], [0.5], list(suite.MODES))
    assert suite.run(loaded, items, cells, store, batch=4) is True
    return store


def test_full_equals_transformers_in_both_modes(finished):
    from kvpass.eval.suite_report import agreement

    records = list(finished.cases.values())
    assert len(records) == 4 * (1 + 2 * len(suite.MODES))     # 4 cases x (reference + 2 policies x each mode)
    agree = agreement(records)
    assert set(agree) == set(suite.MODES)
    for a in agree.values():
        assert a == {"cases": 4, "same_tokens": 4, "same_score": 4}
    for r in records:
        assert r["kind"] == "suite" and isinstance(r["correct"], bool) and r["context_tokens"] == LENGTH
        assert r["mode"] == "reference" if r["policy"] == "transformers" else r["mode"] in suite.MODES


def test_resume_and_time_limit(loaded, items, finished, tmp_path, monkeypatch):
    import shutil
    import time

    store = Store(shutil.copy(finished.path, tmp_path / "copy.json"))
    cells = suite.cells(["full", "streamingllm"], [0.5], list(suite.MODES))
    # the loop suite.run shares with the needle evaluation (niah.run_batches) answers through these
    monkeypatch.setattr(niah, "answer_kvpass", lambda *a, **k: pytest.fail("a stored case re-ran"))
    monkeypatch.setattr(niah, "answer_transformers", lambda *a, **k: pytest.fail("a stored case re-ran"))
    assert suite.run(loaded, items, cells, store) is True
    # a past deadline: nothing new runs, the run reports it stopped early
    more = suite.cells(["h2o"], [0.5], list(suite.MODES), reference=False)
    assert suite.run(loaded, items, more, store, deadline=time.monotonic() - 1) is False
    assert len(Store(store.path)) == 4 * (1 + 2 * len(suite.MODES))


def test_out_of_memory_retries_the_batch_in_halves(loaded, items, finished, tmp_path, monkeypatch):
    """A batch that runs out of GPU memory (processes sharing the GPU) is retried as two halves, down to
    single rows; every case is still scored, with the same tokens as the unbroken run."""
    import torch

    real = niah.answer_kvpass
    sizes = []

    def answer(kv, part, *a, **k):
        sizes.append(len(part))
        if len(part) > 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (test)")
        return real(kv, part, *a, **k)

    monkeypatch.setattr(niah, "answer_kvpass", answer)
    store = Store(tmp_path / "oom.json")
    cells = suite.cells(["full", "streamingllm"], [0.5], list(suite.MODES), reference=False)
    assert suite.run(loaded, items, cells, store, batch=4) is True
    cells_n = 2 * len(suite.MODES)
    assert max(sizes) > 1 and sizes.count(1) == 4 * cells_n   # batches of 2 (two families), then 4 rows x each cell alone
    assert len(store) == 4 * cells_n
    for key, r in store.cases.items():
        assert r["output_ids"] == finished.cases[key]["output_ids"]
    # a single row that runs out is not hidden
    monkeypatch.setattr(niah, "answer_kvpass", lambda *a, **k: (_ for _ in ()).throw(
        torch.cuda.OutOfMemoryError("CUDA out of memory (test)")))
    with pytest.raises(torch.cuda.OutOfMemoryError):
        suite.run(loaded, items[:1], suite.cells(["h2o"], [0.5], ["query_aware"], reference=False),
                  Store(tmp_path / "one.json"), batch=4)


def test_cli_run_report_and_calibrate(loaded, monkeypatch, tmp_path):
    monkeypatch.setattr("kvpass.eval.common.load", lambda name, device="cpu", dtype=None: loaded)
    out, cal = tmp_path / "res", tmp_path / "cal.json"
    args = ["eval", "suite", "run", "--model", "tiny", "--families", *FAMILIES, "--lengths", str(LENGTH),
            "--cases", "2", "--policies", "full", "streamingllm", "--budgets", "0.5", "--max-new-tokens",
            "variable_tracking=3", "essay_qa=3", "--out-dir", str(out), "--calibration", str(cal)]
    assert main(args) == 0
    data = json.loads((out / "quality-suite-tiny.json").read_text())
    assert data["meta"]["complete"] is True and data["meta"]["command"].startswith("kvpass eval suite run")
    rows = {(r["policy"], r["budget"], r["mode"]): r for r in data["rows"]}
    assert rows[("streamingllm", 0.5, "query_agnostic")]["cases"] == 4
    assert data["meta"]["full_vs_transformers"]["query_aware"]["same_tokens"] == 4
    assert (out / "quality-suite-tiny.png").stat().st_size > 1000
    md = (out / "quality-suite-tiny.md").read_text()
    assert "Status: complete" in md and "| streamingllm | 0.5 | query_aware |" in md
    # a peer store's records join the table (a gzipped one: --peers X.json.gz)
    peer = Store(tmp_path / "peer.json.gz")
    peer.add_many([{**r, "key": "peer|" + r["key"], "policy": "kvpress:SnapKVPress", "output_ids": None}
                   for r in data_records(out) if r["policy"] == "streamingllm"])
    # a press that raised is named under the table with its lengths and unscored cases
    peer.add({"key": "err|pyramid", "kind": "peer-error", "model": "tiny", "policy": "kvpress:PyramidKVPress",
              "budget": 0.5, "mode": "query_agnostic", "tokens": LENGTH, "press": "PyramidKVPress", "cases": 2,
              "error": "RuntimeError: The expanded size | of the tensor (959)", "correct": None, "output": None})
    peer.save()
    assert main([*args, "--report-only", "--peers", str(peer.path)]) == 0
    data = json.loads((out / "quality-suite-tiny.json").read_text())
    rows = {(r["policy"], r["budget"], r["mode"]) for r in data["rows"]}
    assert ("kvpress:SnapKVPress", 0.5, "query_aware") in rows
    assert [(f["policy"], f["tokens"], f["cases"]) for f in data["peer_failures"]] == [
        ("kvpress:PyramidKVPress", [LENGTH], 2)]
    assert (f"| kvpress:PyramidKVPress | 0.5 | query_agnostic | {LENGTH} | 0 of 4 | RuntimeError: The expanded size / of"
            in (out / "quality-suite-tiny.md").read_text())
    # calibration: full + transformers per (family, length), written only when complete
    assert main(["eval", "suite", "calibrate", *args[3:12], "--out-dir", str(out), "--calibration", str(cal),
                 "--max-new-tokens", "variable_tracking=3", "essay_qa=3"]) == 0
    written = json.loads(cal.read_text())["tiny"]
    assert {(c["family"], c["length"]) for c in written["cells"]} == {(f, LENGTH) for f in FAMILIES}
    assert all(c["cases"] == 2 for c in written["cells"])
    # the export writes the shared format
    assert main(["eval", "suite", "export", *args[3:12], "--out", str(tmp_path / "c.jsonl")]) == 0
    assert len((tmp_path / "c.jsonl").read_text().splitlines()) == 4


def test_held_out_seeds_run_and_report_apart_from_the_first(loaded, monkeypatch, tmp_path):
    """--first-seed S: seeds S..S+N-1 are run, and a report over a store that also holds seeds 0..N-1 counts only
    the held-out ones (and names their range)."""
    monkeypatch.setattr("kvpass.eval.common.load", lambda name, device="cpu", dtype=None: loaded)
    out = tmp_path / "res"
    args = ["eval", "suite", "run", "--model", "tiny", "--families", *FAMILIES, "--lengths", str(LENGTH),
            "--cases", "1", "--policies", "streamingllm", "--budgets", "0.5", "--modes", "query_aware",
            "--no-reference", "--max-new-tokens", "variable_tracking=3", "essay_qa=3", "--out-dir", str(out)]
    assert main(args) == 0                                                  # seed 0
    assert main([*args, "--first-seed", "7"]) == 0                          # seed 7, into the same store
    assert sorted({r["seed"] for r in data_records(out)}) == [0, 7]
    data = json.loads((out / "quality-suite-tiny.json").read_text())
    assert [(r["policy"], r["cases"]) for r in data["rows"]] == [("streamingllm", 2)]
    assert "1 seeds per (family, length) (seeds 7-7)" in (out / "quality-suite-tiny.md").read_text()
    assert main([*args, "--first-seed", "-1"]) == 2


def data_records(out):
    return read_json(out / "quality-suite-tiny-cases.json.gz")["cases"]


def test_policy_specs_run_as_their_own_rows(loaded, items, tmp_path):
    """A spec and its plain policy in one run (one shared prefill): each cell gets its own rows; a spec
    with the same options as the default gives the default's tokens."""
    store = Store(tmp_path / "specs.json")
    cells = suite.cells(["streamingllm", "streamingllm[sinks=4]", "streamingllm[sinks=1]"], [0.5],
                        ["query_aware"], reference=False)
    assert suite.run(loaded, items, cells, store) is True
    by = {}
    for r in store.cases.values():
        by.setdefault(r["policy"], {})[r["family"], r["seed"]] = r["output_ids"]
    assert set(by) == {"streamingllm", "streamingllm[sinks=4]", "streamingllm[sinks=1]"}
    assert all(len(v) == len(items) for v in by.values())
    assert by["streamingllm[sinks=4]"] == by["streamingllm"]            # sinks=4 is the default


@pytest.mark.parametrize(("text", "says"), [("{bad", "not a kvpass calibration file"),
                                            ("[1, 2]", "top level is a list"),
                                            (None, "is not a readable file")])
def test_a_bad_calibration_file_is_refused_by_name(tmp_path, capsys, text, says):
    """A missing or malformed --calibration file stops the run with kvpass's message, before any work."""
    path = tmp_path / "calibration.json"
    if text is not None:
        path.write_text(text, encoding="utf-8")
    try:
        code = main(["eval", "suite", "run", "--model", "smollm2", "--calibration", str(path), "--report-only",
                     "--out-dir", str(tmp_path / "out")])
    except SystemExit as done:                   # argparse-style exits and kvpass's error exit alike
        code = done.code
    assert code == 2
    assert not (tmp_path / "out").exists()      # refused before any work
    err = capsys.readouterr().err
    assert says in err and str(path) in err
