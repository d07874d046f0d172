"""The peers runner (benchmarks/peers/): what runs without kvpress (reading cases, batching, the
ratio <-> budget mapping, the stored records, the press specs), and the kvpress path where kvpress is
installed (the peers venv; skipped in kvpass's venv)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PEERS = ROOT / "benchmarks" / "peers"


def _load(name: str):
    if str(PEERS) not in sys.path:
        sys.path.insert(0, str(PEERS))
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, PEERS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


C = _load("cases")
R = _load("run_kvpress")


def case(key: str = "c0", context: int = 5, question: int = 3, answers=("cobalt-raven-4821",), scoring="all",
         model="smollm2", max_new_tokens=8) -> dict:
    return {"key": key, "model": model, "family": "needle", "length": context, "seed": 0, "depth": 0.5,
            "context_ids": list(range(1, context + 1)), "question_ids": list(range(100, 100 + question)),
            "answers": list(answers), "scoring": scoring, "max_new_tokens": max_new_tokens}


def write_jsonl(path: Path, cases: list[dict]) -> Path:
    path.write_text("\n".join(json.dumps(c) for c in cases) + "\n\n", encoding="utf-8")
    return path


def test_read_cases_checks_filters_and_limits(tmp_path):
    path = write_jsonl(tmp_path / "cases.jsonl", [case("a"), case("b", model="gemma3-270m"), case("c")])
    assert [c["key"] for c in C.read_cases(path)] == ["a", "b", "c"]
    assert [c["key"] for c in C.read_cases(path, models=["smollm2"])] == ["a", "c"]
    assert [c["key"] for c in C.read_cases(path, limit=1)] == ["a"]


@pytest.mark.parametrize("change, error", [
    ({"answers": None}, TypeError),                   # wrong type
    ({"context_ids": []}, ValueError),                # empty ids
    ({"question_ids": [1, "2"]}, ValueError),         # a non-int id
    ({"scoring": "most"}, ValueError),
    ({"max_new_tokens": 0}, ValueError),
    ({"max_new_tokens": True}, TypeError),            # a bool is not an int here
])
def test_read_cases_rejects_bad_fields(tmp_path, change, error):
    bad = {**case(), **change}
    with pytest.raises(error, match=next(iter(change))):
        C.read_cases(write_jsonl(tmp_path / "bad.jsonl", [bad]))


def test_read_cases_rejects_missing_fields_and_duplicate_keys(tmp_path):
    missing = case()
    del missing["answers"]
    with pytest.raises(ValueError, match="missing field 'answers'"):
        C.read_cases(write_jsonl(tmp_path / "m.jsonl", [missing]))
    with pytest.raises(ValueError, match="duplicate case key 'a'"):
        C.read_cases(write_jsonl(tmp_path / "d.jsonl", [case("a"), case("a")]))


@pytest.mark.parametrize("ratio, budget", [(0.5, 0.5), (0.8, 0.2), (0.9, 0.1), (0.0, 1.0)])
def test_ratio_budget_mapping(ratio, budget):
    assert C.budget_of_ratio(ratio) == budget
    assert C.ratio_of_budget(budget) == ratio
    assert C.ratio_of_budget(C.budget_of_ratio(ratio)) == ratio


@pytest.mark.parametrize("bad", [-0.1, 1.0, 1.5])
def test_ratio_out_of_range(bad):
    with pytest.raises(ValueError, match="compression ratio"):
        C.budget_of_ratio(bad)
    with pytest.raises(ValueError, match="budget"):
        C.ratio_of_budget(0.0)


def test_batches_never_mix_shapes_and_respect_the_size():
    cases = [case("a", 5, 3), case("b", 6, 3), case("c", 5, 3), case("d", 5, 4), case("e", 5, 3),
             case("f", 5, 3, max_new_tokens=9)]
    got = C.batches(cases, size=2)
    assert [[c["key"] for c in b] for b in got] == [["a", "c"], ["e"], ["b"], ["d"], ["f"]]
    for b in got:
        assert len({C.shape_of(c) for c in b}) == 1
    with pytest.raises(ValueError, match="batch size"):
        C.batches(cases, 0)


def test_interleaved_batches_round_robin_over_shapes():
    cases = [case(f"a{i}", 5, 3) for i in range(5)] + [case(f"b{i}", 9, 3) for i in range(2)] + [case("c0", 7, 3)]
    got = C.interleaved(C.batches(cases, size=2))
    assert [[c["key"] for c in b] for b in got] == [["a0", "a1"], ["b0", "b1"], ["c0"], ["a2", "a3"], ["a4"]]
    assert C.interleaved([]) == []


def test_make_record_scores_and_drops_the_id_lists():
    c = case(answers=["cobalt-raven-4821"])
    rec = C.make_record(c, policy="kvpress:SnapKVPress", budget=0.2, mode="query_aware",
                        output="The passphrase is cobalt-raven-4821.", output_ids=[7, 8], seconds=1.23456,
                        device="cpu", cache_bytes=1024, press="SnapKVPress", ratio=0.8)
    assert "context_ids" not in rec and "question_ids" not in rec
    assert rec["context_tokens"] == 5 and rec["question_tokens"] == 3
    assert rec["correct"] is True and rec["budget"] == 0.2 and rec["ratio"] == 0.8
    assert rec["policy"] == "kvpress:SnapKVPress" and rec["mode"] == "query_aware" and rec["seconds"] == 1.2346
    assert rec["case"] == "c0" and rec["answers"] == ["cobalt-raven-4821"] and rec["cache_bytes"] == 1024
    wrong = C.make_record(c, policy="kvpass:x", budget=0.2, mode="query_aware", output="cobalt-raven",
                          output_ids=[], seconds=0, device="cpu")
    assert wrong["correct"] is False
    with pytest.raises(ValueError, match="mode"):
        C.make_record(c, policy="p", budget=None, mode="aware", output="", output_ids=[], seconds=0, device="cpu")


def test_record_keys_separate_policy_budget_mode_and_case():
    c = case()
    keys = {C.record_key(c, p, b, m) for p in ("kvpress:A", "kvpress:B") for b in (0.5, 0.2)
            for m in C.MODES}
    keys |= {C.record_key(case("other"), "kvpress:A", 0.5, "query_aware")}
    assert len(keys) == 9


def test_scoring_all_and_any():
    assert C.score("alpha and beta", ["alpha", "beta"], "all")
    assert not C.score("alpha only", ["alpha", "beta"], "all")
    assert C.score("alpha only", ["alpha", "beta"], "any")
    assert not C.score("neither", ["alpha", "beta"], "any")
    with pytest.raises(ValueError, match="scoring"):
        C.score("x", ["x"], "most")


def test_error_record_is_keyed_per_model_policy_budget_mode_and_length():
    err = C.error_record("smollm2", policy="kvpress:KVzipPress", budget=0.1, mode="query_agnostic", tokens=2063,
                         error=RuntimeError("needs the hub"), press="KVzipPress", cases=3)
    assert err["kind"] == "peer-error" and err["error"] == "RuntimeError: needs the hub" and err["cases"] == 3
    assert err["key"] == C.error_key("smollm2", "kvpress:KVzipPress", 0.1, "query_agnostic", 2063)
    assert err["key"] != C.error_key("smollm2", "kvpress:KVzipPress", 0.1, "query_agnostic", 8000)
    assert err["key"] != C.record_key(case(), "kvpress:KVzipPress", 0.1, "query_agnostic")
    assert err["correct"] is None


@pytest.mark.parametrize("name", ["s.json", "s.json.gz"])
def test_error_record_and_records_go_to_a_resumable_store(tmp_path, name):
    store = C.store_module().Store(tmp_path / name)
    store.add(C.error_record("smollm2", policy="kvpress:X", budget=0.5, mode="query_aware", tokens=8, error="boom"))
    store.add(C.make_record(case(), policy="kvpress:X", budget=0.2, mode="query_aware", output="cobalt-raven-4821",
                            output_ids=[1], seconds=0.1, device="cpu"))
    again = C.store_module().Store(tmp_path / name)
    assert C.error_key("smollm2", "kvpress:X", 0.5, "query_aware", 8) in again
    assert C.record_key(case(), "kvpress:X", 0.2, "query_aware") in again
    if name.endswith(".gz"):
        assert (tmp_path / name).read_bytes()[:2] == b"\x1f\x8b"      # the gzip magic


def test_peers_read_kvpass_gzipped_store_and_merge_its_shards(tmp_path, capsys):
    """A store written by kvpass (kvpass.eval.store) is read by the peers' stdlib-only loader of the same
    file, and summary.py --merge folds the gzipped shards run_kvpress.py writes (<out>.shard<i>.json.gz)."""
    from kvpass.eval.store import Store

    peers_store = C.store_module()
    assert peers_store is not sys.modules["kvpass.eval.store"]
    kvpass_side = Store(tmp_path / "kvpass.json.gz")
    kvpass_side.add(C.make_record(case("k"), policy="transformers", budget=None, mode="reference", output="x",
                                  output_ids=[1], seconds=0.1, device="cpu"))
    assert peers_store.Store(tmp_path / "kvpass.json.gz").cases == kvpass_side.cases
    out = tmp_path / "kvpress.json.gz"
    for i, key in enumerate(["a", "b"]):
        shard = peers_store.shard_path(out, i)
        assert shard.name == f"kvpress.shard{i}.json.gz"
        peers_store.Store(out, write_path=shard).add(
            C.make_record(case(key), policy="kvpress:SnapKVPress", budget=0.2, mode="query_aware",
                          output="cobalt-raven-4821", output_ids=[1], seconds=0.1, device="cpu"))
    summary = _load("summary")
    assert summary.main([str(out), "--merge"]) == 0
    assert "2 scored cases" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kvpass.json.gz", "kvpress.json.gz"]
    assert len(Store(out)) == 2


def test_press_specs_units_and_policies():
    assert R.parse_spec("AdaKVPress(SnapKVPress)") == ("AdaKVPress", "SnapKVPress")
    assert R.parse_spec("KnormPress") == ("KnormPress", None)
    with pytest.raises(ValueError, match="press spec"):
        R.parse_spec("AdaKV(Snap(KV))")
    assert R.policy_of("SnapKVPress") == "kvpress:SnapKVPress"
    assert R.policy_of(R.REFERENCE_POLICY) == "transformers-peer-env"
    units = R.units([R.REFERENCE_POLICY, R.NONE, "SnapKVPress", "KnormPress"], [0.5, 0.8], list(C.MODES))
    assert units[0] == R.Unit(R.REFERENCE_POLICY, None, "reference")
    assert [u.budget for u in units[1:3]] == [None, None]
    assert len(units) == 1 + 2 + 2 * 2 * 2
    assert [u.budget for u in units[3:]] == [0.5] * 4 + [0.2] * 4       # ratio-major


def test_cut_at_eos_and_parse_args():
    assert R.cut_at_eos([5, 6, 2, 7], [2]) == [5, 6]
    assert R.cut_at_eos([5, 6], [2]) == [5, 6]
    args = R.parse_args(["cases.jsonl", "--out", "o.json", "--ratios", "0.5", "--presses", "KnormPress"])
    assert args.ratios == [0.5] and args.presses == ["KnormPress"] and args.modes == list(C.MODES)
    with pytest.raises(SystemExit):
        R.parse_args(["c.jsonl", "--out", "o.json", "--device", "tpu"])
    with pytest.raises(ValueError, match="compression ratio"):
        R.parse_args(["c.jsonl", "--out", "o.json", "--ratios", "1.0"])


def test_run_rows_retries_a_failed_batch_row_by_row(monkeypatch):
    calls = []

    def fake_run_unit(lm, kvpress, unit, rows):
        calls.append(len(rows))
        if len(rows) > 1:
            raise MemoryError("the batch does not fit")
        if rows[0]["key"] == "bad":
            raise RuntimeError("this row fails")
        return [{"key": rows[0]["key"]}]

    monkeypatch.setattr(R, "run_unit", fake_run_unit)
    lm = R.Loaded("tiny", None, None, [], 0, "cpu")
    unit = R.Unit("SnapKVPress", 0.5, "query_aware")
    records, error = R.run_rows(lm, None, unit, [case("a"), case("b")])
    assert [r["key"] for r in records] == ["a", "b"] and error is None and calls == [2, 1, 1]
    records, error = R.run_rows(lm, None, unit, [case("a"), case("bad"), case("c")])
    assert [r["key"] for r in records] == ["a"] and isinstance(error, RuntimeError)
    records, error = R.run_rows(lm, None, unit, [case("bad")])
    assert records == [] and isinstance(error, RuntimeError)
    calls.clear()
    records, error = R.run_rows(lm, None, R.Unit("KVzipPress", 0.5, "query_aware"), [case("a"), case("b")])
    assert calls == [1, 1] and [r["key"] for r in records] == ["a", "b"]     # batch-1 press: never batched


def test_gguf_file_from_the_environment(tmp_path, monkeypatch):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    monkeypatch.setenv("KVPASS_GGUF_GEMMA3_270M", str(f))
    assert R.gguf_file("gemma3-270m") == f
    monkeypatch.setenv("KVPASS_GGUF_GEMMA3_270M", str(tmp_path / "absent.gguf"))
    with pytest.raises(FileNotFoundError, match="KVPASS_GGUF_GEMMA3_270M"):
        R.gguf_file("gemma3-270m")


# ---- the kvpress path: only where kvpress is installed (the peers venv) ----

@pytest.fixture(scope="module")
def kvpress():
    if importlib.util.find_spec("kvpress") is None:        # before the placeholders: they stay out of kvpass's venv
        pytest.skip("kvpress is not installed (it lives in the peers venv: benchmarks/peers/setup.sh)")
    R.stub_unused_imports()
    return pytest.importorskip("kvpress")


@pytest.mark.parametrize("spec", [s for s in R.DEFAULT_PRESSES if s not in (R.NONE, R.REFERENCE_POLICY)])
def test_build_press_sets_the_ratio(kvpress, spec):
    press = R.build_press(kvpress, spec, 0.8, prefill_tokens=1000)
    outer, _ = R.parse_spec(spec)
    assert type(press).__name__ == outer
    if outer == "CAMPress":
        assert press.target_size == 200 and press.compression_interval == 1
    else:
        assert press.compression_ratio == pytest.approx(0.8)


def test_generate_on_a_tiny_llama(kvpress):
    """No press: both modes give plain generate's greedy tokens; SnapKVPress runs in both modes and
    shrinks the cache."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = 127
    lm = R.Loaded("tiny", model, None, [127], 127, "cpu")
    context = torch.randint(0, 126, (2, 96))
    question = torch.randint(0, 126, (2, 6))
    ref, _ = R.generate_reference(lm, context, question, 10)
    full = {}
    for mode in C.MODES:
        full[mode], size = R.generate(lm, kvpress, None, context, question, mode, 10)
        assert full[mode] == ref
    press = R.build_press(kvpress, "SnapKVPress", 0.5, 102)
    for mode in C.MODES:
        out, small = R.generate(lm, kvpress, press, context, question, mode, 10)
        assert len(out) == 2 and small < size
