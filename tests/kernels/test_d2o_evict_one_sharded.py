"""D2O's Triton step under tensor parallelism (``d2o_evict_one_triton`` / ``d2o_evict_one_ragged_triton`` with
``heads``): two gloo processes on the CPU (the kernels under ``TRITON_INTERPRET=1``), each holding half the
KV heads of one random layer, end with exactly what one process's kernels make of the whole layer, cut to the
rank's heads: the same evictions, merges, moves and K, V bit for bit, and the same threshold on every rank
(its statistics gathered from every rank's heads between kernels B and C)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch

from tests.kernels.test_d2o_evict_one import merge_outcomes, random_layer

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

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
        d2o_evict_one_triton(*args, KEEP, 3, 4, 0.7, variant, heads=heads, splits=2, block_c=4, block_scan=8)


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
    finally:
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
        dist.destroy_process_group()


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
    merging = sum(r["merges"][0] for r in sharded_results[0].values())
    refused = sum(r["merges"][1] for r in sharded_results[0].values())
    assert merging > 0 and refused > 0, (merging, refused)
