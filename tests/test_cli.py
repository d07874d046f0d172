"""The command line: listing, argument parsing and clear errors (exit code 2, nothing loaded)."""

from __future__ import annotations

import pytest

from kvpass import POLICIES
from kvpass.cli import main, parse_budget, parse_policy_args


def test_policies_lists_every_policy_with_its_section(capsys):
    assert main(["policies"]) == 0
    out = capsys.readouterr().out
    for name, cls in POLICIES.items():
        assert name in out and cls.section in out
    assert "(default with kernel=31)" in out          # the default is a spec: kvpass.DEFAULT_POLICY


def test_budget_and_policy_arguments_parse():
    assert parse_budget("0.2") == 0.2 and isinstance(parse_budget("0.2"), float)
    assert parse_budget("512") == 512 and isinstance(parse_budget("512"), int)
    assert parse_policy_args(["sinks=8", "beta=0.5", "flag=true", "mode=code"]) == \
        {"sinks": 8, "beta": 0.5, "flag": True, "mode": "code"}


@pytest.mark.parametrize("argv, message", [
    (["generate", "--policy", "nope"], "unknown policy 'nope'; available:"),
    (["generate", "--budget", "1.5"], "must lie in (0, 1]"),
    (["generate", "--policy", "streamingllm", "--set", "sink=3"], "no parameter(s) sink"),
])
def test_generate_rejects_bad_input_before_loading(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def _subparsers(parser):
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield name, sub
                for deeper, subsub in _subparsers(sub):
                    yield f"{name} {deeper}", subsub


def test_every_command_prints_its_help(capsys):
    """--help of every command and subcommand renders (a bare % in a help text once crashed it)."""
    from kvpass.cli import build_parser

    names = [name for name, _ in _subparsers(build_parser())]
    assert {"generate", "eval suite run", "eval suite calibrate"} <= set(names)
    for name in names:
        with pytest.raises(SystemExit) as done:
            main([*name.split(), "--help"])
        assert done.value.code == 0, name
        assert "usage:" in capsys.readouterr().out, name
