"""Left-padded batches (ragged per-row lengths, docs/policies.md §0.6): a row of a batch generates exactly
what it generates alone, for every issue-5 policy."""

from __future__ import annotations

import pytest
import torch

import kvpass
from tests.policies.merging_support import prompt, tiny_model

CASES = {
    "chelsea": dict(sinks=4, recent=8, chunk=16, interval=8),
    "quest": dict(full_layers=0),
    "clusterkv": dict(sinks=4, cluster_ratio=8, window=4, window_clusters=2, full_layers=0),
    "kvmerger": dict(interval=8),
}


@pytest.mark.parametrize("policy", sorted(CASES))
def test_padded_row_matches_row_alone(policy):
    km = kvpass.apply(tiny_model("llama"), policy=policy, budget=30, **CASES[policy])
    ids = prompt(2, 80)
    mask = torch.ones_like(ids)
    mask[1, :17] = 0
    batch = km.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=[])
    alone = km.generate(ids[1:, 17:], max_new_tokens=12, eos_token_id=[])
    assert km.last_report.compressions > 0 or policy in ("quest", "clusterkv")
    assert torch.equal(batch[1, 17:], alone[0])
