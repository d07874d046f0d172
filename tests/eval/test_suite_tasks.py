"""The suite's task generators (determinism, exact token counts, answers at the stated depth),
scoring, the Wilson interval, batching and the export format."""

from __future__ import annotations

import json

import pytest

from kvpass.eval import suite
from kvpass.eval.report import wilson
from kvpass.eval.scoring import normalise, score
from kvpass.eval.tasks import FAMILIES, generate
from kvpass.eval.tasks.context import Insert, build

LENGTH = 700          # characters = tokens with the stub tokenizer


@pytest.mark.parametrize("family", list(FAMILIES))
def test_seeded_determinism_and_exact_length(tokenizer, family):
    a, b = generate(tokenizer, family, LENGTH, 3), generate(tokenizer, family, LENGTH, 3)
    assert a == b
    others = [generate(tokenizer, family, LENGTH, s) for s in (4, 5)]
    assert all(o.context_ids != a.context_ids for o in others)
    for c in [a, *others]:
        assert len(c.context_ids) == LENGTH and c.length == LENGTH
        assert c.max_new_tokens == FAMILIES[family].max_new_tokens
        assert c.scoring in ("all", "any") and c.answers


@pytest.mark.parametrize("family", list(FAMILIES))
def test_answers_are_in_the_context_at_the_stated_depth(tokenizer, family):
    for seed in range(4):
        c = generate(tokenizer, family, LENGTH, seed)
        text = tokenizer.decode(c.context_ids)
        for answer in c.answers:
            assert normalise(answer) in normalise(text), (family, seed, answer)
        if c.depth is None:
            continue
        start, end = c.spans[0]
        assert c.answers[0].split()[0] in tokenizer.decode(c.context_ids[start:end + 1])
        # the span's offset into the haystack (after a RULER preamble, if any), as a fraction of the
        # haystack, is the stated depth up to the sentence boundary it snaps to
        lead = _preamble_tokens(tokenizer, family, text)
        where = (start - lead) / (LENGTH - lead)
        assert abs(where - c.depth) < 0.1, (family, seed, where, c.depth)
        assert 0.0 <= c.depth <= 1.0


def _preamble_tokens(tokenizer, family: str, text: str) -> int:
    """Token count of the family's preamble that ``text`` opens with (0 if none)."""
    import importlib

    mod = importlib.import_module(f"kvpass.eval.tasks.{family}")
    texts = [getattr(mod, "PREAMBLE", "")] + [f.preamble for f in getattr(mod, "FORMATS", ()) if hasattr(f, "preamble")]
    return max([len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in texts if p and text.startswith(p)],
               default=0)


def test_questions_have_equal_token_counts_within_a_family(tokenizer):
    for family in ("multi_key", "multi_value", "variable_tracking", "common_words"):
        assert len({len(generate(tokenizer, family, LENGTH, s).question_ids) for s in range(5)}) == 1, family


def test_inserts_sit_at_sentence_boundaries_and_their_depths(tokenizer):
    import random

    ctx = build(tokenizer, 2000, "Q?", [Insert(0.0, "First."), Insert(0.5, "Middle."), Insert(1.0, "Last.")],
                random.Random(0))
    assert len(ctx.context_ids) == 2000
    text = [tokenizer.decode(ctx.context_ids[a:b]) for a, b in ctx.spans]
    assert text == [" First.", " Middle.", " Last."]
    assert ctx.depth_of(0) == 0.0 and ctx.depth_of(2) == 1.0 and 0.4 < ctx.depth_of(1) <= 0.5
    a, _ = ctx.spans[1]
    assert tokenizer.decode(ctx.context_ids[a - 1:a]) in ".?!\"')]"      # after a sentence end


def test_too_short_a_length_is_refused(tokenizer):
    with pytest.raises(ValueError, match="haystack tokens"):
        generate(tokenizer, "multi_key", 60, 0)
    with pytest.raises(ValueError, match="unknown family"):
        generate(tokenizer, "nope", 600, 0)


def test_scoring_all_any_case_and_punctuation():
    assert score("The code is RAVEN-4821.", ["raven 4821"], "all")
    assert score("raven_4821", ["Raven-4821"], "all")
    assert not score("raven-482", ["raven-4821"], "all")
    assert not score("12345", ["1234"], "all")                 # whole words only
    assert score("ABCD, EFGH and  IJKL", ["abcd", "ijkl", "efgh"], "all")
    assert not score("ABCD and EFGH", ["abcd", "ijkl"], "all")
    assert score("ABCD and EFGH", ["abcd", "ijkl"], "any")
    assert not score("", ["x"], "any")
    with pytest.raises(ValueError, match="scoring"):
        score("x", ["x"], "most")
    with pytest.raises(TypeError):
        score("x", "x", "all")


def test_wilson_known_values():
    # 95% Wilson intervals (z = 1.96): 0/10 -> (0, 0.2775); 5/10 -> (0.2366, 0.7634); 9/10 -> (0.5958, 0.9821);
    # 81/100 -> (0.7222, 0.8749)
    for (k, n), (lo, hi) in {(0, 10): (0.0, 0.27753), (5, 10): (0.23659, 0.76341), (9, 10): (0.59585, 0.98212),
                             (81, 100): (0.72224, 0.87494)}.items():
        got = wilson(k, n)
        assert got == pytest.approx((lo, hi), abs=1e-4), (k, n, got)
    assert wilson(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError):
        wilson(3, 2)


def test_batches_group_by_token_counts(tokenizer):
    items = suite.cases(tokenizer, ["single_needle", "essay_qa"], [600, 650], 3)
    groups = suite.batches(items, 2)
    assert sum(map(len, groups)) == len(items) == 12
    for g in groups:
        assert 1 <= len(g) <= 2
        assert len({(len(c.context_ids), len(c.question_ids), c.max_new_tokens) for c in g}) == 1
    assert [len(g) for g in groups] == sorted((len(g) for g in groups), reverse=True)


def test_export_format(tokenizer, tmp_path):
    items = suite.cases(tokenizer, ["single_needle", "variable_tracking"], [600], 2)
    path = suite.export("tiny", items, tmp_path / "cases.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 4 and len({r["key"] for r in rows}) == 4
    fields = {"key": str, "model": str, "family": str, "length": int, "seed": int, "context_ids": list,
              "question_ids": list, "answers": list, "scoring": str, "max_new_tokens": int}
    for r in rows:
        for name, t in fields.items():
            assert isinstance(r[name], t), (name, r[name])
        assert r["depth"] is None or 0 <= r["depth"] <= 1
        assert len(r["context_ids"]) == r["length"] == 600 and r["model"] == "tiny"
        assert r["scoring"] == "all"
