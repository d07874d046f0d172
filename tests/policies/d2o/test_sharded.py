"""D2O's decode steps under tensor parallelism: two gloo processes on the CPU, each holding half the KV heads of
random layers, end with what the reference makes of the whole layer in one process, cut to the rank's heads (the
threshold's statistics gathered from every rank): the Triton one-in-one-out step (one budget and a budget per row;
the kernels under ``TRITON_INTERPRET=1``), the plain-torch step (interval 4) and the policy's
``compress_layers_into`` (the runtime's call for a step's due layers: one all-gather for all of them)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.filterwarnings("ignore::RuntimeWarning"),
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU processes: the kernels need the interpreter (tests/conftest.py sets it "
                                        "where no GPU is; on a GPU these CPU tensors cannot run them)")]

KEEP, HEADS, WORLD = 12, 4, 2
CASES = [(variant, per_row, seed) for variant in ("paper", "code") for per_row in (False, True) for seed in (0, 1)]


def _layer(seed: int, b: int = 3):
    from tests.policies.d2o.cases import ordered_cache, shuffled

    c = KEEP + 1
    lengths = [[c, c, 9, c], [c, 5, c, c], [11, c, c, 3]][:b]
    return shuffled(ordered_cache(lengths, c, 16, seed, torch.float32), seed)


def _mine(cache, rank: int):
    from kvpass.cache import select_heads

    n = HEADS // WORLD
    out = select_heads(cache, list(range(rank * n, (rank + 1) * n)))
    return type(out)(**{f: getattr(out, f).clone().contiguous() for f in ("k", "v", "log_weight", "length", "position")},
                     slot_meta={k: t.clone().contiguous() for k, t in out.slot_meta.items()},
                     state={k: t.clone() for k, t in out.state.items()})


def _check(got, want, rank: int, msg: str) -> str:
    from tests.policies.d2o.cases import assert_rows_equal

    try:
        assert_rows_equal(got, _mine(want, rank), list(range(got.k.shape[0])), msg)
    except AssertionError as err:
        return str(err)
    return ""


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    from kvpass.head_group import ShardedHeadGroup
    from kvpass.policies.d2o import D2O
    from kvpass.policies.d2o.evict_one import evict_one_steps, run_layers
    from tests.policies.d2o.cases import reference

    os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    heads = ShardedHeadGroup(dist.group.WORLD.group_name, rank, world)
    out: dict = {}
    try:
        for variant, per_row, seed in CASES:             # the Triton step of one layer
            policy = D2O(d2o_variant=variant).with_heads(heads)
            whole = _layer(seed)
            got = _mine(whole, rank)
            keep = torch.full((3,), KEEP) if per_row else KEEP
            t, split = policy._inputs(got, keep, keep + 1)
            run_layers([evict_one_steps(t, [], split, policy.step_options(), heads, splits=2, block_c=4,
                                        block_scan=8)], heads)
            out[(variant, per_row, seed)] = _check(got, reference(D2O(d2o_variant=variant), whole, KEEP), rank,
                                                   f"{variant} {per_row} {seed}")
        D2O._on_kernels = lambda self, cache: self._kernel_options()          # the Triton branch, on the CPU
        for variant in ("paper", "code"):                # the policy's call for a step's layers: one gather
            policy = D2O(d2o_variant=variant).with_heads(heads)
            wholes = [_layer(seed, b) for seed, b in ((20, 3), (21, 3), (22, 2))]
            gots = [_mine(w, rank) for w in wholes]
            before = heads.collectives
            policy.compress_layers_into([(g, KEEP) for g in gots])
            out[("layers", variant)] = (heads.collectives - before,
                                        [_check(g, reference(D2O(d2o_variant=variant), w, KEEP), rank, "layers")
                                         for g, w in zip(gots, wholes, strict=True)])
        many = D2O(interval=4).with_heads(heads)         # the plain-torch step (no kernel under tp), interval 4
        whole = _layer(30)
        got = _mine(whole, rank)
        many.compress_rows_into(got, torch.full((3,), KEEP - 3))
        want = reference(D2O(interval=4), whole, KEEP - 3)
        due = [b for b in range(3) if int(whole.length[b].max()) >= KEEP + 1]
        from kvpass.cache import take_rows
        out["many"] = _check(take_rows(got, due), take_rows(want, due), rank, "many")
    finally:
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def sharded_results() -> list[dict]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(WORLD, str(Path(tmp) / "init"), tmp), nprocs=WORLD, join=True)
        return [torch.load(Path(tmp) / f"rank{r}.pt") for r in range(WORLD)]


@pytest.mark.parametrize("variant,per_row,seed", CASES)
def test_sharded_triton_step_equals_the_reference(sharded_results, variant: str, per_row: bool, seed: int) -> None:
    for rank, results in enumerate(sharded_results):
        assert results[(variant, per_row, seed)] == "", f"rank {rank}"


@pytest.mark.parametrize("variant", ["paper", "code"])
def test_a_steps_layers_share_one_gather(sharded_results, variant: str) -> None:
    for rank, results in enumerate(sharded_results):
        gathers, errors = results[("layers", variant)]
        assert errors == ["", "", ""], f"rank {rank}"
        assert gathers == 2, f"rank {rank}: one all-gather per [B, Hkv] shape (3 rows, 2 rows), got {gathers}"


def test_sharded_plain_step_equals_the_reference(sharded_results) -> None:
    for rank, results in enumerate(sharded_results):
        assert results["many"] == "", f"rank {rank}"
