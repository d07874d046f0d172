"""The Triton form of D2O's in-place evict-many step (``kvpass.kernels.d2o_evict_many.evict_many_triton``, the op
``kvpass::d2o_evict_many``) against the plain-torch step that defines it (``evict_many_in_place``), on fresh random
layers: slot for slot the same positions, scores, log-weights, lengths, other metadata and threshold, and the same
merged K, V up to fp32 rounding (the merge sums in another order). Triton on CUDA when there is one, else through
the interpreter (tests/conftest.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from kvpass.kernels.d2o_evict_many import evict_many_in_place, evict_many_triton, split_tensor
from kvpass.kernels.d2o_evict_one import NO_FLOOR
from kvpass.policies.d2o import TAU, TAU_SET
from tests.kernels.test_d2o_evict_many import ordered_cache, shuffled

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def layer_args(cache, device: str) -> list:
    """(k, v, score, position, log_weight, length, tau, tau_set, others) of a LayerCache, on ``device``."""
    to = lambda t: t.to(device).contiguous().clone()  # noqa: E731  (a copy: the steps write in place)
    return [to(cache.k), to(cache.v), to(cache.slot_meta["col_sum"]), to(cache.position), to(cache.log_weight),
            to(cache.length), to(cache.state[TAU]), to(cache.state[TAU_SET]), [to(cache.slot_meta["window_scores"])]]


def assert_same_layer(got: list, want: list, dtype: torch.dtype, msg: str) -> None:
    names = ("k", "v", "score", "position", "log_weight", "length", "tau", "tau_set")
    for name, g, w in zip(names, got[:8], want[:8], strict=True):
        g, w = g.cpu(), w.cpu()
        if name in ("k", "v"):
            tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
            torch.testing.assert_close(g.float(), w.float(), **tol, msg=f"{msg}: {name}")
        elif name in ("tau", "log_weight"):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6, msg=f"{msg}: {name}")
        else:
            assert torch.equal(g, w), f"{msg}: {name} differs at {(g != w).nonzero()[:5].tolist()}"
    assert torch.equal(got[8][0].cpu(), want[8][0].cpu()), f"{msg}: other metadata"


def in_runs(cache):
    """The same layer (in sequence order) with positions in two gapless runs, 0..n/2 - 1 and 7 above that on: the
    kernel's guessed thresholds for the sinks and the recent window hold (ordered_cache's even positions 0, 2,
    4, ... make it bisect)."""
    j = torch.arange(cache.capacity)
    n = cache.length[..., None]
    cache.position = torch.where(j < n, j + 7 * (j >= n // 2), -1)
    return cache


def run_both(cache, device, keep, due, m, sinks, recent, target_from=0, variant="paper", min_cos=NO_FLOOR,
             bias=False, block=2048, **options):
    """The plain-torch step and the Triton step on copies of one layer: (torch's, Triton's) tensors. ``options``:
    ``evict_many_triton``'s block sizes."""
    want = layer_args(cache, "cpu")
    got = layer_args(cache, device)
    evict_many_in_place(*want, keep, due, m, sinks, recent, target_from, 0.7, variant, min_cos, bias)
    b = cache.k.shape[0]
    split = split_tensor(b, torch.device(device), keep, due, sinks, recent, target_from)
    evict_many_triton(*got, split, m, 0.7, variant, min_cos, bias, block=block, **options)
    return got, want


CASES = [dict(), dict(variant="code"), dict(min_cos=0.3), dict(target_from=2), dict(bias=True),
         dict(bias=True, variant="code", target_from=2, min_cos=0.1)]


# every option in fp32; the default and all options at once in bf16 (the interpreter is slow: CI time)
DTYPE_CASES = [(torch.float32, c) for c in CASES] + [(torch.bfloat16, CASES[0]), (torch.bfloat16, CASES[-1])]


@pytest.mark.parametrize("m", [5, 16])
@pytest.mark.parametrize("dtype, case", DTYPE_CASES,
                         ids=lambda o: (str(o).removeprefix("torch.") if isinstance(o, torch.dtype)
                                        else ",".join(f"{k}={v}" for k, v in o.items()) or "default"))
def test_one_budget_equals_the_torch_step(m: int, case: dict, dtype: torch.dtype, triton_device: str) -> None:
    """One budget for every row: full rows, rows between keep and keep + m, rows at or below keep (unchanged);
    positions with gaps everywhere (seed 0) or in gapless runs (seed 1)."""
    keep, d = 20, 16
    c = keep + m
    lengths = [[c, c, c], [c, 7, keep], [keep, 5, 1], [c, c, 11], [c - 1, keep + 1, keep + 2]]
    for seed in range(2):
        cache = ordered_cache(lengths, c, d, seed, dtype)
        cache = shuffled(in_runs(cache) if seed else cache, seed)
        before = copy.deepcopy(cache)
        got, want = run_both(cache, triton_device, keep, keep + 1, m, 4, 5, **case)
        assert_same_layer(got, want, dtype, f"seed {seed}")
        assert not torch.equal(want[0], before.k.contiguous()), "nothing was merged or moved"


@pytest.mark.parametrize("m", [8, 16])
def test_rows_of_their_own_budgets(m: int, triton_device: str) -> None:
    """A budget, sinks, recent window and target floor per batch row; a row is due only where some head holds
    its budget + m entries (the others, even above their budget, are left as they are)."""
    keeps = [20, 12, 17, 9, 30]
    c = 30 + m
    lengths = [[20 + m] * 3, [12 + m, 5, 12 + m - 1], [19, 17, 3], [9 + m, 9, 2], [c - 2, c, 1]]
    keep = torch.tensor(keeps)
    sinks, recent, target_from = torch.tensor([4, 2, 0, 1, 3]), torch.tensor([5, 3, 4, 0, 6]), torch.tensor([4, 2, 0, 1, 0])
    for seed in range(2):
        cache = ordered_cache(lengths, c, 8, seed, torch.float32)
        cache = shuffled(in_runs(cache) if seed else cache, seed)
        got, want = run_both(cache, triton_device, keep, keep + m, m, sinks, recent, target_from, bias=True)
        assert_same_layer(got, want, torch.float32, f"seed {seed}")
        assert torch.equal(want[5][2], cache.length[2]), "a row that is not due changed"


# the select kernel's searches over a row held in registers, and over blocks of 64 slots (rows longer than that)
SEARCHES = {"resident": dict(), "blocks": dict(resident_max=1, count_block=64)}


@pytest.mark.parametrize("search", SEARCHES)
def test_long_rows_in_several_blocks(search: str, triton_device: str) -> None:
    """Rows longer than the kernel's block (the searches and the selection loop over blocks). With scores tied
    on a coarse grid the kernel evicts, of the candidates, the lowest (score, slot) pairs: its rule for ties
    (torch's top-k breaks them its own way); with continuous scores it is the torch step, slot for slot."""
    keep, m, d, sinks, recent = 250, 24, 8, 4, 60
    c = keep + m
    lengths = [[c, c - 3], [c, keep]]
    cache = shuffled(ordered_cache(lengths, c, d, 3, torch.float32), 3)
    score = cache.slot_meta["col_sum"]
    cache.slot_meta["col_sum"] = torch.where(score > 0, (score * 32).floor() / 32 + 1 / 64, score)
    before = layer_args(cache, "cpu")
    split_ties = 0
    got, want = run_both(cache, triton_device, keep, keep + 1, m, sinks, recent, 0, block=64, **SEARCHES[search])
    assert torch.equal(got[5].cpu(), want[5])
    for b, g in ((0, 0), (0, 1), (1, 0), (1, 1)):
        n = int(before[5][b, g])
        pos, sc = before[3][b, g, :n], before[2][b, g, :n]
        rank = pos.argsort().argsort()
        cand = (rank >= sinks) & (rank < n - recent)
        n_ev = min(n - keep, m) if n > keep else 0
        order = sorted((float(sc[j]), j) for j in range(n) if cand[j])[:n_ev]
        evicted = {int(pos[j]) for _, j in order}
        if order:                                       # a tie split at the threshold: some below it, not all at it
            at = float(order[-1][0])
            split_ties += int(sum(x < at for x, _ in order) > 0 and int((sc[cand] == at).sum()) > sum(x == at for x, _ in order))
        kept = set(pos.tolist()) - evicted
        after = got[3][b, g].cpu()
        assert set(after[: n - n_ev].tolist()) == kept, f"row {(b, g)}: not the lowest (score, slot) evicted"
        assert (after[n - n_ev:] == -1).all()
    assert split_ties >= 2, "no tie split at the threshold"
    untied = shuffled(ordered_cache(lengths, c, d, 3, torch.float32), 3)
    got, want = run_both(untied, triton_device, keep, keep + 1, m, sinks, recent, 0, block=64, **SEARCHES[search])
    assert_same_layer(got, want, torch.float32, "continuous scores")


def test_split_tensor_and_bad_inputs(triton_device: str) -> None:
    dev = torch.device(triton_device)
    a = split_tensor(3, dev, 10, 11, 4, 2, 0)
    assert a.shape == (5, 3) and a[:, 0].tolist() == [10, 11, 4, 2, 0]
    assert split_tensor(3, dev, 10, 11, 4, 2, 0) is a                   # one tensor per tuple: graphs replay it
    rows = split_tensor(2, dev, torch.tensor([5, 6]), torch.tensor([7, 8]), 1, torch.tensor([2, 2]), 0)
    assert rows.tolist() == [[5, 6], [7, 8], [1, 1], [2, 2], [0, 0]]
    cache = ordered_cache([[12, 12]], 12, 8, 0, torch.float64)
    with pytest.raises(ValueError, match="16/32-bit"):
        evict_many_triton(*layer_args(cache, triton_device), split_tensor(1, dev, 8, 9, 1, 1, 0), 4, 0.7, "paper",
                          NO_FLOOR)
    cache = ordered_cache([[12, 12]], 12, 8, 0, torch.float32)
    with pytest.raises(ValueError, match="split must be"):
        evict_many_triton(*layer_args(cache, triton_device), torch.zeros(5, 2, dtype=torch.long, device=dev), 4,
                          0.7, "paper", NO_FLOOR)


@pytest.mark.parametrize("kwargs", [dict(), dict(d2o_variant="code", merge_bias=True, merge_into_sinks=False)])
def test_generation_through_the_kernels(kwargs: dict, triton_device: str, monkeypatch) -> None:
    """Through the runtime on a tiny Llama (batch of 2, per-row layer budgets): D2O with ``interval`` routed to the
    Triton op (on the CPU the kernels run through the interpreter) generates what the plain-torch step does."""
    from kvpass.policies.d2o import D2O
    from tests.policies.policy_helpers import apply_cached

    if triton_device == "cuda":
        pytest.skip("on CUDA the policy takes the op itself: test_d2o_evict_many.py's CUDA test")
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    calls = []

    def kernels(*args, **kw):
        calls.append(1)
        evict_many_triton(*args, **kw)

    model = apply_cached("llama", "d2o[interval=4]", 12, **kwargs)
    want = model.generate(ids, max_new_tokens=14, do_sample=False, eos_token_id=None)
    monkeypatch.setattr(D2O, "_triton_step", lambda self, cache: True)
    monkeypatch.setattr(torch.ops.kvpass, "d2o_evict_many", kernels)
    got = model.generate(ids, max_new_tokens=14, do_sample=False, eos_token_id=None)
    assert calls, "the Triton step did not run"
    assert torch.equal(got, want)
