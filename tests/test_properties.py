"""Property-based tests (hypothesis, issue 27): random policies and parameters, budgets, batch sizes, padding
patterns and prompt lengths at the edges (1 token, exactly the budget, budget + 1, context - 1) either get a
refusal from kvpass.validation's table (a KVPassError naming a rule's argument) or an output with the
invariants: every compressed layer within budget + interval for every row, finite logits, every row equal to
its solo run, and ``full`` equal to transformers. Small example counts keep it to about a minute on 2 cores."""

from __future__ import annotations

import torch

# a plain import, not importorskip: hypothesis is a dev dependency (pyproject.toml), so CI (`make test`) has it,
# and a missing install fails loudly instead of skipping the property tests
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvpass.errors import KVPassError
from kvpass.validation import RULES
from tests.policies.policy_helpers import apply_cached, captured_model

CONTEXT = 256                     # the tiny Llama's positions
ARGUMENTS = {r.argument for r in RULES}
PARAMS = {                        # policy -> strategies of some of its parameters (valid and invalid values)
    "streamingllm": {"sinks": st.integers(-1, 8), "interval": st.integers(0, 8)},
    "h2o": {"recent_ratio": st.floats(-0.5, 1.5, allow_nan=False), "interval": st.integers(1, 4)},
    "snapkv": {"window": st.integers(0, 8), "interval": st.integers(1, 8)},
    "pyramidkv": {"window": st.integers(1, 8), "beta": st.floats(0.5, 30, allow_nan=False)},
    "d2o": {"sinks": st.integers(0, 6), "beta": st.floats(-0.2, 1.2, allow_nan=False),
            "d2o_variant": st.sampled_from(["paper", "code", "other"])},
    "cam": {"interval": st.integers(1, 4)},
    "kvmerger": {"interval": st.integers(1, 8)},
    "knorm": {"sinks": st.integers(-1, 8), "interval": st.integers(1, 8)},
    "tova": {"sinks": st.integers(0, 8), "interval": st.integers(1, 4)},
    "ems": {"local_window": st.integers(0, 8), "gamma": st.floats(0.5, 5.0, allow_nan=False)},
    "full": {},
}
SETTINGS = settings(max_examples=120, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def cases(draw):
    policy = draw(st.sampled_from(sorted(PARAMS)))
    params = {name: draw(s) for name, s in PARAMS[policy].items() if draw(st.booleans())}
    budget = draw(st.one_of(st.floats(0.05, 1.0), st.integers(1, 64), st.sampled_from([0, 1.5, CONTEXT + 1])))
    batch = draw(st.integers(1, 3))
    edge = draw(st.sampled_from(["one", "budget", "budget+1", "context-1", "random"]))
    new = draw(st.integers(1, 6))
    token_budget = budget if isinstance(budget, int) else 16
    longest = {"one": 1, "budget": token_budget, "budget+1": token_budget + 1, "context-1": CONTEXT - 1,
               "random": draw(st.integers(1, 60))}[edge]
    longest = max(1, min(longest, CONTEXT - 1))
    lengths = [longest] + [draw(st.integers(1, longest)) for _ in range(batch - 1)]
    seed = draw(st.integers(0, 2**16))
    return policy, params, budget, lengths, new, seed


def _batch(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    t = max(lengths)
    ids = torch.zeros(len(lengths), t, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, t - n:] = torch.randint(1, 128, (n,), generator=g)
        mask[row, t - n:] = 1
    return ids, mask


@SETTINGS
@given(cases())
def test_refused_by_the_table_or_within_the_invariants(case):
    policy, params, budget, lengths, new, seed = case
    ids, mask = _batch(lengths, seed)
    model, _, _ = captured_model("llama")
    try:
        kv = apply_cached("llama", policy, budget, **params)
        out = kv.generate(ids, attention_mask=mask, max_new_tokens=new, eos_token_id=None,
                          return_dict_in_generate=True, output_logits=True)
    except KVPassError as err:
        assert err.argument in ARGUMENTS or err.argument in PARAMS[policy] or "policy_kwargs" == err.argument, err
        assert isinstance(err, (ValueError, TypeError)), err
        event(f"refused: {err.argument}")
        return
    event(f"generated: {policy}")
    logits = torch.stack(out.logits, 1)
    assert torch.isfinite(logits).all()
    report = out.report
    interval = getattr(kv.policy, "interval", 1)
    for row in report.row_layer_budgets:
        for layer, b in row.items():
            assert report.entries[layer] <= report.layer_budgets[layer] + interval and b <= report.layer_budgets[layer]
    tokens = out.sequences[:, ids.shape[1]:]
    for row, n in enumerate(lengths):             # every row as alone (fp32: rounding-level logits)
        alone = kv.generate(ids[row:row + 1, ids.shape[1] - n:], max_new_tokens=new, eos_token_id=None,
                            return_dict_in_generate=True, output_logits=True)
        assert torch.equal(tokens[row], alone.sequences[0, n:])
        torch.testing.assert_close(logits[row], torch.stack(alone.logits, 1)[0], rtol=1e-4, atol=1e-4)
    if policy == "full":
        want = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
        assert torch.equal(out.sequences, want)
