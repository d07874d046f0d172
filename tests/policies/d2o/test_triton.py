"""D2O's Triton decode steps against the reference (``cases.reference``), on the CPU through the interpreter (on
CUDA where there is one): ``kvpass::d2o_evict_one`` (one eviction a step; one budget or a budget per row; with the
nearest keys the decode attention found for the candidates it named) and ``kvpass::d2o_evict_many`` (interval
m > 1), over several steps of decode writes, for their options. Each row holds the reference's entries as a set:
positions and scores exactly, K, V and the threshold to the dtype's rounding (the kernels sum in another order;
under the interpreter fp32 -> bf16 casts truncate)."""

from __future__ import annotations

import pytest
import torch

from kvpass.cache import LayerCache, put_rows_at, take_rows
from kvpass.kernels.decode_attention_nearest import decode_attention_nearest_triton
from kvpass.policies.d2o import D2O
from kvpass.policies.d2o.evict_many import evict_many_triton
from kvpass.policies.d2o.evict_one import evict_one_triton, split_tensor
from kvpass.policies.d2o.in_place import StepTensors
from kvpass.policies.d2o.nearest import layer_nearest, nearest_state
from tests.policies.d2o.cases import (
    assert_rows_equal,
    assert_rows_unchanged,
    copied,
    decode_write,
    ordered_cache,
    reference,
    reference_rows,
    shuffled,
)

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
LAUNCH = dict(block_c=4, block_scan=8)
NEVER = 99            # a budget above the layer's capacity: the row never evicts


def inputs(policy: D2O, cache: LayerCache, keep: int | torch.Tensor, due: int | torch.Tensor
           ) -> tuple[StepTensors, torch.Tensor]:
    return policy._inputs(cache, keep if isinstance(keep, int) else keep.to(cache.k.device), due)


def evict_one(policy: D2O, cache: LayerCache, keep, nearest: list[torch.Tensor] | None = None, splits: int = 2) -> None:
    due = keep + 1
    t, split = inputs(policy, cache, keep, due if isinstance(due, int) else due.to(cache.k.device))
    evict_one_triton(t, nearest or [], split, policy.step_options(), splits=splits, **LAUNCH)


ONE = [dict(), dict(d2o_variant="code"), dict(merge_floor=0.3, merge_into_sinks=False), dict(merge_bias=True),
       dict(merge_bias=True, d2o_variant="code", sinks=1, n_m_ratio=(1, 1)), dict(merge=False),
       dict(sinks=0, n_m_ratio=(1, 0))]


def name(options: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in options.items()) or "default"


# every option in fp32, two in the other dtypes (the interpreter is slow: CI time)
ONE_CASES = [(torch.float32, o) for o in ONE] + [(d, o) for d in (torch.bfloat16, torch.float64) for o in (ONE[0], ONE[4])]


@pytest.mark.parametrize("dtype, options", ONE_CASES, ids=lambda o: name(o) if isinstance(o, dict) else str(o)[6:])
def test_evict_one_equals_the_reference_over_steps(options: dict, dtype: torch.dtype, triton_device: str) -> None:
    """One budget, capacity keep + 1: full rows evict one entry, the others nothing; five steps with writes."""
    policy, keep = D2O(**options), 12
    c = keep + 1
    got = copied(shuffled(ordered_cache([[c, c, 7], [c, 5, c]], c, 16, seed=3, dtype=dtype), 3), triton_device)
    evicted = 0
    for step in range(5):
        want = reference(policy, got, keep)
        before = int(got.length.sum())
        evict_one(policy, got, keep, splits=1 + 2 * (step % 2))
        assert_rows_equal(got, want, [0, 1], f"step {step}")
        evicted += before - int(got.length.sum())
        _write(got, step)
    assert evicted > 0


def _write(cache: LayerCache, step: int) -> None:
    """A decode write on the CPU copy of the layer (the cases' helper is CPU-side), copied back in place."""
    cpu = copied(cache)
    decode_write(cpu, step, torch.Generator().manual_seed(500 + step))
    for dst, src in zip(cache.tensors(), cpu.tensors(), strict=True):
        dst.copy_(src)


@pytest.mark.parametrize("options", [dict(), dict(d2o_variant="code", merge_bias=True, merge_into_sinks=False)],
                         ids=name)
def test_evict_one_rows_of_their_own_budgets(options: dict, triton_device: str) -> None:
    """A budget per batch row (one never evicting): each due row (keep[b] + 1 entries in a head) as the reference
    gives it alone in a layer of its own capacity, the other rows unchanged; three steps."""
    policy = D2O(**options)
    keeps = [12, 7, 10, NEVER]
    c = 13
    caps = [min(k + 1, c) for k in keeps]
    lengths = [[13, 13, 6], [8, 3, 8], [9, 10, 10], [9, 4, 6]]
    got = copied(shuffled(ordered_cache(lengths, c, 16, seed=4, dtype=torch.float32), 4), triton_device)
    keep = torch.tensor(keeps)
    for step in range(3):
        before = copied(got)
        due = [b for b, k in enumerate(keeps) if int(before.length[b].max()) > k]
        evict_one(policy, got, keep)
        for b in due:
            assert_rows_equal(take_rows(got, [b]), reference_rows(policy, before, keeps, caps, b), [0],
                              f"step {step}, row {b}")
        assert_rows_unchanged(got, before, [b for b in range(4) if b not in due], f"step {step}")
        assert due
        for b in due:                                # refill the rows that evicted to their budget + 1
            row = take_rows(got, [b])
            _write(row, step)
            put_rows_at(got, row, [b])


def test_evict_one_ties_go_to_the_lowest_slot(triton_device: str) -> None:
    """Equal lowest scores: the lower slot is evicted (in one chunk and across splits); equally similar keys
    (exact copies): the lower slot absorbs. The forms' rule for what the reference leaves open."""
    policy, keep = D2O(sinks=1, n_m_ratio=(10, 1)), 11
    c = keep + 1
    cache = ordered_cache([[c]], c, 16, seed=9, dtype=torch.float32)
    cache.slot_meta["col_sum"][0, 0, 3] = cache.slot_meta["col_sum"][0, 0, 7] = -1.0      # the two lowest
    cache.k[0, 0, 5] = cache.k[0, 0, 8] = cache.k[0, 0, 3] * 2                            # 3's two nearest
    pos = cache.position[0, 0].tolist()
    for splits in (1, 2, 3):
        got = copied(cache, triton_device)
        evict_one(policy, got, keep, splits=splits)
        after = got.position[0, 0].cpu().tolist()
        assert pos[3] not in after and pos[7] in after, splits
        assert not torch.equal(got.k[0, 0].cpu()[after.index(pos[5])], cache.k[0, 0, 5]), splits   # 5 absorbed
        assert torch.equal(got.k[0, 0].cpu()[after.index(pos[8])], cache.k[0, 0, 8]), splits       # 8 did not


def test_the_ops_plain_torch_kernels_equal_the_reference() -> None:
    """The ops' CPU kernels (what export substitutes for them) hold the reference's entries: ``d2o_evict_one`` (one
    budget and per row, its nearest state given: it names no candidates) and ``d2o_evict_many``."""
    policy, keep = D2O(), 12
    cache = shuffled(ordered_cache([[13, 13, 13], [13, 9, 13]], 13, 16, seed=6, dtype=torch.float32), 6)
    for keep_arg in (keep, torch.tensor([keep, keep])):
        got = copied(cache)
        state = nearest_state(got)
        t, split = inputs(policy, got, keep_arg, keep_arg + 1)
        torch.ops.kvpass.d2o_evict_one(*t, list(state.values()), split, 0.7, "paper")
        assert_rows_equal(got, reference(policy, cache, keep), [0, 1], f"evict one, keep {keep_arg}")
        assert (state["nearest_next"] == -1).all()
    many = D2O(interval=4)
    cache = shuffled(ordered_cache([[24, 24, 22], [21, 9, 24]], 24, 16, seed=7, dtype=torch.float32), 7)
    got = copied(cache)
    t, split = inputs(many, got, 20, 21)
    opts = many.step_options()
    torch.ops.kvpass.d2o_evict_many(*t, split, 4, opts.beta, opts.variant, opts.min_cos, opts.bias, opts.chains)
    assert_rows_equal(got, reference(many, cache, 20), [0, 1], "evict many")


def fused_steps(policy: D2O, got: LayerCache, keeps: list[int], steps: int, device: str) -> int:
    """Steps of the one-in-one-out Triton step fed by the Triton attention's nearest keys of its candidates, each
    checked against the reference; returns how many evictions took the attention's result."""
    keep = torch.tensor(keeps) if len(set(keeps)) > 1 else keeps[0]
    caps = [min(k + 1, got.capacity) for k in keeps]
    got.state.update(nearest_state(got))
    hits = 0
    for step in range(steps):
        before = copied(got)
        due = [b for b, k in enumerate(keeps) if int(before.length[b].max()) > k]
        cand = got.state["nearest_cand"].cpu()
        evict_one(policy, got, keep, layer_nearest(got))
        after = got.position.cpu()
        gone = ~(before.position[..., :, None] == after[..., None, :]).any(-1) & (before.position >= 0)
        hits += int(((cand >= 0) & gone.gather(2, cand.clamp(min=0))).any(-1).sum())
        for b in due:
            assert_rows_equal(take_rows(got, [b]), reference_rows(policy, before, keeps, caps, b), [0],
                              f"step {step}, row {b}")
        _write(got, step)
        q = torch.randn(got.k.shape[0], 6, 1, 16, generator=torch.Generator().manual_seed(step)).to(device, got.k.dtype)
        decode_attention_nearest_triton(q, got.k, got.v, got.log_weight, *layer_nearest(got), 0.25, None, False,
                                        num_splits=2, block_n=16)
    return hits


@pytest.mark.parametrize("keeps", [[12] * 4, [12, 8, 10, NEVER]], ids=["one-budget", "per-row"])
def test_evict_one_with_the_attentions_nearest_keys(keeps: list[int], triton_device: str) -> None:
    """Batch 4 (the fused search's smallest): every step holds the reference's entries, and most evictions took the
    attention's nearest key rather than scanning; the kept inverse norms are the live keys'."""
    lengths = [[13, 13, 13], [9, 9, 9], [11, 11, 11], [9, 5, 7]]
    got = copied(shuffled(ordered_cache(lengths, 13, 16, seed=8, dtype=torch.float32, near=0.0), 8), triton_device)
    hits = fused_steps(D2O(), got, keeps, 6, triton_device)
    assert hits > 0
    inv, k = got.state["nearest_inv_norm"].cpu(), got.k.cpu().double()
    known = ~torch.isnan(inv) & (torch.arange(13) < got.length.cpu()[..., None])
    torch.testing.assert_close(inv[known].double(), (1 / k.norm(dim=-1).clamp(min=1e-12))[known], rtol=2e-6, atol=0)


def test_evict_one_reads_the_attentions_result(triton_device: str) -> None:
    """A false result (cosine 1 to slot 0) for the evicted entry changes the merge: the step read it; the same false
    result for another slot changes nothing: the step scanned."""
    policy, keep = D2O(), 12
    cache = ordered_cache([[13, 13, 13]] * 4, 13, 16, seed=10, dtype=torch.float32)
    want = copied(cache, triton_device)
    evict_one(policy, want, keep)
    e = (cache.slot_meta["col_sum"][..., 2:-3]).argmin(-1) + 2             # sinks 2 (of 12 at 3:1), recent 3
    for searched, changes in ((e, True), ((e + 1), False)):
        got = copied(cache, triton_device)
        got.state.update(nearest_state(got))
        got.state["nearest_cand"][..., 0] = searched.to(triton_device)
        got.state["nearest_best"][..., 0] = 1.0
        got.state["nearest_slot"][..., 0] = 0
        evict_one(policy, got, keep, layer_nearest(got))
        assert torch.equal(got.k, want.k) != changes, changes


def evict_many(policy: D2O, cache: LayerCache, keep, due, m: int, **launch) -> None:
    t, split = inputs(policy, cache, keep, due if isinstance(due, int) else due.to(cache.k.device))
    evict_many_triton(t, split, m, policy.step_options(), **launch)


MANY = [dict(), dict(d2o_variant="code"), dict(merge_floor=0.3), dict(merge_into_sinks=False), dict(merge_bias=True),
        dict(merge_bias=True, d2o_variant="code", merge_into_sinks=False, merge_floor=0.1), dict(merge_chains=False)]


def in_runs(cache: LayerCache) -> LayerCache:
    """Positions in two gapless runs (0.. and 7 above the middle on): the kernel's guessed thresholds hold."""
    j = torch.arange(cache.capacity)
    n = cache.length[..., None]
    cache.position = torch.where(j < n, j + 7 * (j >= n // 2), -1)
    return cache


@pytest.mark.parametrize("m", [5, 16])
@pytest.mark.parametrize("options", MANY, ids=name)
def test_evict_many_equals_the_reference(m: int, options: dict, triton_device: str) -> None:
    """One budget: full rows, rows between keep and keep + m, rows at or below keep (unchanged); positions with
    gaps everywhere (seed 0: the kernel searches its thresholds) or in gapless runs (seed 1: its guesses hold)."""
    policy, keep = D2O(interval=m, **options), 20
    c = keep + m
    lengths = [[c, c, c], [c, 7, keep + 2], [keep, 5, 1], [c, c, 11]]
    for seed in (0, 1):
        cache = ordered_cache(lengths, c, 16, seed, torch.float32)
        cache = shuffled(in_runs(cache) if seed else cache, seed)
        got = copied(cache, triton_device)
        evict_many(policy, got, keep, keep + 1, m, block=8, count_block=8)
        assert_rows_equal(got, reference(policy, cache, keep), [0, 1, 2, 3], f"seed {seed}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_evict_many_in_half_precision(dtype: torch.dtype, triton_device: str) -> None:
    policy, keep, m = D2O(interval=8, merge_bias=True, d2o_variant="code"), 20, 8
    cache = shuffled(ordered_cache([[28, 28, 24], [25, 7, 28]], 28, 16, 2, dtype), 2)
    got = copied(cache, triton_device)
    evict_many(policy, got, keep, keep + 1, m)
    assert_rows_equal(got, reference(policy, cache, keep), [0, 1], str(dtype))


@pytest.mark.parametrize("resident", [True, False], ids=["resident", "blocked"])
def test_evict_many_rows_of_their_own_budgets_in_several_blocks(resident: bool, triton_device: str) -> None:
    """A budget per batch row; a row is due only where some head holds its budget + m entries (the others, even
    above their budget, are left as they are); rows longer than the kernel's blocks, the search in registers or
    in 16-ary passes over blocks."""
    m = 8
    policy = D2O(interval=m)
    keeps = [40, 22, 30, 31]
    c = 48
    caps = [k + m for k in keeps]
    lengths = [[48, 48, 20], [30, 12, 30], [37, 30, 5], [39, 39, 39]]
    cache = shuffled(ordered_cache(lengths, c, 16, 5, torch.float32), 5)
    got = copied(cache, triton_device)
    evict_many(policy, got, torch.tensor(keeps), torch.tensor(caps), m, block=16, count_block=16,
               resident_max=64 if resident else 8)
    for b in (0, 1, 3):
        assert_rows_equal(take_rows(got, [b]), reference_rows(policy, cache, keeps, caps, b), [0], f"row {b}")
    assert_rows_unchanged(got, cache, [2], "row 2")


def test_bad_inputs_are_refused(triton_device: str) -> None:
    policy = D2O()
    cache = copied(ordered_cache([[13, 13]], 13, 16, 1, torch.float32), triton_device)
    t, split = inputs(policy, cache, 12, 13)
    with pytest.raises(ValueError, match="split must be contiguous torch.int64"):
        evict_one_triton(t, [], split[:4], policy.step_options())
    with pytest.raises(ValueError, match="position must be contiguous torch.int64"):
        evict_one_triton(t._replace(position=t.position.int()), [], split, policy.step_options())
    with pytest.raises(ValueError, match="variant must be"):
        evict_many_triton(t, split, 4, policy.step_options().__class__(beta=0.7, variant="other"))
    assert split_tensor(1, torch.device(triton_device), 12, 13, 2, 3, 0) is split_tensor(
        1, torch.device(triton_device), 12, 13, 2, 3, 0)                   # one kept tensor per budget tuple
