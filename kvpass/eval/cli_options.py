"""Options shared by the evaluation commands (kvpass/eval/cli.py, kvpass/eval/suite_cli.py): ``--shard i/n``, the
policies and budgets checked before any work, per-family answer lengths."""

from __future__ import annotations

import argparse


def _shard(text: str) -> tuple[int, int]:
    i, n = (int(v) for v in text.split("/"))
    if not 0 <= i < n:
        raise argparse.ArgumentTypeError(f"--shard {text}: need 0 <= i < n")
    return i, n


def check_policies_and_budgets(policies: list[str], budgets: list) -> None:
    """Every --policies spec and --budgets value refused (a KVPassError naming it) before any model loads."""
    from kvpass.policies import policy_from_spec
    from kvpass.validation import check_budget

    for policy in policies:
        policy_from_spec(policy)
    for budget in budgets:
        check_budget(budget)


def family_tokens(items: list[str]) -> dict[str, int]:
    """--max-new-tokens FAMILY=N ... -> {family: N}; refused (``cli.value``) unless every item is a known family
    and an int N >= 1."""
    from kvpass.eval.tasks import FAMILIES
    from kvpass.validation import check_option

    out = {}
    for item in items:
        family, _, n = item.partition("=")
        check_option("--max-new-tokens", family in FAMILIES and n.strip().isdigit() and int(n) >= 1, item,
                     f"FAMILY=N with FAMILY one of {', '.join(FAMILIES)} and N an int >= 1")
        out[family] = int(n)
    return out
