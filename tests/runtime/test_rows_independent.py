"""Every batch row decodes what it decodes alone (issue 27): no policy's decisions (budgets, per-layer
budgets, compression times, thresholds) depend on a row's batch-mates, with or without left padding.
Greedy, fp32, CPU, a tiny random Llama; tokens equal and logits within 1e-4."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import kvpass
import kvpass.runtime.session as session_module
from kvpass.policies import POLICIES
from kvpass.policies.d2o import D2O
from tests.conftest import padded_batch
from tests.policies.policy_helpers import apply_cached, captured_model

# small windows so that budgets of a few dozen tokens compress (the paper defaults need hundreds)
SMALL = {"chelsea": dict(sinks=2, recent=4, chunk=8, interval=4), "ems": dict(local_window=4),
         "snapkv": dict(window=4, interval=3), "pyramidkv": dict(window=4, interval=3),
         "streamingllm": dict(sinks=2, interval=3), "clusterkv": dict(sinks=2, window=8, cluster_ratio=4, full_layers=0),
         "quest": dict(page_size=4, full_layers=0), "kvmerger": dict(interval=3)}
NEW = 12
# ClusterKV's k-means assignments are discrete decisions on cosines: in fp32 the last-bit differences between a
# batched and a one-row matmul can flip a near-tie (seen on these prompts: same clusters in fp64, not in fp32),
# which is rounding, not coupling. It is compared in fp64, where the rows' inputs to every decision agree.
# EMS likewise: its demoted centre merges into the centre of highest R = cos(k) cos(v), and on these prompts
# two centres' R differ by 1.2e-7 in fp32 (0.99999779 vs 0.99999768), so the rows' last-bit differences pick
# different ones (seen at decode step 10 of the padded-fraction case; tokens still equal).
FP64 = {"clusterkv", "ems"}


@functools.cache
def _double_llama():
    model, _, _ = captured_model("llama")
    return copy.deepcopy(model).double()
# (lengths, budget): equal lengths with a fraction; left padding with a fraction (each row's own tokens set its
# budget) and with a token count
CASES = [([40, 40, 40], 0.4), ([40, 23, 31], 0.4), ([40, 23, 31], 14)]


def _greedy(kv, ids, mask):
    out = kv.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                      return_dict_in_generate=True, output_logits=True)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, 1)


@pytest.mark.parametrize("lengths, budget", CASES, ids=["equal", "padded-fraction", "padded-tokens"])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_each_row_decodes_as_alone(policy, lengths, budget):
    if policy in FP64:
        kv = kvpass.apply(_double_llama(), policy, budget, **SMALL.get(policy, {}))
    else:
        kv = apply_cached("llama", policy, budget, **SMALL.get(policy, {}))
    ids, mask = padded_batch(lengths, seed=len(lengths) + sum(lengths))
    tokens, logits = _greedy(kv, ids, mask)
    for row, n in enumerate(lengths):
        alone_ids = ids[row:row + 1, ids.shape[1] - n:]
        alone_tokens, alone_logits = _greedy(kv, alone_ids, None)
        assert torch.equal(tokens[row:row + 1], alone_tokens), (policy, row)
        torch.testing.assert_close(logits[row:row + 1], alone_logits, rtol=1e-4, atol=1e-4)


def test_d2o_layer_budgets_are_per_row():
    """Rows of different prompts get different D2O layer budgets (the row's own attention variance), each
    summing to the row's total and equal to the row's alone; the buffers hold the largest."""
    kv = apply_cached("llama", "d2o[interval=1]", 0.4)
    ids, mask = padded_batch([40, 40, 40], seed=2)
    session = kv.start(ids, mask, max_new_tokens=NEW)
    compressed = [lay for lay in session.layers if lay.compressible]
    per_row = [[lay.row_budgets[b] for lay in compressed] for b in range(3)]
    assert len({tuple(r) for r in per_row}) == 3               # [20, 20], [18, 22], [23, 17]
    for b in range(3):
        assert sum(per_row[b]) == len(per_row[b]) * int(0.4 * (40 + NEW))
        alone = kv.start(ids[b:b + 1], max_new_tokens=NEW)
        assert [lay.budget for lay in alone.layers if lay.compressible] == per_row[b]
    for lay in compressed:
        assert lay.budget == max(lay.row_budgets) and lay.cache.capacity == lay.budget + 1


@pytest.mark.parametrize("lengths", [[40, 40, 40], [40, 23, 31]], ids=["equal", "padded"])
@pytest.mark.parametrize("spec", ["d2o[interval=1,merge_protect=0.5]", "d2o[interval=1,merge_weighting=score]",
                                  "d2o[interval=1,merge_protect=0.25,merge_weighting=score,merge_bias=true,"
                                  "d2o_variant=code]"],
                         ids=["merge_protect", "score-weights", "both"])
def test_d2o_guarded_merges_decode_each_row_as_alone(spec, lengths, monkeypatch):
    """D2O's merge_protect and merge_weighting="score" (no Triton op: the plain-torch in-place step): rows of
    their own layer budgets (different prompts, different budgets, equal lengths or left-padded) are compressed
    in one call per layer (``D2O.compress_rows_into``, never the runtime's per-row copies) and still decode
    what they decode alone."""
    kv = apply_cached("llama", spec, 0.4)
    ids, mask = padded_batch(lengths, seed=len(lengths) + sum(lengths))
    calls = []
    one_call = D2O.compress_rows_into
    monkeypatch.setattr(session_module, "compress_rows_into", lambda *a: pytest.fail("per-row path taken"))
    monkeypatch.setattr(D2O, "compress_rows_into", lambda self, *a: calls.append(1) or one_call(self, *a))
    tokens, logits = _greedy(kv, ids, mask)
    assert calls, "no layer had rows of their own budgets: the test does not exercise the batched path"
    for row, n in enumerate(lengths):
        alone_tokens, alone_logits = _greedy(kv, ids[row:row + 1, ids.shape[1] - n:], None)
        assert torch.equal(tokens[row:row + 1], alone_tokens), row
        torch.testing.assert_close(logits[row:row + 1], alone_logits, rtol=1e-4, atol=1e-4)
