"""Policy specs, ``name[key=value,...]``: how evaluations name a configuration of a policy."""

import pytest

from kvpass.errors import KVPassError
from kvpass.eval.common import uses_budget
from kvpass.eval.niah import cells
from kvpass.policies import get_policy, parse_value, policy_from_spec, split_spec


def test_values_parse_as_a_user_writes_them():
    assert parse_value("8") == 8 and parse_value("0.5") == 0.5
    assert parse_value("true") is True and parse_value("False") is False and parse_value("window") == "window"


def test_a_spec_builds_the_policy_with_those_hyperparameters():
    assert split_spec("snapkv") == ("snapkv", {})
    assert split_spec("d2o[scores=window, merge_bias=true]") == ("d2o", {"scores": "window", "merge_bias": True})
    assert policy_from_spec("d2o[scores=window,merge_bias=true]") == get_policy("d2o", scores="window",
                                                                                 merge_bias=True)
    assert policy_from_spec("streamingllm[sinks=8]").sinks == 8


@pytest.mark.parametrize("spec", ["d2o[scores]", "d2o[scores=window", "nope", "d2o[no_such=1]"])
def test_a_bad_spec_is_refused_by_name(spec):
    with pytest.raises(KVPassError) as err:
        policy_from_spec(spec)
    assert isinstance(err.value, ValueError | TypeError)


def test_evaluation_cells_take_specs():
    got = cells(["full", "d2o[scores=window]"], [0.2], ["query_aware"], reference=False)
    assert [(c.policy, c.budget) for c in got] == [("full", None), ("d2o[scores=window]", 0.2)]
    assert uses_budget("d2o[scores=window]") and not uses_budget("full")
    with pytest.raises(KVPassError):
        cells(["d2o[scores=nowhere]"], [0.2], ["query_aware"])


def test_get_policy_and_apply_take_a_spec_and_keywords_override_it():
    """The default policy is a spec (kvpass.DEFAULT_POLICY), so kvpass.apply / the CLI take specs."""
    assert get_policy("d2o[scores=window]") == get_policy("d2o", scores="window")
    assert get_policy("d2o[scores=window,window=16]", window=8).window == 8
    assert get_policy("streamingllm[sinks=2]").name == "streamingllm"
