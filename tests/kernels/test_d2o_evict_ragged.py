"""D2O's one-in-one-out step with a budget per batch row (``kvpass::d2o_evict_one_ragged``).

Three things: the Triton kernels equal the ragged reference (as in test_d2o_evict_one.py: scalar outcomes
exactly, K, V and tau to the last bits); the ragged reference with one keep for every row is the one-budget
reference, bit for bit; and every row of a ragged layer gets exactly what the per-row path gives it
(the runtime's ``compress_rows_into``: the row alone, in a copy of its own capacity keep + 1, through
``D2O.compress_into``), for D2O's options too."""

from __future__ import annotations

import pytest
import torch

from kvpass.cache import LayerCache, put_rows_at, take_rows
from kvpass.kernels.d2o_evict_one import d2o_evict_one_reference
from kvpass.kernels.d2o_evict_one_ragged import d2o_evict_one_ragged_reference, d2o_evict_one_ragged_triton
from kvpass.policies.d2o import D2O, TAU, TAU_SET
from tests.kernels.test_d2o_evict_one import (
    assert_replay_equals,
    assert_same,
    copied,
    decode_write,
    random_layer,
)

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

NEVER = 99          # a budget above the test layers' capacity: the row never evicts


def ragged_layer(keeps: list[int], h: int, d: int, seed: int, dtype: torch.dtype, near: float = 0.3,
                 extra: int = 0, capacity: int | None = None) -> dict[str, torch.Tensor]:
    """A layer of ``capacity`` C slots (default: the largest budget below NEVER + 1 + ``extra``) whose row b is
    ``random_layer``'s layer of capacity keeps[b] + 1 (heads of random lengths, every other head full at
    keeps[b] + 1, so it evicts, with its newest entry in slot keeps[b]) followed by empty slots with garbage
    K, V; a row whose budget is C or more holds up to C - 4 entries (room for decode writes), never evicting."""
    c = capacity or max(k for k in keeps if k < NEVER) + 1 + extra
    rows = []
    gen = torch.Generator().manual_seed(seed + 1000)
    for b, keep in enumerate(keeps):
        if keep >= c:
            length = torch.randint(1, c - 3, (1, h), generator=gen)
            row = random_layer(1, h, c - 1, d, seed=seed + b, dtype=dtype, length=length, near=near)
        else:
            row = random_layer(1, h, keep, d, seed=seed + b, dtype=dtype, near=near)
        pad = c - row["k"].shape[2]
        for name, empty in (("position", -1), ("log_weight", float("-inf")), ("col_sum", 0.0), ("window", 0.0)):
            row[name] = torch.cat([row[name], torch.full((1, h, pad), empty, dtype=row[name].dtype)], 2)
        for name in ("k", "v"):
            row[name] = torch.cat([row[name], torch.randn(1, h, pad, d, generator=gen).to(dtype)], 2)
        rows.append(row)
    return {name: torch.cat([r[name] for r in rows]) for name in rows[0]}


def row_split(keeps: list[int], sinks: int, ratio: tuple[int, int] = (3, 1), into_sinks: bool = True,
              device: str | torch.device = "cpu") -> tuple[torch.Tensor, ...]:
    """(keep, sinks, recent, target_from) [B] int64 of D2O's split of each row's budget."""
    keep = torch.tensor(keeps, dtype=torch.long, device=device)
    s, _, recent = D2O(sinks=sinks, n_m_ratio=ratio).split_rows(keep)
    return keep, s, recent, torch.zeros_like(keep) if into_sinks else s


def run_ragged(impl, layer: dict[str, torch.Tensor], split: tuple[torch.Tensor, ...], variant: str, **kwargs) -> None:
    impl(layer["k"], layer["v"], layer["col_sum"], layer["position"], layer["log_weight"], layer["length"],
         layer["tau"], layer["tau_set"], [layer["window"]], *split, 0.7, variant, **kwargs)


@pytest.mark.parametrize("variant", ["paper", "code"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ragged_triton_equals_reference_over_steps(variant: str, dtype: torch.dtype, triton_device: str) -> None:
    """Rows of different budgets (one never evicting) over several in-place steps and decode writes, for a
    window from none to most of the row, one or three splits, and the merge guard and bias options."""
    dev = torch.device(triton_device)
    evicted = 0
    cases = [([5, 12, 8, NEVER], 2, (3, 1), {}, 1), ([9, 4, 9], 0, (1, 0), {"bias": True}, 3),
             ([7, 11], 3, (1, 1), {"min_cos": 0.3, "bias": True}, 2)]
    for case, (keeps, sinks, ratio, options, splits) in enumerate(cases):
        want = ragged_layer(keeps, 3, 16, seed=20 * case + (dtype == torch.bfloat16), dtype=dtype, extra=case % 2)
        into_sinks = "min_cos" not in options                  # the guard's case: no merge into the sinks
        split = row_split(keeps, sinks, ratio, into_sinks)
        gen = torch.Generator().manual_seed(case)
        for step in range(3):
            got = copied(want, dev)
            before = want["length"].clone()
            run_ragged(d2o_evict_one_ragged_reference, want, split, variant, **options)
            run_ragged(d2o_evict_one_ragged_triton, got, tuple(t.to(dev) for t in split), variant, **options,
                       splits=splits, block_c=4, block_scan=8)
            if "bias" in options:                              # another exp/log: float tolerance
                torch.testing.assert_close(got["log_weight"].cpu(), want["log_weight"], rtol=0, atol=1e-6)
                got["log_weight"] = want["log_weight"].to(dev)
            assert_same(got, want, f"case {case} step {step}")
            evicted += int((before - want["length"]).sum())
            decode_write(want, step, gen)
    assert evicted > 0


def test_ragged_reference_with_one_keep_is_the_one_budget_reference() -> None:
    """Every row at one budget in a layer of capacity keep + 1: the ragged reference is the one-budget
    reference, every tensor bit for bit (garbage in empty slots included), over steps."""
    keep, sinks, recent = 10, 2, 3
    want = random_layer(3, 2, keep, 8, seed=4, dtype=torch.float32)
    got = copied(want, "cpu")
    split = tuple(torch.full((3,), x) for x in (keep, sinks, recent, 0))
    gen, gen2 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    for step in range(3):
        d2o_evict_one_reference(want["k"], want["v"], want["col_sum"], want["position"], want["log_weight"],
                                want["length"], want["tau"], want["tau_set"], [want["window"]], keep, sinks, recent,
                                0.7, "paper")
        run_ragged(d2o_evict_one_ragged_reference, got, split, "paper")
        for name, t in want.items():
            assert torch.equal(got[name].view(torch.uint8), t.view(torch.uint8)), f"step {step}: {name}"
        decode_write(want, step, gen)
        decode_write(got, step, gen2)


def _cache(layer: dict[str, torch.Tensor], with_tau: bool) -> LayerCache:
    state = {TAU: layer["tau"], TAU_SET: layer["tau_set"]} if with_tau else {}
    return LayerCache(k=layer["k"], v=layer["v"], log_weight=layer["log_weight"], length=layer["length"],
                      position=layer["position"], slot_meta={"col_sum": layer["col_sum"], "window": layer["window"]},
                      state=state)


def per_row_path(policy: D2O, cache: LayerCache, keeps: list[int]) -> None:
    """The runtime's per-row path (``kvpass.runtime.layers.compress_rows_into``): rows of one budget together, each
    group in a copy of its own capacity keep + 1 through ``compress_into``, written back."""
    groups: dict[int, list[int]] = {}
    for b, keep in enumerate(keeps):
        if keep < NEVER:
            groups.setdefault(keep, []).append(b)
    for keep, rows in groups.items():
        part = take_rows(cache, rows, keep + 1)
        policy.compress_into(part, keep)
        put_rows_at(cache, part, rows)


@pytest.mark.parametrize("options", [{}, {"d2o_variant": "code"}, {"merge_into_sinks": False, "merge_floor": 0.2},
                                     {"merge_bias": True, "sinks": 1, "n_m_ratio": (1, 1)}, {"merge": False}],
                         ids=["paper", "code", "guard", "bias", "no-merge"])
@pytest.mark.parametrize("with_tau", [True, False], ids=["tau", "first"])
def test_compress_rows_into_equals_the_per_row_path(options: dict, with_tau: bool) -> None:
    """``D2O.compress_rows_into`` (the ragged reference, one call) against the per-row path, over steps: the
    same kept entries in the same slots, merged K, V, scores, positions, log-weights, lengths and thresholds;
    slots past a row's own capacity are never touched. ``with_tau`` False: the threshold state is created."""
    policy = D2O(**options)
    keeps = [6, 13, 9, 13, NEVER]
    want = ragged_layer(keeps, 2, 8, seed=7, dtype=torch.float32, near=0.5)
    got = copied(want, "cpu")
    start = copied(want, "cpu")
    keep = torch.tensor(keeps)
    gen, gen2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    evicted = 0
    for step in range(4):
        want_cache, got_cache = _cache(want, with_tau), _cache(got, with_tau)
        before = want["length"].clone()
        per_row_path(policy, want_cache, keeps)
        policy.compress_rows_into(got_cache, keep)
        evicted += int((before - want["length"]).sum())
        assert torch.equal(got["length"], want["length"]), f"step {step}"
        for name in ("k", "v", "col_sum", "window", "position", "log_weight"):
            for b, kb in enumerate(keeps):
                cap = min(kb + 1, want[name].shape[2])             # the row's own capacity: what it holds alone
                assert torch.equal(got[name][b, :, :cap], want[name][b, :, :cap]), f"step {step} {name} row {b}"
                assert torch.equal(got[name][b, :, cap:], start[name][b, :, cap:]), f"step {step} {name} row {b}"
        for name in (TAU, TAU_SET):                                # created by both where absent: [B], zeros first
            assert torch.equal(got_cache.state[name], want_cache.state[name]), f"step {step} {name}"
        if not with_tau:
            want["tau"], want["tau_set"] = want_cache.state[TAU], want_cache.state[TAU_SET]
            got["tau"], got["tau_set"] = got_cache.state[TAU], got_cache.state[TAU_SET]
            with_tau = True
        decode_write(want, step, gen)
        decode_write(got, step, gen2)
    assert evicted >= 4 * 2, evicted          # every step: at least one head of each evicting row (full ones)


def test_ragged_inputs_are_checked(triton_device: str) -> None:
    """Per-row tensors of another dtype or shape: a ValueError naming the argument (on the device the
    kernels run on: CUDA, else the CPU under the interpreter)."""
    pytest.importorskip("triton")
    dev = torch.device(triton_device)
    layer = {n: t.to(dev) for n, t in ragged_layer([4, 6], 2, 8, seed=1, dtype=torch.float32).items()}
    split = [t.to(dev) for t in row_split([4, 6], 1)]
    for i, name in enumerate(("keep", "sinks", "recent", "target_from")):
        bad = list(split)
        bad[i] = bad[i].int()
        with pytest.raises(ValueError, match=name):
            run_ragged(d2o_evict_one_ragged_triton, layer, tuple(bad), "paper")
        bad[i] = split[i][:1]
        with pytest.raises(ValueError, match=name):
            run_ragged(d2o_evict_one_ragged_triton, layer, tuple(bad), "paper")


# ------------------------------------------------------------------------------------------- CUDA
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("variant", ["paper", "code"])
def test_cuda_ragged_op_equals_reference_at_real_shapes(variant: str) -> None:
    """The registered op on CUDA (Triton) against the reference on CUDA: Hkv = 8, D = 128, bf16, four rows
    of budgets around 6.5k (one never evicting), three steps; then replayed from a CUDA graph."""
    keeps = [6554, 5000, 6100, 7000]
    layer = ragged_layer(keeps, 8, 128, seed=11, dtype=torch.bfloat16, near=0.0, capacity=6555)
    want = {n: t.cuda() for n, t in layer.items()}
    split = row_split(keeps, 4, device="cuda")
    gen = torch.Generator().manual_seed(0)
    for step in range(3):
        got = copied(want, "cuda")
        run_ragged(torch.ops.kvpass.d2o_evict_one_ragged, got, split, variant)
        run_ragged(d2o_evict_one_ragged_reference, want, split, variant)
        assert_same({n: t.cpu() for n, t in got.items()}, {n: t.cpu() for n, t in want.items()}, f"step {step}")
        cpu = {n: t.cpu() for n, t in want.items()}
        decode_write(cpu, step, gen)
        want = {n: t.cuda() for n, t in cpu.items()}
    start = copied(want, "cuda")
    run_ragged(torch.ops.kvpass.d2o_evict_one_ragged, want, split, variant)
    assert_replay_equals(lambda x: run_ragged(torch.ops.kvpass.d2o_evict_one_ragged, x, split, variant), start, want)
