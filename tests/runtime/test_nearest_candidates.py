"""D2O's fused nearest-key search end to end (``FusedDecodeStatistics.nearest_candidates``,
kvpass/kernels/decode_attention_nearest.py): the decode graph attends with ``decode_attention_nearest`` where the
paper's one-in-one-out step runs, the runtime keeps the layers' state, and generation is token for token what it is
without the search (the capability turned off: every step scans), here with the Triton eviction (under the
interpreter, as on CUDA) taking the attention's results where it can; the exporters get the plain attention."""

from __future__ import annotations

import importlib

import pytest
import torch

from kvpass.export.onnx_export import per_step_graphs
from kvpass.head_group import SINGLE_PROCESS
from kvpass.kernels.decode_attention_nearest import fuses_at
from kvpass.policies.d2o import D2O
from kvpass.policies.d2o.evict_one import evict_one_triton
from kvpass.policies.d2o.in_place import StepTensors, evicted_slots
from kvpass.policies.d2o.merge import StepOptions
from tests.conftest import padded_batch
from tests.policies.policy_helpers import apply_cached
from tests.runtime.test_rows_independent import _greedy

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
NEAREST_OP = torch.ops.kvpass.decode_attention_nearest.default


def _attention_ops(kv) -> list:
    return [n.target for n in kv.graphs.decode.graph.nodes
            if n.op == "call_function" and "decode_attention" in str(n.target)]


def scanning(monkeypatch, *args, **kwargs):
    """``apply_cached(*args, **kwargs)`` with D2O's fused search turned off: every step scans."""
    with monkeypatch.context() as m:
        m.setattr(D2O, "nearest_candidates", lambda self: 0)
        return apply_cached(*args, **kwargs)


def test_the_paper_step_attends_with_the_search_and_the_rest_do_not(monkeypatch):
    kv = apply_cached("llama", "d2o", 0.4)
    layers = tuple(s.layer for s in kv.graphs.sites)
    assert kv.graphs.nearest_layers == layers and _attention_ops(kv) == [NEAREST_OP] * len(layers)
    for other in (scanning(monkeypatch, "llama", "d2o", 0.4), apply_cached("llama", "d2o", 0.4, interval=3),
                  apply_cached("llama", "d2o", 0.4, merge_protect=0.5), apply_cached("llama", "h2o", 0.4)):
        assert other.graphs.nearest_layers == () and NEAREST_OP not in _attention_ops(other)
    exported = per_step_graphs(kv)
    assert exported.nearest_layers == () and NEAREST_OP not in [n.target for n in exported.decode.graph.nodes]


def _triton_eviction(monkeypatch) -> list[int]:
    """Run D2O's decode step through the Triton kernels on CPU (the interpreter); returns [hits, misses]: evicting
    rows whose entry was among the attention's candidates, and the others."""
    counts = [0, 0]

    def op(k, v, score, position, log_weight, length, tau, tau_set, others, nearest, split, beta, variant, min_cos,
           bias):
        t = StepTensors(k, v, score, position, log_weight, length, tau, tau_set, others)
        if nearest and fuses_at(k.shape[0]):
            keep, _, sinks, recent, _ = split.unbind(0)
            e, valid, _, _ = evicted_slots(t, keep, keep + 1, 1, sinks, recent, SINGLE_PROCESS)
            hit = (nearest[3] == e).any(-1)[valid[..., 0]]
            counts[0] += int(hit.sum())
            counts[1] += int((~hit).sum())
        evict_one_triton(t, nearest, split, StepOptions(beta=beta, variant=variant, min_cos=min_cos, bias=bias),
                         splits=2, block_c=8, block_scan=16)

    monkeypatch.setattr(D2O, "_on_kernels", lambda self, cache: self._kernel_options())
    monkeypatch.setattr(torch.ops.kvpass, "d2o_evict_one", op)
    return counts


@pytest.mark.skipif(torch.cuda.is_available(), reason="the Triton step on CPU tensors needs the interpreter (no GPU); "
                    "on a GPU benchmarks/probes/nearest_candidates_gpu.py checks the same")
@pytest.mark.parametrize("lengths, fuse_from, options", [
    ([40], 1, {}), ([33], 1, {}),          # one row: one budget, the in-place step of compress_into
    ([40], None, {}),                      # the default FUSE_FROM_BATCH: batch 1 scans, names nothing
    ([40, 33, 37, 29], None, {}),          # batch 4 fuses; rows of their own budgets in one call
    ([40, 33], 1, {"first_compression": "decode"}),      # new buffers after the first step: new norms
    ([40, 33], 1, {"prefill_chunk": 16})])                # compressed between the prompt's chunks
def test_same_tokens_and_logits_as_the_scanning_step(monkeypatch, lengths, fuse_from, options):
    nearest_module = importlib.import_module("kvpass.kernels.decode_attention_nearest")
    if fuse_from is not None:
        monkeypatch.setattr(nearest_module, "FUSE_FROM_BATCH", fuse_from)
    counts = _triton_eviction(monkeypatch)
    fused = apply_cached("llama", "d2o", 0.4, **options)
    plain = scanning(monkeypatch, "llama", "d2o", 0.4, **options)
    ids, mask = padded_batch(lengths, seed=5)
    tokens, logits = _greedy(fused, ids, mask)
    if not nearest_module.fuses_at(len(lengths)):      # batch 1 < FUSE_FROM_BATCH: nothing named, every step scans
        assert counts == [0, 0]
    else:
        assert counts[0] > 0, counts                    # the step took the attention's results
    want_tokens, want_logits = _greedy(plain, ids, mask)
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
