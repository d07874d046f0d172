"""Tensor parallelism (``kvpass.apply(..., tp=N)``, kvpass/rewrites/shard_tensor_parallel.py) on CPU with gloo:
N spawned processes decode the same tokens as one process and every rank's KV heads keep the same entries
as those heads do in one process, for every registered policy (and, for some, with a chunked prefill); unsupported models are refused; with tp
unset or 1 the graphs are exactly the single-process ones."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import pytest

import kvpass
from kvpass.errors import UnsupportedModel
from kvpass.policies import POLICIES
from kvpass.rewrites import Shard, capture_model, shard_tensor_parallel, sharded_for
from tests.conftest import tiny_model
from tests.policies.policy_helpers import captured_model
from tests.rewrites.tensor_parallel_cases import case_for, run_spawned, tiny

CASES = {2: [case_for(p) for p in sorted(POLICIES)]
            + [case_for("full", "qwen2"), case_for("full", "gemma3"), case_for("full", sample=True),
               case_for("d2o", via_apply=True)]
            + [case_for(p, prefill_chunk=12) for p in ("d2o", "snapkv", "adakv", "streamingllm", "kvmerger")]
            + [case_for(p, batch=2) for p in ("d2o", "pyramidkv", "streamingllm")]
            + [case_for("d2o", heads=(4, 4), batch=2, budget=17)]      # rows of one budget, 2 KV heads a rank
            # interval > 1: the in-place evict-many step with the threshold gathered (rows of their own budgets too)
            + [case_for("d2o", interval=4), case_for("d2o", batch=2, interval=4),
               case_for("d2o", interval=4, d2o_variant="code")],
         4: [case_for(p, heads=(4, 4)) for p in sorted(POLICIES)]
            + [case_for("full", "qwen2", heads=(4, 4)), case_for("full", "gemma3", heads=(4, 4))]}


@functools.cache
def _results(world: int) -> tuple[dict, ...]:
    with tempfile.TemporaryDirectory() as tmp:
        return tuple(run_spawned(CASES[world], world, Path(tmp)))


@pytest.mark.parametrize("world,key", [(w, c.key) for w, cases in CASES.items() for c in cases])
def test_tp_matches_one_process(world: int, key: str) -> None:
    for rank, results in enumerate(_results(world)):
        got = results[key]
        if "reference_error" in got:
            pytest.skip(f"the single-process run fails, nothing to compare with: {got['reference_error']}")
        assert "error" not in got, f"rank {rank}: {got.get('error')}"
        ref, tp = got["reference"], got["tp"]
        assert tp["tokens"] == ref["tokens"], f"rank {rank} decoded other tokens"
        assert tp["kept"] == ref["kept"], f"rank {rank}'s heads kept other positions"
        case = next(c for c in CASES[world] if c.key == key)
        if "lm_head_input" in tp:             # the prefill's LM head still runs on the last position only
            assert tp["lm_head_input"] in (None, "aten.slice.Tensor"), tp["lm_head_input"]
        assert all(n == case.heads[1] // world for n in tp["kv_heads"]), f"rank {rank} holds {tp['kv_heads']} KV heads"
        if "held_bytes" in tp:                # a shard is a copy: the whole weight's storage is released
            assert {n: b for n, b in tp["held_bytes"].items() if b[0] != b[1]} == {}
        if case.policy not in ("full", "quest", "clusterkv"):     # the recall policies keep every entry
            seen = case.prompt + case.new - 1
            assert any(len(head) < seen for layer in ref["kept"].values() for head in layer[0]), "nothing was evicted"


def _nodes(gm) -> list[tuple]:
    return [(n.op, str(n.target), str(n.args)) for n in gm.graph.nodes]


def test_tp_1_leaves_the_graphs_exactly_as_they_are() -> None:
    model = tiny_model("llama")
    plain, one = kvpass.apply(model, policy="d2o"), kvpass.apply(model, policy="d2o", tp=1)
    for a, b in ((plain.graphs.prefill, one.graphs.prefill), (plain.graphs.decode, one.graphs.decode)):
        assert _nodes(a) == _nodes(b)
    assert one.heads.world == 1 and one.policy.heads.world == 1
    _, captured, sites = captured_model("llama")
    before = _nodes(captured.gm)
    assert shard_tensor_parallel(captured.gm, list(sites), Shard(0, 1, "unused")) == list(sites)
    assert _nodes(captured.gm) == before


def test_tp_without_processes_is_refused() -> None:
    with pytest.raises(ValueError, match="torchrun --nproc-per-node 2"):
        kvpass.apply(tiny_model("llama"), policy="full", tp=2)
    with pytest.raises(ValueError, match="tp must be an int"):
        kvpass.apply(tiny_model("llama"), policy="full", tp=0)


def test_a_model_sharded_in_place_is_refused_without_its_sharded_capture() -> None:
    """shard_tensor_parallel re-points the model's own parameters at rank 0's halves: a later apply of that model
    in one process (half its weights) or with tp again (a second halving) would decode garbage. Both refused."""
    model = tiny("llama", (4, 2))
    kvpass.apply(model, policy="streamingllm")                                  # fine before sharding
    captured = capture_model(model)
    shard_tensor_parallel(captured.gm, list(captured.sites), Shard(0, 2, "unused"))
    assert sharded_for(model) == (0, 2)
    with pytest.raises(UnsupportedModel, match=r"already rank 0's shards for tp=2 .* in one process \(it holds 1/2"):
        kvpass.apply(model, policy="streamingllm")
    with pytest.raises(UnsupportedModel, match="captured=<that KVPassModel>.captured"):
        kvpass.apply(model, policy="d2o", captured=captured)     # its graph sharded, but not by shard_captured
    assert sharded_for(tiny("llama", (4, 2))) is None


@pytest.mark.parametrize("arch,world,match", [
    ("llama", 3, "does not divide layer 0's 4 query heads"),
    ("llama", 4, "does not divide layer 0's 2 KV heads"),
    ("phi3", 2, "fused linear"),
    ("gpt2", 2, "not one q projection"),
])
def test_unsupported_models_are_refused(arch: str, world: int, match: str) -> None:
    model = tiny(arch, (4, 2)) if arch != "gpt2" else tiny_model("gpt2")
    from kvpass.rewrites import capture_causal_lm, match_attention
    captured = capture_causal_lm(model)
    sites = match_attention(captured, model.config)
    before = [p.shape for p in model.parameters()]
    with pytest.raises(UnsupportedModel, match=match):
        shard_tensor_parallel(captured.gm, sites, Shard(0, world, "unused"))
    assert [p.shape for p in model.parameters()] == before          # refused before touching anything
