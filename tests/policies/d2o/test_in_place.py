"""D2O's compression in the layer's own buffers on the CPU (``D2O.compress_into`` / ``compress_rows_into``: the
plain-torch step ``evict_in_place``, which the decode ops also run on the CPU) against the reference, for every
option: one budget for every row (every row over it evicts down to it), rows of their own budgets (a due row as
alone, the others unchanged), one eviction a step (interval 1) and several. End to end: generation through the
runtime gives the same tokens as the slow path (``compress`` and a copy back, rows each alone)."""

from __future__ import annotations

import pytest
import torch

from kvpass.cache import take_rows
from kvpass.policies.capabilities import InPlace
from kvpass.policies.d2o import D2O
from tests.policies.d2o.cases import (
    assert_rows_equal,
    assert_rows_unchanged,
    copied,
    decode_write,
    ordered_cache,
    reference,
    reference_rows,
    shuffled,
)
from tests.policies.policy_helpers import apply_cached, by_position

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

OPTIONS = [dict(), dict(d2o_variant="code"), dict(scores="window"), dict(merge_into_sinks=False),
           dict(merge_into_sinks=False, d2o_variant="code", merge_floor=0.2), dict(merge=False),
           dict(sinks=0, n_m_ratio=(1, 0)), dict(merge_bias=True), dict(merge_bias=True, d2o_variant="code"),
           dict(merge_protect=0.5), dict(merge_protect=0.9, merge_into_sinks=False, d2o_variant="code"),
           dict(merge_weighting="score"), dict(merge_weighting="score", merge_protect=0.3, scores="window"),
           dict(merge_chains=False)]
GUARDS = [o for o in OPTIONS if o.get("merge_bias") or o.get("merge_protect") or o.get("merge_weighting")]


def name(options: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in options.items()) or "default"


@pytest.mark.parametrize("interval", [1, 4, 16])
@pytest.mark.parametrize("options", OPTIONS, ids=name)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_compress_into_equals_the_reference(interval: int, options: dict, dtype: torch.dtype) -> None:
    """One budget: every row over it (full at C = keep + interval entries, or not) evicts down to it, the others
    (at most keep) nothing; each row as the reference gives it, from a shuffled copy; then steps of decode writes."""
    policy = D2O(interval=interval, **options)
    keep = 20
    c = keep + interval
    lengths = [[c, c, c], [c, 7, keep], [keep, 5, 1], [c, c, 11], [c - 1, keep + 1, min(keep + 2, c)]]
    merged_any = False
    for seed in range(2):
        got = shuffled(ordered_cache(lengths, c, 8, seed, dtype), seed)
        gen = torch.Generator().manual_seed(1000 + seed)      # not the cache's seed: other keys
        for step in range(3):
            want = reference(policy, got, keep)
            before = copied(got)
            policy.compress_into(got, keep)
            assert_rows_equal(got, want, list(range(len(lengths))), f"seed {seed} step {step}")
            merged_any |= bool((by_position(got)["k"][:, :, :keep] != by_position(before)["k"][:, :, :keep]).any())
            for i in range(interval):
                decode_write(got, step * interval + i, gen)
    assert merged_any or not options.get("merge", True), "no merge happened"


@pytest.mark.parametrize("interval", [1, 4])
@pytest.mark.parametrize("options", OPTIONS[:5] + GUARDS, ids=name)
def test_rows_of_their_own_budgets_in_one_call(interval: int, options: dict) -> None:
    """Per-row budgets (``compress_rows_into``): a due row (budget + interval entries in some head) is what the
    reference gives it alone at its own budget and capacity; a row not due (fewer entries, even above its
    budget) and a row whose budget exceeds the capacity are left as they are."""
    policy = D2O(interval=interval, **options)
    keeps = [20, 12, 17, 9, 60]
    c = 20 + interval
    caps = [k + interval for k in keeps]
    lengths = [[20 + interval] * 3, [12 + interval, 5, 12 + interval - 1], [17 + interval - 1, 17, 3],
               [9 + interval, 9, 2], [c - 2, c, 1]]
    due = [0, 1, 3]
    for seed in range(3):
        got = shuffled(ordered_cache(lengths, c, 8, seed), seed)
        before = copied(got)
        policy.compress_rows_into(got, torch.tensor(keeps))
        for b in due:
            assert_rows_equal(take_rows(got, [b]), reference_rows(policy, before, keeps, caps, b), [0],
                              f"seed {seed}, row {b}")
        assert_rows_unchanged(got, before, [2, 4], f"seed {seed}")


@pytest.fixture
def prompt_ids() -> torch.Tensor:
    return torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))


def slow_path(monkeypatch) -> None:
    """D2O without its capabilities' fast forms: ``compress`` and a copy back, rows each alone."""
    monkeypatch.setattr(D2O, "compress_into", InPlace.compress_into)
    monkeypatch.setattr(D2O, "rows_in_one_call", lambda self, budgets, capacities: False)


@pytest.mark.parametrize("spec", ["d2o", "d2o[interval=4]"])
@pytest.mark.parametrize("kwargs", [dict(), dict(allocation="uniform"), dict(scores="window", merge_into_sinks=False),
                                    dict(d2o_variant="code"), dict(merge_bias=True),
                                    dict(merge_protect=0.5, merge_weighting="score")], ids=name)
def test_generation_equals_the_slow_path(spec: str, kwargs: dict, prompt_ids: torch.Tensor, monkeypatch) -> None:
    """Through the runtime on a tiny Llama (batch of 2, per-row layer budgets unless uniform): the in-place step
    generates the same tokens as the slow path, and it is the one that ran."""
    import kvpass.policies.d2o.policy as d2o_policy

    calls = []
    real = d2o_policy.evict_in_place
    monkeypatch.setattr(d2o_policy, "evict_in_place", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    fast = apply_cached("llama", spec, 12, **kwargs).generate(prompt_ids, max_new_tokens=14, do_sample=False,
                                                              eos_token_id=None)
    assert calls, "the in-place step did not run"
    calls.clear()
    slow_path(monkeypatch)
    model = apply_cached("llama", spec, 12, **kwargs)
    slow = model.generate(prompt_ids, max_new_tokens=14, do_sample=False, eos_token_id=None)
    assert not calls
    report = model.last_report
    assert all(n <= report.layer_budgets[i] + model.policy.interval for i, n in report.entries.items())
    assert torch.equal(fast, slow)


@pytest.mark.parametrize("budget", [12, 0.5])
def test_rows_of_other_lengths_generate_as_alone(budget: float, monkeypatch) -> None:
    """A left-padded batch whose rows fill their buffers at different steps: each row generates what it generates
    alone, and the same as the slow path."""
    from tests.conftest import padded_batch

    ids, mask = padded_batch([24, 15], seed=3)
    model = apply_cached("llama", "d2o[interval=4]", budget)
    fast = model.generate(ids, attention_mask=mask, max_new_tokens=14, do_sample=False, eos_token_id=None)
    for row, n in ((0, 24), (1, 15)):
        alone = model.generate(ids[row:row + 1, -n:], max_new_tokens=14, do_sample=False, eos_token_id=None)
        assert torch.equal(alone[0, -14:], fast[row, -14:]), f"row {row}"
    slow_path(monkeypatch)
    slow = apply_cached("llama", "d2o[interval=4]", budget).generate(ids, attention_mask=mask, max_new_tokens=14,
                                                                     do_sample=False, eos_token_id=None)
    assert torch.equal(fast, slow)
