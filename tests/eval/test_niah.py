"""The needle harness: placement, scoring, the two modes, the transformers reference, resume, schema."""

from __future__ import annotations

import json

import pytest

from kvpass.eval import niah
from kvpass.eval.common import split_chat
from kvpass.eval.store import Store
from kvpass.prompts import needle_sentence

SPECS = niah.grid([20, 40], [0.0, 1.0])
CELLS = niah.cells(["full", "streamingllm"], [0.5], list(niah.MODES))


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_needle_sits_at_the_stated_depth(tokenizer, depth):
    case = niah.build_case(tokenizer, niah.NeedleSpec(400, depth, seed=3))
    sentence = needle_sentence(case.answer)
    at = case.context.index(sentence)
    haystack_chars = len(case.context) - len(sentence)
    # inserted at the sentence end before the depth: within one sentence (< 200 chars here) of it
    assert depth * haystack_chars - 200 <= at <= depth * haystack_chars + 1
    if depth == 0.0:
        assert at == 0
    if depth == 1.0:
        assert case.context.endswith(sentence)


def test_multi_needle_asks_one_of_several(tokenizer):
    case = niah.build_case(tokenizer, niah.NeedleSpec(400, 0.5, seed=1, needles=3))
    assert case.context.count("The secret passphrase is") == 1
    assert case.context.count("Another passphrase is") == 2
    assert case.context.count(case.answer) == 2          # 'is X. Remember it: X.'


def test_seeds_give_different_passphrases(tokenizer):
    answers = {niah.build_case(tokenizer, s).answer for s in niah.grid([100], [0.0, 0.5, 1.0], seeds=[0, 1])}
    assert len(answers) == 6


def test_exact_match_scoring():
    assert niah.is_correct("amber-raven-1234", "The passphrase is amber-raven-1234.")
    assert not niah.is_correct("amber-raven-1234", "amber-raven-123")
    assert not niah.is_correct("amber-raven-1234", "Amber-Raven-1234")
    assert not niah.is_correct("amber-raven-1234", "")


def test_context_and_question_tokens_concatenate_to_the_prompt(tokenizer):
    ctx, q = split_chat(tokenizer, "some context.", "What?")
    assert ctx + q == tokenizer("some context.\n\nWhat?\n")["input_ids"]


def test_unknown_policy_and_mode_fail_fast(loaded):
    with pytest.raises(ValueError, match="unknown policy"):
        niah.cells(["nope"], [0.2], ["query_aware"])
    import kvpass
    case = niah.build_case(loaded.tokenizer, SPECS[0])
    with pytest.raises(ValueError, match="unknown mode"):
        niah.answer_kvpass(kvpass.apply(loaded.model, "full"), case, "sideways", 4)


@pytest.fixture(scope="module")
def finished(loaded, tmp_path_factory):
    store = Store(tmp_path_factory.mktemp("niah") / "niah.json")
    niah.run(loaded, SPECS, CELLS, store, max_new_tokens=6)
    return store


def test_every_case_is_stored_with_its_schema(finished):
    data = json.loads(finished.path.read_text())
    assert data["meta"]["schema"] == 1
    cases = data["cases"]
    # 2 lengths x 2 depths x (reference + full and streamingllm in each mode)
    assert len(cases) == 4 * (1 + 2 * len(niah.MODES))
    types = {"key": str, "kind": str, "policy": str, "mode": str, "length": int, "depth": float, "seed": int,
             "needles": int, "prompt_tokens": int, "answer": str, "output": str, "output_ids": list,
             "correct": bool, "seconds": float, "device": str}
    for c in cases:
        for name, t in types.items():
            assert isinstance(c[name], t), (name, c[name])
        assert c["kind"] == "niah" and c["device"] == "cpu"
        if c["policy"] == "transformers":
            assert c["cache_bytes"] is None and c["mode"] == "reference"
        else:
            assert 0 < c["cache_bytes"] and 0 < c["full_cache_bytes"]
    small = [c for c in cases if c["policy"] == "streamingllm"]
    full = [c for c in cases if c["policy"] == "full"]
    assert max(c["cache_bytes"] / c["full_cache_bytes"] for c in small) < min(
        c["cache_bytes"] / c["full_cache_bytes"] for c in full)


def test_full_matches_transformers_in_both_modes(finished):
    from kvpass.eval.report import full_agreement

    agree = full_agreement(list(finished.cases.values()))
    assert set(agree) == set(niah.MODES)
    for a in agree.values():
        assert a["cases"] == 4 and a["same_tokens"] == 4


def test_rerun_skips_stored_cases(loaded, finished, monkeypatch, tmp_path):
    import shutil

    finished = Store(shutil.copy(finished.path, tmp_path / "copy.json"))
    calls = []
    real = niah.answer_kvpass

    def spy(*args, **kwargs):
        calls.append(args[2])
        return real(*args, **kwargs)

    monkeypatch.setattr(niah, "answer_kvpass", spy)
    monkeypatch.setattr(niah, "answer_transformers", lambda *a, **k: pytest.fail("reference re-run"))
    again = Store(finished.path)
    assert len(again) == 4 * (1 + 2 * len(niah.MODES))
    niah.run(loaded, SPECS, CELLS, again, max_new_tokens=6)
    assert calls == []
    # drop one case: exactly that one runs again
    key = next(k for k, c in again.cases.items() if c["policy"] == "streamingllm" and c["mode"] == "query_agnostic")
    del again.cases[key]
    again.save()
    niah.run(loaded, SPECS, CELLS, Store(finished.path), max_new_tokens=6)
    assert calls == ["query_agnostic"]
    assert len(Store(finished.path)) == 4 * (1 + 2 * len(niah.MODES))


def test_shards_split_the_specs_and_merge(loaded, tmp_path):
    from kvpass.eval.store import merge_shards

    path = tmp_path / "s.json"
    cells = niah.cells(["full"], [0.5], ["query_aware"], reference=False)
    for i in range(2):
        niah.run(loaded, SPECS, cells, Store(path, write_path=tmp_path / f"s.shard{i}.json"), 4, shard=(i, 2))
    assert len(Store(path)) == 4            # read through the shards
    merged = merge_shards(path)
    assert len(merged) == 4 and not list(tmp_path.glob("s.shard*"))


def test_cells_are_budget_major_with_full_once():
    got = niah.cells(["h2o", "full", "d2o"], [0.1, 0.5], ["query_aware"])
    assert [(c.policy, c.budget) for c in got] == [
        ("transformers", None), ("full", None), ("h2o", 0.1), ("d2o", 0.1), ("h2o", 0.5), ("d2o", 0.5)]


def test_recall_policies_get_a_cell_per_budget():
    """Quest and ClusterKV keep every token but attend a budget of them: the budget matters."""
    got = niah.cells(["quest", "full", "clusterkv"], [0.1, 0.5], ["query_aware"], reference=False)
    assert [(c.policy, c.budget) for c in got] == [
        ("full", None), ("quest", 0.1), ("clusterkv", 0.1), ("quest", 0.5), ("clusterkv", 0.5)]
