"""Budgets resolved per prompt: the ONNX runner gives kvpass.apply's greedy tokens where the runtime's budgets vary
from prompt to prompt (D2O's layer budgets from the prompt's attention, PyramidKV's from its length, a fraction of
prompt + new tokens), and the exporter refuses what it cannot reproduce. Prompts are chosen so the allocation is
uneven (asserted from the runtime's report)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvpass
from kvpass.errors import InvalidValue, KVPassError
from kvpass.export import OnnxRunner
from kvpass.export import onnx as export_onnx
from kvpass.export.budgets import prompt_budgets
from kvpass.rewrites.insert_compressed_cache import prompt_cache
from tests.export.conftest import MAX_LENGTH

NEW = 20


def _prompt(length: int, seed: int, batch: int = 1) -> torch.Tensor:
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def _uneven_prompts(model: kvpass.KVPassModel, want: int = 2) -> list[torch.Tensor]:
    """Prompts of several lengths whose runtime layer budgets differ between layers."""
    found = []
    for length in (12, 16, 23, 30, 41):
        for seed in range(8):
            ids = _prompt(length, seed)
            model.generate(ids, max_new_tokens=1)
            if len(set(model.last_report.layer_budgets.values())) > 1:
                found.append(ids)
                break
        if len(found) == want:
            return found
    raise AssertionError(f"{model.policy.name}: no prompt with uneven layer budgets")


def _assert_runner_equals_runtime(model, out, prompts, mask=None) -> None:
    runner = OnnxRunner(out)
    for ids in prompts:
        want = model.generate(ids, attention_mask=mask, max_new_tokens=NEW)
        got = runner.generate(ids, attention_mask=mask, max_new_tokens=NEW)
        np.testing.assert_array_equal(got, want.numpy())


def _padded(seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    ids = _prompt(24, seed, batch=3)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    mask[2, :3] = 0
    return ids, mask


# ----------------------------------------------------------------------------------------------- the runner's budgets
@pytest.mark.parametrize("policy, kwargs", [("d2o", {}), ("d2o", {"interval": 4}), ("pyramidkv", {"window": 4}),
                                            ("streamingllm", {"sinks": 2})])
@pytest.mark.parametrize("budget", [10, 0.3])
def test_runner_budgets_are_the_runtimes(llama, policy, kwargs, budget):
    """``prompt_budgets`` (what OnnxRunner computes) gives each row the runtime's layer budgets, for prompts of
    many lengths (no ONNX involved: the prefill caches are the runtime's)."""
    model = kvpass.apply(llama, policy=policy, budget=budget, **kwargs)
    uneven = 0
    for length in (9, 23, 37):
        for seed in range(2):
            ids = _prompt(length, seed)
            model.generate(ids, max_new_tokens=NEW)
            pre = model.prefill(ids, max_new_tokens=NEW)
            caches = [prompt_cache(pre.kv[2 * i], pre.kv[2 * i + 1], pre.pad, pre.stats.get(s.layer, {}))
                      for i, s in enumerate(model.graphs.sites)]
            got = prompt_budgets(model.policy, budget, caches, length + NEW, getattr(model.policy, "interval", 1))
            assert dict(enumerate(got.layers)) == model.last_report.row_layer_budgets[0], (length, seed)
            uneven += len(set(got.layers)) > 1
    if policy in ("d2o", "pyramidkv"):
        assert uneven > 0                                    # the check saw uneven allocations


# ----------------------------------------------------------------------------------------------- D2O
def test_d2o_onnx_tokens_equal_runtime_on_uneven_prompts(exported):
    """The issue's case: D2O's per-layer budgets come from each prompt at run time; the export's runner computes
    them as the runtime does and feeds them to the compress graph, so the tokens agree where the allocation is
    uneven (they parted at the second new token when the export froze the example's budgets)."""
    model, out, meta = exported("d2o")
    assert meta["budgets"] == "runtime" and meta["layers"][0]["budget"] is None
    assert "d2o splits the budget over the layers" in meta["varying"]
    prompts = _uneven_prompts(model)
    _assert_runner_equals_runtime(model, out, prompts)
    ids, mask = _padded()
    _assert_runner_equals_runtime(model, out, [ids], mask)
    assert len({tuple(r.values()) for r in model.last_report.row_layer_budgets}) > 1   # rows of their own budgets


def test_fixed_budgets_refuse_the_prompts_they_do_not_fit(exported):
    """budgets="fixed" (constant-K graphs for TensorRT): the runner refuses a prompt whose runtime layer budgets
    differ from the exported ones instead of decoding with the wrong ones, and reproduces the runtime elsewhere."""
    model, out, meta = exported("d2o", "fixed")
    fixed = [layer["budget"] for layer in meta["layers"]]
    runner = OnnxRunner(out)
    refused = agreed = 0
    for length in (12, 16, 23, 30):
        for seed in range(4):
            ids = _prompt(length, seed)
            want = model.generate(ids, max_new_tokens=NEW)
            if list(model.last_report.layer_budgets.values()) == fixed:
                np.testing.assert_array_equal(runner.generate(ids, max_new_tokens=NEW), want.numpy())
                agreed += 1
            else:
                with pytest.raises(KVPassError, match="budgets='runtime'") as info:
                    runner.generate(ids, max_new_tokens=NEW)
                assert info.value.argument == "input_ids"
                refused += 1
    assert refused and agreed


# ----------------------------------------------------------------------------------------------- fractions
def test_fraction_budget_is_taken_of_each_prompt(llama, tmp_path):
    """A fraction budget is taken of the prompt + new tokens at run time, in the runner too (the export took it
    of max_length)."""
    model = kvpass.apply(llama, policy="streamingllm", budget=0.3, sinks=2, interval=4)
    meta = export_onnx(model, tmp_path, max_length=MAX_LENGTH)
    assert meta["budgets"] == "runtime" and meta["budget"] == 0.3
    prompts = [_prompt(n, 1) for n in (14, 25, 40)]
    budgets = set()
    for ids in prompts:
        model.generate(ids, max_new_tokens=NEW)
        budgets.add(model.last_report.budget_tokens)
    assert len(budgets) == 3
    _assert_runner_equals_runtime(model, tmp_path, prompts)
    ids, mask = _padded()
    _assert_runner_equals_runtime(model, tmp_path, [ids], mask)


# ----------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("policy, kwargs, reason", [
    ("quest", {}, "decode attention is 'page_recall'"),
    ("clusterkv", {}, "decode attention is 'cluster_recall'"),
    ("ems", {}, "decode attention is 'ems_expansion'"),
    ("d2o", {"first_compression": "decode"}, "after the first decode step"),
    ("d2o", {"skip_layers": (0,), "skip_memory": "extra"}, "keeps layers [0] whole"),
])
def test_export_refuses_policies_whose_runtime_decisions_it_cannot_make(llama, tmp_path, policy, kwargs, reason):
    model = kvpass.apply(llama, policy=policy, budget=40 if policy == "ems" else 10, **kwargs)
    with pytest.raises(InvalidValue, match="cannot be exported to ONNX") as info:
        export_onnx(model, tmp_path, max_length=MAX_LENGTH)
    assert reason in str(info.value) and info.value.argument == "model"


def test_export_refuses_a_compress_that_specialises_on_its_budget(llama, tmp_path):
    """H2O computes its recent window as int(keep * recent_ratio) in Python: traced with a symbolic budget it
    would keep the example's window for every budget. The check against the policy finds it and refuses; with an
    int budget (fixed) it exports."""
    model = kvpass.apply(llama, policy="h2o", budget=0.3)
    with pytest.raises(InvalidValue, match="does not trace exactly with the budget as an input") as info:
        export_onnx(model, tmp_path, max_length=MAX_LENGTH)
    assert info.value.argument == "budgets" and "budgets='fixed' and an int budget" in str(info.value)
    with pytest.raises(InvalidValue, match="budgets must be one of runtime, fixed"):
        export_onnx(model, tmp_path, max_length=MAX_LENGTH, budgets="guess")


# ----------------------------------------------------------------------------------------------- every policy
# (policy, budget, kwargs) of every registered policy the exporter accepts, each with prompts whose budgets vary:
# per-layer budgets from the prompt (d2o, pyramidkv) or a fraction (the others); h2o computes on its budget in
# Python (int(keep * recent_ratio)) and exports with an int budget only. Refused: the recall policies (quest,
# clusterkv, ems) and D2O's deferred first compression / layers kept whole (above); cam, kvmerger, adakv and
# chelsea, whose compress does not trace to ONNX at all (below).
EXPORTABLE = [("d2o", 10, {"interval": 4}), ("d2o", 10, {"merge": False}), ("d2o", 0.3, {}),
              ("pyramidkv", 12, {"window": 4, "interval": 4}), ("snapkv", 0.3, {"window": 4, "interval": 4}),
              ("tova", 0.3, {}), ("knorm", 0.3, {"interval": 4}), ("streamingllm", 0.3, {"sinks": 2, "interval": 4}),
              ("full", 0.3, {}), ("h2o", 10, {})]


@pytest.mark.parametrize("policy, kwargs", [("cam", {}), ("kvmerger", {}), ("adakv", {}),
                                            ("chelsea", {"sinks": 2, "recent": 4, "chunk": 8})])
def test_export_refuses_a_compress_it_cannot_trace(llama, tmp_path, policy, kwargs):
    """A compress that is not straight-line tensor code (a data-dependent branch, an op ONNX lacks) is refused
    with what stopped the trace, whichever budgets mode."""
    model = kvpass.apply(llama, policy=policy, budget=10, **kwargs)
    with pytest.raises((NotImplementedError, InvalidValue), match=f"{policy}.compress cannot be") as info:
        export_onnx(model, tmp_path, max_length=MAX_LENGTH, budgets="fixed")
    assert "straight-line tensor code" in str(info.value)


@pytest.mark.slow
@pytest.mark.parametrize("policy, budget, kwargs", EXPORTABLE, ids=[f"{p}-{b}-{k}" for p, b, k in EXPORTABLE])
def test_every_exportable_policy_equals_runtime_where_budgets_vary(llama, tmp_path, policy, budget, kwargs):
    model = kvpass.apply(llama, policy=policy, budget=budget, **kwargs)
    meta = export_onnx(model, tmp_path, max_length=MAX_LENGTH)
    if type(model.policy).layer_budgets is not kvpass.Policy.layer_budgets:
        prompts = _uneven_prompts(model)
    else:
        prompts = [_prompt(n, 2) for n in (14, 25, 40)]
    assert meta["budgets"] == ("fixed" if isinstance(budget, int) and policy not in ("d2o", "pyramidkv") or
                               policy == "full" else "runtime")
    _assert_runner_equals_runtime(model, tmp_path, prompts)
    ids, mask = _padded()
    _assert_runner_equals_runtime(model, tmp_path, [ids], mask)
