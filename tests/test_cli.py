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


# ----------------------------------------------------------------------------------------------- generate, end to end
@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A transformers directory: a tiny random Llama with SmolLM2's tokenizer (its chat template builds the
    built-in prompt), so `kvpass generate` runs in seconds."""
    import torch
    import transformers

    from kvpass.models import gguf_path

    try:
        path = gguf_path("smollm2")
    except FileNotFoundError as err:
        pytest.skip(str(err))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=512, eos_token_id=tokenizer.eos_token_id)
    out = tmp_path_factory.mktemp("tiny_llama")
    transformers.LlamaForCausalLM(cfg).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


def _generate(capsys, model_dir, *extra):
    code = main(["generate", "--model", model_dir, "--context-tokens", "60", "--max-new-tokens", "6", *extra])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_generate_shows_progress_and_why_full_holds_more(tiny_model_dir, capsys):
    code, out, err = _generate(capsys, tiny_model_dir, "--policy", "full")
    assert code == 0, err
    for line in ("loading ", "rewriting 2 layers for full", "prefilling ", "prefilled in ", "decoded "):
        assert line in err, line
    assert err.index("loading ") < err.index("rewriting ") < err.index("prefilling ")
    assert "every token kept; the budget does not apply" in out
    cache = out[out.index("cache bytes:"):]
    ratio = float(cache.split("full (")[1].split("%")[0])
    assert ratio <= 100 or "(more than full: the cache holds prompt + max_new_tokens" in cache
    assert ratio > 100 and "a position and a log-weight per slot (+" in cache      # the tiny model's float32 slots
    _, _, quiet = _generate(capsys, tiny_model_dir, "--policy", "full", "--quiet")
    assert "prefilling" not in quiet


def test_generate_warns_of_a_budget_too_small_to_be_useful(tiny_model_dir, capsys):
    code, _, err = _generate(capsys, tiny_model_dir, "--policy", "streamingllm", "--budget", "8", "--set", "sinks=2")
    assert code == 0 and "warning: budget 8 keeps 8 of" in err and "for a fraction write e.g. --budget 0.2" in err
    code, _, err = _generate(capsys, tiny_model_dir, "--policy", "streamingllm", "--budget", "0.5")
    assert code == 0 and "warning" not in err


def test_generate_samples_with_a_seed(tiny_model_dir, capsys):
    args = ("--policy", "streamingllm", "--budget", "0.5", "--sample", "--temperature", "0.8", "--top-p", "0.9",
            "--sampling-seed", "3", "--repetition-penalty", "1.2")
    first = _generate(capsys, tiny_model_dir, *args)
    second = _generate(capsys, tiny_model_dir, *args)
    assert first[0] == second[0] == 0
    answer = [line for line in first[1].splitlines() if line.startswith("answer:")]
    assert answer == [line for line in second[1].splitlines() if line.startswith("answer:")]
    assert "sampling:          temperature 0.8, top-k 50 (transformers' default), top-p 0.9, seed 3" in first[1]
    greedy = _generate(capsys, tiny_model_dir, "--policy", "streamingllm", "--budget", "0.5")
    other = _generate(capsys, tiny_model_dir, *args[:-4], "--sampling-seed", "4")
    assert {tuple(answer), tuple(line for line in other[1].splitlines() if line.startswith("answer:")),
            tuple(line for line in greedy[1].splitlines() if line.startswith("answer:"))} != {tuple(answer)}


@pytest.mark.parametrize("argv, message", [
    (["--top-k", "5"], "--top-k must be used with --sample"),
    (["--sample", "--temperature", "0"], "--temperature must be a number > 0"),
    (["--sample", "--top-p", "1.5"], "--top-p must be a number in (0, 1]"),
    (["--repetition-penalty", "-1"], "--repetition-penalty must be a number > 0"),
])
def test_generate_sampling_options_refused_before_loading(argv, message, capsys):
    assert main(["generate", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "loading" not in err
