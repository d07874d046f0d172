"""The suite with --prefill-chunk (chunked prefill, kvpass/runtime/chunked_prefill.py): every kvpass cell prefills its own
prompt in chunks, ``full`` still equals transformers case for case, the records carry the chunk in their keys,
and the CLI writes its own store and report (quality-suite-<model>-chunk<N>.*) that unchunked records stay out of."""

from __future__ import annotations

import json
from dataclasses import replace

from kvpass.cli import main
from kvpass.eval import suite
from kvpass.eval.store import Store, read_json

FAMILIES = ["variable_tracking", "essay_qa"]     # no preamble: they fit the tiny model's 256 positions
LENGTH = 120


def test_chunked_cells_run_apart_and_full_still_equals_transformers(loaded, tokenizer, tmp_path):
    from kvpass.eval.suite_report import agreement

    items = [replace(c, max_new_tokens=4) for c in suite.cases(tokenizer, FAMILIES, [LENGTH], 2)]
    cells = suite.cells(["full", "streamingllm"], [0.5], list(suite.MODES))
    store = Store(tmp_path / "chunked.json")
    assert suite.run(loaded, items, cells, store, batch=4, prefill_chunk=32) is True
    records = list(store.cases.values())
    assert len(records) == 4 * (1 + 2 * len(suite.MODES))
    for a in agreement(records).values():
        assert a == {"cases": 4, "same_tokens": 4, "same_score": 4}
    kvpass_records = [r for r in records if r["mode"] != "reference"]
    assert all(r["prefill_chunk"] == 32 and "prefill_chunk=32" in r["key"] for r in kvpass_records)
    assert all("prefill_chunk" not in r for r in records if r["mode"] == "reference")
    # an unchunked run into the same store adds its own records: no key is shared with the chunked ones
    assert suite.run(loaded, items, cells, store, batch=4) is True
    assert len(store) == 4 * (1 + 2 * len(suite.MODES)) + 4 * 2 * len(suite.MODES)


def test_cli_prefill_chunk_writes_its_own_store_and_report(loaded, monkeypatch, tmp_path):
    monkeypatch.setattr("kvpass.eval.common.load", lambda name, device="cpu", dtype=None: loaded)
    out = tmp_path / "res"
    args = ["eval", "suite", "run", "--model", "tiny", "--families", *FAMILIES, "--lengths", str(LENGTH),
            "--cases", "1", "--policies", "streamingllm", "--budgets", "0.5", "--modes", "query_aware",
            "--no-reference", "--max-new-tokens", "variable_tracking=3", "essay_qa=3", "--out-dir", str(out)]
    assert main([*args, "--prefill-chunk", "40"]) == 0
    assert main(args) == 0
    chunked = json.loads((out / "quality-suite-tiny-chunk40.json").read_text())
    plain = json.loads((out / "quality-suite-tiny.json").read_text())
    assert [r["cases"] for r in chunked["rows"]] == [r["cases"] for r in plain["rows"]] == [2]
    assert "--prefill-chunk 40" in chunked["meta"]["command"]
    cases = read_json(out / "quality-suite-tiny-chunk40-cases.json.gz")["cases"]
    assert {c["prefill_chunk"] for c in cases} == {40}
    assert "prefill_chunk" not in json.dumps(read_json(out / "quality-suite-tiny-cases.json.gz"))
