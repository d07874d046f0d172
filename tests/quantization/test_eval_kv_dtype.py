"""The suite's records over 8-bit entries (``kvpass eval suite run --kv-dtype``): keys unchanged at the default (the
stores written before the option keep theirs), their own key and field when set, never on the reference; the CLI
takes the option into the run and the report's file names."""

from __future__ import annotations

import argparse

from kvpass.eval import suite
from kvpass.eval.niah import REFERENCE, Cell
from kvpass.eval.store import case_key
from kvpass.eval.suite_cli import _chunk_suffix, add_suite_parser
from kvpass.eval.tasks.case import SuiteCase

CASE = SuiteCase("single_needle", 4, 3, 0.5, [1, 2, 5, 6], [3], ("x",), "all", 8)
CELL = Cell("snapkv[kernel=31]", 0.2, "query_aware")


def test_default_key_is_the_one_stores_hold() -> None:
    before = case_key(kind="suite", model="smollm2", policy=CELL.policy, budget=0.2, mode="query_aware",
                      family="single_needle", length=4, seed=3, max_new_tokens=8)
    assert suite.key_of("smollm2", CELL, CASE) == before
    assert suite.key_of("smollm2", CELL, CASE, kv_dtype=None) == before


def test_a_kv_dtype_has_its_own_key_and_field() -> None:
    keys = {suite.key_of("smollm2", CELL, CASE, kv_dtype=k) for k in (None, "int8", "fp8_e4m3")}
    assert len(keys) == 3
    assert suite.cell_options(CELL, kv_dtype="int8") == {"kv_dtype": "int8"}
    assert suite.cell_options(CELL, 512, "fp8_e4m3") == {"prefill_chunk": 512, "kv_dtype": "fp8_e4m3"}
    assert suite.cell_options(CELL) == {}
    reference = Cell(REFERENCE, None, "reference")
    assert suite.cell_options(reference, 512, "int8") == {}
    assert suite.key_of("smollm2", reference, CASE, kv_dtype="int8") == suite.key_of("smollm2", reference, CASE)


def test_the_cli_takes_it() -> None:
    p = argparse.ArgumentParser()
    add_suite_parser(p.add_subparsers(dest="c"))
    args = p.parse_args(["suite", "run", "--kv-dtype", "fp8_e4m3"])
    assert args.kv_dtype == "fp8_e4m3" and _chunk_suffix(args) == "-fp8_e4m3"
    assert p.parse_args(["suite", "run"]).kv_dtype is None
