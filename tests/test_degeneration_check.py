"""benchmarks/degeneration_check.py: the degeneration metric flags loops and stutters and not ordinary text,
and the script's batched perplexity is ``kvpass eval ppl``'s (``kvpass.eval.lm.kvpass_pass``)."""

from __future__ import annotations

import math

import torch

from benchmarks.degeneration_check import (
    degenerate_cell,
    degenerate_generation,
    distinct_n,
    longest_run,
    markdown,
    repeated_ngram_fraction,
    repetition_metrics,
    run_cells,
    summarize,
    teacher_forced_nll,
)
from tests.conftest import tiny_model

PROSE = ("The most important thing in a startup is to make something people want. Most founders learn this "
         "the hard way: they build what they find interesting, launch it, and wait. Nobody comes. Then they "
         "talk to users, discover what those users actually need, and change the product until growth starts.")


def words(text: str) -> list[str]:
    return text.split()


def test_ngram_run_and_distinct_on_known_sequences() -> None:
    assert repeated_ngram_fraction([1, 2, 3, 4, 5, 6], 4) == 0.0
    # 1 2 3 4 1 2 3 4 1 2: 7 four-grams, the last 3 repeat earlier ones
    assert repeated_ngram_fraction([1, 2, 3, 4, 1, 2, 3, 4, 1, 2], 4) == 3 / 7
    assert repeated_ngram_fraction([1, 2], 4) == 0.0
    assert longest_run([1, 1, 2, 2, 2, 3]) == 3 and longest_run([]) == 0
    assert distinct_n([1, 2, 1, 2, 1], 2) == 2 / 4 and distinct_n([7], 2) == 1.0


def test_a_loop_and_a_stutter_are_flagged_and_prose_is_not() -> None:
    prose = repetition_metrics(words(PROSE), PROSE)
    loop_text = "I think the answer is the text above. " * 12
    loop = repetition_metrics(words(loop_text), loop_text)
    stutter_text = PROSE + " The passphrase is " + "1 " * 9     # mostly prose: rep4 stays low
    stutter = repetition_metrics(words(stutter_text), stutter_text)
    assert prose["rep4"] < 0.1 and prose["max_run"] < 3
    assert loop["rep4"] > 0.8 and stutter["rep4"] < 0.2 and stutter["max_run"] == 9
    assert degenerate_generation(prose, prose) is None
    assert degenerate_generation(loop, prose).startswith("loop")
    assert degenerate_generation(stutter, prose).startswith("stutter")
    # a repeated *word* split over tokens (no spaces: one token id each) is caught by the word run
    glued = repetition_metrics([11, 12, 13, 14], "TheTheThe the the the the the the the the")
    assert glued["word_run"] == 8 and degenerate_generation(glued, prose).startswith("stutter")


def test_full_loops_too_then_a_policy_loop_is_not_blamed_on_the_compression() -> None:
    loop_text = "I think the answer is the text above. " * 12
    loop = repetition_metrics(words(loop_text), loop_text)
    assert degenerate_generation(loop, loop) is None


def test_cell_verdict_thresholds() -> None:
    assert degenerate_cell(10.0, [None, None])
    assert not degenerate_cell(9.9, [None, None])
    assert degenerate_cell(1.0, ["loop", None])          # half the prompts
    assert not degenerate_cell(1.0, ["loop", None, None])
    assert degenerate_cell(float("nan"), [None])


def test_script_on_a_tiny_llama_matches_eval_ppl_and_writes_a_table() -> None:
    """The smoke run: two configurations at one budget on random prompts; row 0's NLL equals
    ``kvpass.eval.lm.kvpass_pass`` on that row alone (the ``kvpass eval ppl`` evaluator)."""
    from kvpass.eval.lm import Segment, kvpass_pass
    from kvpass.eval.shared import Models

    model = tiny_model("llama")
    prefix, steps = 40, 6
    ids = torch.randint(1, 128, (2, prefix + steps), generator=torch.Generator().manual_seed(3))
    cells = [("full", None), ("snapkv", 0.3), ("cam", 0.3), ("chelsea", 0.06)]
    records = run_cells(model, ids, prefix, cells, gen_tokens=steps, eos_ids=torch.tensor([], dtype=torch.long),
                        log=lambda s: None, decode=lambda t: " ".join(map(str, t)))
    assert {r["policy"] for r in records} == {"full", "snapkv", "cam", "chelsea"}
    assert "refused" in next(r for r in records if r["policy"] == "chelsea")     # below its minimum budget
    snap = next(r for r in records if r["policy"] == "snapkv")
    kv = Models(model).get("snapkv", 0.3)
    alone, _, _ = kvpass_pass(kv, ids[0].tolist(), Segment(0, prefix, steps), {}, [])
    assert max(abs(a - b) for a, b in zip(snap["nll"][0], alone, strict=True)) < 1e-4
    kv_full = Models(model).get("full", None)
    session = kv_full.start(ids[:, :prefix], max_new_tokens=steps)
    torch.testing.assert_close(teacher_forced_nll(session, ids, prefix),
                               torch.tensor(next(r for r in records if r["policy"] == "full")["nll"]),
                               atol=1e-4, rtol=0)
    rows = summarize(records)
    by = {r["policy"]: r for r in rows}
    assert by["full"]["ppl_ratio"] == 1.0 and by["full"]["degenerate"] is False
    assert math.isfinite(by["snapkv"]["ppl_ratio"]) and len(by["cam"]["rep4"]) == 2
    assert by["chelsea"]["degenerate"] is None
    table = markdown({"meta": {"model": "tiny", "device": "cpu", "prompts": 2, "prefix": prefix, "steps": steps,
                               "gen_tokens": steps, "command": "test"}, "rows": rows})
    assert "| snapkv |" in table and "| chelsea | refused |" in table
