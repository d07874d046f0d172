"""D2O's one-in-one-out step with a budget per batch row (``kvpass::d2o_evict_one_ragged``).

Three things: the Triton kernels equal the ragged reference (as in test_d2o_evict_one.py: scalar outcomes
exactly, K, V and tau to the last bits); the ragged reference with one keep for every row is the one-budget
reference, bit for bit; and every row of a ragged layer gets exactly what the per-row path gives it
(the runtime's ``compress_rows_into``: the row alone, in a copy of its own capacity keep + 1, through
``D2O.compress_into``), for D2O's options too. D2O's merge_protect and merge_weighting="score" (the plain-torch
step alone, no kernel): every row of one batched call as the pure path ``_compress_one`` gives it alone."""

from __future__ import annotations

import pytest
import torch

from kvpass.cache import LayerCache, put_rows_at, take_rows
from kvpass.kernels.d2o_evict_one import d2o_evict_one_reference, protected_count, unprotected
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
                 extra: int = 0, capacity: int | None = None, idle: tuple[int, ...] = ()) -> dict[str, torch.Tensor]:
    """A layer of ``capacity`` C slots (default: the largest budget below NEVER + 1 + ``extra``) whose row b is
    ``random_layer``'s layer of capacity keeps[b] + 1 (heads of random lengths, every other head full at
    keeps[b] + 1, so it evicts, with its newest entry in slot keeps[b]) followed by empty slots with garbage
    K, V; a row whose budget is C or more holds up to C - 4 entries (room for decode writes), never evicting;
    a row b in ``idle`` holds at most keeps[b] entries in every head (not due this step)."""
    c = capacity or max(k for k in keeps if k < NEVER) + 1 + extra
    rows = []
    gen = torch.Generator().manual_seed(seed + 1000)
    for b, keep in enumerate(keeps):
        if keep >= c:
            length = torch.randint(1, c - 3, (1, h), generator=gen)
            row = random_layer(1, h, c - 1, d, seed=seed + b, dtype=dtype, length=length, near=near)
        elif b in idle:
            length = torch.randint(1, keep + 1, (1, h), generator=gen)
            row = random_layer(1, h, keep, d, seed=seed + b, dtype=dtype, length=length, near=near)
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
    """One step of ``impl``: a function of the module, or the op (whose ``nearest`` follows ``others``: none)."""
    nearest = ([],) if impl is torch.ops.kvpass.d2o_evict_one_ragged else ()
    impl(layer["k"], layer["v"], layer["col_sum"], layer["position"], layer["log_weight"], layer["length"],
         layer["tau"], layer["tau_set"], [layer["window"]], *nearest, *split, 0.7, variant, **kwargs)


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
                                want["length"], want["tau"], want["tau_set"], [want["window"]], [], keep, sinks, recent,
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
                                     {"merge_bias": True, "sinks": 1, "n_m_ratio": (1, 1)}, {"merge": False},
                                     {"merge_protect": 0.5},
                                     {"merge_weighting": "score", "merge_protect": 0.25, "merge_bias": True,
                                      "d2o_variant": "code"}],
                         ids=["paper", "code", "guard", "bias", "no-merge", "protect", "score-protect"])
@pytest.mark.parametrize("with_tau", [True, False], ids=["tau", "first"])
def test_compress_rows_into_equals_the_per_row_path(options: dict, with_tau: bool) -> None:
    """``D2O.compress_rows_into`` (the ragged reference, one call) against the per-row path, over steps: the
    same kept entries in the same slots, merged K, V, scores, positions, log-weights, lengths and thresholds;
    slots past a row's own capacity are never touched. ``with_tau`` False: the threshold state is created."""
    policy = D2O(interval=1, **options)
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


def _row_cache(layer: dict[str, torch.Tensor], b: int, capacity: int) -> LayerCache:
    """Batch row b of ``layer`` alone, a copy of its first ``capacity`` slots (what the row holds on its own)."""
    row = {name: t[b:b + 1].clone() if t.dim() < 3 else t[b:b + 1, :, :capacity].clone()     # tau, length: all
           for name, t in layer.items()}
    return _cache(row, with_tau=True)


def _assert_same_entries(got: dict[str, torch.Tensor], b: int, want: LayerCache, msg: str, tol: float = 1e-12) -> None:
    """Row b of the in-place layer ``got`` holds the entries of ``want`` (a batch of one, any slot order): per
    head the same positions, scores and log-weights exactly, K, V within ``tol`` (float64 inputs; the merge is
    computed in fp32 by both, so on one CPU they agree to the bit: ``tol`` leaves room for a last-bit
    difference of another matmul's cosine on CUDA)."""
    assert got["length"][b].tolist() == want.length[0].tolist(), msg
    for g, n in enumerate(want.length[0].tolist()):
        mine = got["position"][b, g, :n].argsort()
        theirs = want.position[0, g, :n].argsort()
        assert torch.equal(got["position"][b, g, :n][mine], want.position[0, g, :n][theirs]), f"{msg} head {g}"
        for name, ref in (("col_sum", want.slot_meta["col_sum"]), ("window", want.slot_meta["window"]),
                          ("log_weight", want.log_weight)):
            assert torch.equal(got[name][b, g, :n][mine], ref[0, g, :n][theirs]), f"{msg} head {g} {name}"
        for name, ref in (("k", want.k), ("v", want.v)):
            torch.testing.assert_close(got[name][b, g, :n][mine], ref[0, g, :n][theirs], rtol=tol, atol=tol,
                                       msg=f"{msg} head {g} {name}")


def _changed_keys(before: dict[str, torch.Tensor], b: int, after: LayerCache) -> int:
    """How many live entries of ``after`` (row b alone) have another key than the same position in ``before``."""
    changed = 0
    for g, n in enumerate(after.length[0].tolist()):
        for s in range(n):
            src = int((before["position"][b, g] == after.position[0, g, s]).nonzero()[0, 0])
            changed += int(not torch.equal(after.k[0, g, s], before["k"][b, g, src]))
    return changed


@pytest.mark.parametrize("variant", ["paper", "code"])
@pytest.mark.parametrize("bias", [False, True], ids=["plain", "bias"])
@pytest.mark.parametrize("weighting", ["similarity", "score"])
@pytest.mark.parametrize("protect", [0.25, 0.5])
def test_guarded_rows_in_one_call_equal_each_row_alone(protect: float, weighting: str, bias: bool,
                                                      variant: str) -> None:
    """merge_protect and merge_weighting="score" (no Triton op: the plain-torch step): ``compress_rows_into``
    over a float64 layer of rows of different budgets and lengths (one never evicting, one not due at the first
    step) gives every row, at every step, what the pure one-in-one-out path ``_compress_one`` gives the row
    alone at its own budget: the same entries with their positions, merged K, V, scores, log-weights and
    threshold; the other rows are untouched."""
    policy = D2O(interval=1, merge_protect=protect, merge_weighting=weighting, merge_bias=bias, d2o_variant=variant,
                 sinks=2, merge_into_sinks=protect != 0.25)
    keeps = [6, 13, 9, NEVER, 11]
    layer = ragged_layer(keeps, 3, 8, seed=int(protect * 8) + 2 * bias + (weighting == "score"),
                         dtype=torch.float64, near=0.5, idle=(4,))
    sizes = 1.5 * torch.rand(layer["log_weight"].shape, generator=torch.Generator().manual_seed(1))
    layer["log_weight"] = torch.where(layer["log_weight"] > float("-inf"), sizes, layer["log_weight"])  # earlier merges
    keep = torch.tensor(keeps)
    gen = torch.Generator().manual_seed(5)
    merged = unguarded = 0
    for step in range(4):                                       # the never-due row has room for 4 writes
        start = copied(layer, "cpu")
        alone = {b: policy._compress_one(_row_cache(start, b, kb + 1), kb) for b, kb in enumerate(keeps) if kb < NEVER}
        cache = _cache(layer, with_tau=True)
        policy.compress_rows_into(cache, keep)
        for b, want in alone.items():
            _assert_same_entries(layer, b, want, f"step {step} row {b}")
            assert torch.equal(layer["tau"][b:b + 1], want.state[TAU]), f"step {step} row {b} tau"
            assert torch.equal(layer["tau_set"][b:b + 1], want.state[TAU_SET]), f"step {step} row {b} tau_set"
            merged += _changed_keys(start, b, want)
        for name, t in layer.items():                           # the never-due row: every tensor as it was
            assert torch.equal(t[3], start[name][3]), f"step {step} {name}"
        plain = D2O(interval=1, d2o_variant=variant, sinks=2, merge_into_sinks=policy.merge_into_sinks, merge_bias=bias)
        unguarded += sum(not torch.equal(plain._compress_one(_row_cache(start, b, keeps[b] + 1), keeps[b]).k, want.k)
                         for b, want in alone.items())
        decode_write(layer, step, gen)
    assert merged > 0, "no merge happened: the test compares evictions alone"
    assert unguarded > 0, "the options never changed a merge: the test does not exercise them"


@pytest.mark.parametrize("protect", [0.1, 0.25, 0.29, 0.3, 0.5, 0.7, 0.9])
def test_protected_count_on_the_device_is_the_host_floor(protect: float) -> None:
    """floor(protect * keep) as the [B] tensor the batched step computes (fp64, on the device) and as the int
    the one-budget path computes (Python's float product, int()): equal for every budget up to 10^5, products
    that land a rounding error off an integer (0.29 * 100, 0.1 * 30, 0.7 * 10) included."""
    keep = torch.arange(1, 100_001)
    want = torch.tensor([int(protect * k) for k in range(1, 100_001)])
    assert torch.equal(protected_count(protect, keep), want)
    assert protected_count(protect, 10) == int(protect * 10)


def test_unprotected_is_the_top_scores_of_each_row_by_a_loop() -> None:
    """``unprotected`` with a count per batch row: the live slots outside the n[b] highest scores of each
    (row, head), ties to the lower slot, against a sort of (-score, slot) in Python; on coarse scores (ties)."""
    gen = torch.Generator().manual_seed(0)
    b, h, c = 3, 4, 17
    score = (torch.randint(0, 5, (b, h, c), generator=gen) / 4.0).float()
    live = torch.arange(c) < torch.randint(1, c + 1, (b, h, 1), generator=gen)
    live &= torch.rand(b, h, c, generator=gen) < 0.9                 # holes, as the evicted slot is
    n = torch.tensor([0, 3, 7])
    got = unprotected(score, live, n)
    for bb in range(b):
        for g in range(h):
            slots = [j for j in range(c) if live[bb, g, j]]
            top = set(sorted(slots, key=lambda j: (-float(score[bb, g, j]), j))[: int(n[bb])])
            assert [j for j in range(c) if got[bb, g, j]] == [j for j in slots if j not in top], (bb, g)


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("options", [dict(merge_protect=0.5),
                                     dict(merge_weighting="score", merge_protect=0.25, merge_bias=True, d2o_variant="code")],
                         ids=["protect", "score-protect"])
def test_cuda_guarded_rows_in_one_call_equal_each_row_alone_and_replay(options: dict) -> None:
    """merge_protect / merge_weighting="score" on CUDA (the plain-torch step, batched): every row as
    ``_compress_one`` gives it alone on CUDA, at budgets of a few hundred (one row never evicting), float64;
    then the step captured in a CUDA graph and replayed equals the eager call (no host sync, no .item())."""
    policy = D2O(interval=1, **options)
    keeps = [600, 450, 520, 700]
    layer = {n: t.cuda() for n, t in ragged_layer(keeps, 8, 64, seed=13, dtype=torch.float64, near=0.3,
                                                   capacity=601).items()}
    keep = torch.tensor(keeps, device="cuda")
    start = copied(layer, "cuda")
    alone = {b: policy._compress_one(_row_cache(start, b, kb + 1), kb) for b, kb in enumerate(keeps) if kb < 601}
    policy.compress_rows_into(_cache(layer, with_tau=True), keep)
    for b, want in alone.items():
        _assert_same_entries(layer, b, want, f"row {b}", tol=1e-6)
        torch.testing.assert_close(layer["tau"][b:b + 1], want.state[TAU], rtol=0, atol=1e-6)
    for name, t in layer.items():
        assert torch.equal(t[3], start[name][3]), name
    assert_replay_equals(lambda x: policy.compress_rows_into(_cache(x, with_tau=True), keep), start, layer)


@pytest.mark.parametrize("options", [{}, {"d2o_variant": "code", "merge_bias": True}], ids=["paper", "code-bias"])
def test_compress_rows_into_calls_the_ragged_op_with_its_signature(options: dict, monkeypatch) -> None:
    """The branch CUDA takes (``torch.ops.kvpass.d2o_evict_one_ragged``, whose CPU kernel is the ragged reference),
    forced on the CPU: the op accepts the call and gives what the plain-torch step gives. The Triton branch never
    runs on a CPU otherwise, so a call the op's schema refuses would first fail on a GPU."""
    policy = D2O(interval=1, **options)
    keep = torch.tensor([6, 13, 9, 13, NEVER])
    want = ragged_layer(keep.tolist(), 2, 8, seed=11, dtype=torch.float32, near=0.5)
    got = copied(want, "cpu")
    policy.compress_rows_into(_cache(want, True), keep)
    monkeypatch.setattr(D2O, "_triton_step", lambda self, cache: True)
    policy.compress_rows_into(_cache(got, True), keep)
    for name, t in want.items():
        assert torch.equal(got[name], t), name
