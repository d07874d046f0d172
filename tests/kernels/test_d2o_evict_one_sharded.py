"""D2O's Triton step under tensor parallelism (``d2o_evict_one_triton`` / ``d2o_evict_one_ragged_triton`` with
``heads``): two gloo processes on the CPU (the kernels under ``TRITON_INTERPRET=1``), each holding half the
KV heads of one random layer, end with exactly what one process's kernels make of the whole layer, cut to the
rank's heads: the same evictions, merges, moves and K, V bit for bit, and the same threshold on every rank
(its statistics gathered from every rank's heads between kernels B and C). Several layers of one step
(``run_layers``, D2O's ``compress_layers_into``) share one all-gather per [B, Hkv] shape and end as each does
alone."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch

from tests.kernels.test_d2o_evict_one import merge_outcomes, random_layer

pytestmark = [pytest.mark.filterwarnings("ignore::RuntimeWarning"),
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU processes: the kernels need the interpreter (tests/conftest.py sets it "
                                        "where no GPU is; on a GPU these CPU tensors cannot run them)")]

KEEP, HEADS, WORLD = 12, 4, 2
PER_ROW = ("tau", "tau_set")                 # [B]: every rank holds them whole


def _step(layer: dict[str, torch.Tensor], variant: str, ragged: bool, heads=None) -> None:
    from kvpass.head_group import SINGLE_PROCESS
    from kvpass.kernels.d2o_evict_one import d2o_evict_one_triton
    from kvpass.kernels.d2o_evict_one_ragged import d2o_evict_one_ragged_triton

    args = (layer["k"], layer["v"], layer["col_sum"], layer["position"], layer["log_weight"], layer["length"],
            layer["tau"], layer["tau_set"], [layer["window"]])
    heads = heads or SINGLE_PROCESS
    if ragged:
        b = layer["k"].shape[0]
        keep, sinks, recent, target = (torch.full((b,), x, dtype=torch.long) for x in (KEEP, 3, 4, 0))
        d2o_evict_one_ragged_triton(*args, keep, sinks, recent, target, 0.7, variant, heads=heads, splits=2,
                                    block_c=4, block_scan=8)
    else:
        d2o_evict_one_triton(*args, [], KEEP, 3, 4, 0.7, variant, heads=heads, splits=2, block_c=4, block_scan=8)


def _steps(layer: dict[str, torch.Tensor], variant: str, heads):
    """The layer's step as one layer of ``run_layers`` (every row at KEEP; the ragged form for a layer of 2 rows)."""
    from kvpass.kernels.d2o_evict_one import d2o_evict_one_steps
    from kvpass.kernels.d2o_evict_one_ragged import d2o_evict_one_ragged_steps

    args = (layer["k"], layer["v"], layer["col_sum"], layer["position"], layer["log_weight"], layer["length"],
            layer["tau"], layer["tau_set"], [layer["window"]])
    b = layer["k"].shape[0]
    if b == 2:
        keep, sinks, recent, target = (torch.full((b,), x, dtype=torch.long) for x in (KEEP, 3, 4, 0))
        return d2o_evict_one_ragged_steps(*args, keep, sinks, recent, target, 0.7, variant, heads=heads, splits=2,
                                          block_c=4, block_scan=8)
    return d2o_evict_one_steps(*args, [], KEEP, 3, 4, 0.7, variant, heads=heads, splits=2, block_c=4, block_scan=8)


# layers of one step: (batch, seed); three of 3 rows (one gather) and one of 2 rows, ragged (a second)
LAYERS = ((3, 10), (3, 11), (2, 12), (3, 13))


def _cases() -> list[tuple[str, bool, int]]:
    return [(variant, ragged, seed) for variant in ("paper", "code") for ragged in (False, True) for seed in (0, 1)]


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    from kvpass.head_group import ShardedHeadGroup

    os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    heads = ShardedHeadGroup(dist.group.WORLD.group_name, rank, world)
    n = HEADS // world
    out = {}
    try:
        for variant, ragged, seed in _cases():
            whole = random_layer(3, HEADS, KEEP, 16, seed=seed, dtype=torch.float32)
            part = {name: t.clone() if name in PER_ROW else t[:, rank * n:(rank + 1) * n].clone()
                    for name, t in whole.items()}
            merges = merge_outcomes(whole, KEEP, 3, 4, variant)          # (merging, not merging) evictions
            _step(whole, variant, ragged)
            _step(part, variant, ragged, heads)
            want = {name: t if name in PER_ROW else t[:, rank * n:(rank + 1) * n] for name, t in whole.items()}
            out[(variant, ragged, seed)] = {"merges": merges,
                                            "same": {name: torch.equal(part[name], want[name]) for name in want}}
        from kvpass.kernels.d2o_evict_one import run_layers

        for variant in ("paper", "code"):            # several layers, one all-gather per [B, Hkv] shape
            wholes = [random_layer(b, HEADS, KEEP, 16, seed=seed, dtype=torch.float32) for b, seed in LAYERS]
            parts = [{name: t.clone() if name in PER_ROW else t[:, rank * n:(rank + 1) * n].clone()
                      for name, t in whole.items()} for whole in wholes]
            for whole in wholes:
                _step(whole, variant, ragged=whole["k"].shape[0] == 2)
            before = heads.collectives
            run_layers([_steps(part, variant, heads) for part in parts], heads)
            out[("layers", variant)] = {
                "gathers": heads.collectives - before,
                "same": [all(torch.equal(part[name], whole[name] if name in PER_ROW
                                         else whole[name][:, rank * n:(rank + 1) * n]) for name in whole)
                         for part, whole in zip(parts, wholes, strict=True)]}
        out.update(_policy_layers(rank, n, heads))
    finally:
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
        dist.destroy_process_group()


def _policy_layers(rank: int, n: int, heads) -> dict:
    """D2O's ``compress_layers_into`` under tp (the runtime's call for a step's due layers) with its Triton step
    (forced on the CPU: the kernels run under the interpreter) against ``compress_into`` of each layer alone:
    the same K, V and metadata, one all-gather in all against one a layer."""
    from kvpass.cache import LayerCache
    from kvpass.policies import get_policy
    from kvpass.policies.d2o import D2O, TAU, TAU_SET

    D2O._triton_step = lambda self, cache: True
    policy = get_policy("d2o").with_heads(heads)
    out = {}
    for together in (True, False):
        layers = [random_layer(3, HEADS, KEEP, 16, seed=seed, dtype=torch.float32) for seed in (20, 21, 22)]
        caches = [LayerCache(k=x["k"][:, rank * n:(rank + 1) * n].clone(), v=x["v"][:, rank * n:(rank + 1) * n].clone(),
                             log_weight=x["log_weight"][:, rank * n:(rank + 1) * n].clone(),
                             length=x["length"][:, rank * n:(rank + 1) * n].clone(),
                             position=x["position"][:, rank * n:(rank + 1) * n].clone(),
                             slot_meta={"col_sum": x["col_sum"][:, rank * n:(rank + 1) * n].clone(),
                                        "window": x["window"][:, rank * n:(rank + 1) * n].clone()},
                             state={TAU: x["tau"].clone(), TAU_SET: x["tau_set"].clone()}) for x in layers]
        full = [int((c.length == KEEP + 1).sum()) for c in caches]          # the rows that evict
        before = heads.collectives
        if together:
            policy.compress_layers_into([(c, KEEP) for c in caches])
        else:
            for c in caches:
                policy.compress_into(c, KEEP)
        out[("policy", together)] = {"gathers": heads.collectives - before, "caches": [c.tensors() for c in caches],
                                     "full": (full, [int((c.length == KEEP + 1).sum()) for c in caches])}
    # interval 4, rows of their own budgets (capacity = budget + 4): the evict-many step in place
    many = get_policy("d2o", interval=4).with_heads(heads)
    cache = LayerCache(**{name: x[:, rank * n:(rank + 1) * n].clone() for name, x in layers[0].items()
                          if name in ("k", "v", "log_weight", "length", "position")},
                       slot_meta={"col_sum": layers[0]["col_sum"][:, rank * n:(rank + 1) * n].clone()},
                       state={TAU: layers[0]["tau"].clone(), TAU_SET: layers[0]["tau_set"].clone()})
    due = int((cache.length == KEEP + 1).sum())
    many.compress_layers_into([(cache, torch.full((3,), KEEP - 3))])
    out["many"] = (due, int((cache.length > KEEP - 3).sum()))
    return out


@pytest.fixture(scope="module")
def sharded_results() -> list[dict]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(WORLD, str(Path(tmp) / "init"), tmp), nprocs=WORLD, join=True)
        return [torch.load(Path(tmp) / f"rank{r}.pt") for r in range(WORLD)]


@pytest.mark.parametrize("variant,ragged,seed", _cases())
def test_sharded_step_equals_one_process(sharded_results, variant: str, ragged: bool, seed: int) -> None:
    for rank, results in enumerate(sharded_results):
        same = results[(variant, ragged, seed)]["same"]
        assert all(same.values()), f"rank {rank}: differs in {[n for n, eq in same.items() if not eq]}"


def test_the_cases_both_merge_and_refuse_merges(sharded_results) -> None:
    one_layer = [r for r in sharded_results[0].values() if "merges" in r]
    merging = sum(r["merges"][0] for r in one_layer)
    refused = sum(r["merges"][1] for r in one_layer)
    assert merging > 0 and refused > 0, (merging, refused)


@pytest.mark.parametrize("variant", ["paper", "code"])
def test_layers_of_one_step_share_a_gather_and_end_as_alone(sharded_results, variant: str) -> None:
    """``run_layers`` (D2O's ``compress_layers_into`` under tp): the layers of one step gather once per [B, Hkv]
    shape, and each ends exactly as one process's step of that whole layer."""
    for rank, results in enumerate(sharded_results):
        got = results[("layers", variant)]
        assert got["gathers"] == 2, got["gathers"]                     # 3-row layers together, the 2-row one apart
        assert all(got["same"]), f"rank {rank}: layers {[i for i, ok in enumerate(got['same']) if not ok]} differ"


def test_d2o_compresses_a_steps_layers_with_one_gather(sharded_results) -> None:
    for rank, results in enumerate(sharded_results):
        together, alone = results[("policy", True)], results[("policy", False)]
        assert (together["gathers"], alone["gathers"]) == (1, 3)
        for a, b in zip(together["caches"], alone["caches"], strict=True):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), f"rank {rank}"
        due, over_budget = results["many"]
        assert due > 0 and over_budget == 0, results["many"]     # interval 4 evicted in place (no recursion)
        full_before, full_after = together["full"]
        assert all(f > 0 for f in full_before) and not any(full_after), together["full"]   # every full row evicted
