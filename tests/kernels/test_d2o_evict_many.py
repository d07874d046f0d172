"""D2O's in-place compression for ``interval`` > 1 (``kvpass.kernels.d2o_evict_many.evict_many_in_place``).

Every (b, g) row of the in-place step holds, as a set of (position -> K, V, log_weight, score, other metadata),
what ``D2O.compress`` (the general path, on the same entries in sequence order) gives it, with the same EMA
threshold; the in-place input has its live slots shuffled, so the sinks and the recent window must be found by
position. One budget for every row (``compress_into``) and one per batch row (``compress_rows_into``); rows
below their budget or not due are left as they are. End to end: generation through the runtime gives the same
tokens as the general path."""

from __future__ import annotations

import pytest
import torch

from kvpass.cache import LayerCache, take_rows, with_capacity
from kvpass.policies.d2o import D2O, TAU, TAU_SET
from tests.policies.policy_helpers import apply_cached, by_position

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.fixture
def prompt_ids() -> torch.Tensor:
    return torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))


def ordered_cache(lengths: list[list[int]], c: int, d: int, seed: int, dtype: torch.dtype = torch.float64,
                  near: float = 0.4) -> LayerCache:
    """A cache [B, Hkv, C, D] in sequence order (row (b, g) holds positions 0, 2, 4, ... of its lengths[b][g]
    entries: gaps, as after earlier compressions), continuous random scores (no ties) in 'col_sum' and
    'window_scores', a fraction ``near`` of keys near-copies of others (so merges happen), garbage K, V in the
    empty slots, and an EMA threshold already set in some batch rows."""
    gen = torch.Generator().manual_seed(seed)
    b, h = len(lengths), len(lengths[0])
    length = torch.tensor(lengths, dtype=torch.long)
    live = torch.arange(c) < length[..., None]
    k = torch.randn(b, h, c, d, generator=gen, dtype=torch.float64)
    src = torch.randint(0, c, (b, h, c), generator=gen)
    copy = torch.rand(b, h, c, generator=gen) < near
    k = torch.where(copy[..., None], torch.gather(k, 2, src[..., None].expand(-1, -1, -1, d)) + 0.05 * k, k)
    meta = {name: torch.rand(b, h, c, generator=gen, dtype=torch.float64).float() * live
            for name in ("col_sum", "window_scores")}
    tau_set = torch.rand(b, generator=gen) < 0.5
    state = {TAU: torch.where(tau_set, 0.2 + 0.6 * torch.rand(b, generator=gen), 0.0).float(), TAU_SET: tau_set}
    return LayerCache(k=k.to(dtype), v=torch.randn(b, h, c, d, generator=gen, dtype=torch.float64).to(dtype),
                      log_weight=torch.where(live, 0.0, float("-inf")).float(), length=length,
                      position=torch.where(live, 2 * torch.arange(c), -1), slot_meta=meta, state=state)


def shuffled(cache: LayerCache, seed: int) -> LayerCache:
    """The same entries with each row's live slots in a random order (as after earlier in-place steps)."""
    gen = torch.Generator().manual_seed(seed)
    b, h, c = cache.position.shape
    perm = torch.arange(c).repeat(b, h, 1)
    for (bi, g), n in zip(((x, y) for x in range(b) for y in range(h)), cache.length.view(-1).tolist(), strict=True):
        perm[bi, g, :n] = torch.randperm(n, generator=gen)
    take = lambda t: torch.take_along_dim(t, perm.reshape(*perm.shape, *([1] * (t.dim() - 3))), dim=2)  # noqa: E731
    return LayerCache(k=take(cache.k), v=take(cache.v), log_weight=take(cache.log_weight), length=cache.length.clone(),
                      position=take(cache.position), slot_meta={n: take(t) for n, t in cache.slot_meta.items()},
                      state={n: t.clone() for n, t in cache.state.items()})


def assert_rows_equal(got: LayerCache, want: LayerCache, rows: list[int], msg: str) -> None:
    """Rows ``rows`` of ``got`` hold ``want``'s rows (0, 1, ...) as sets of entries, and the same threshold."""
    g, w = by_position(got), by_position(want)
    n = want.capacity
    for i, b in enumerate(rows):
        assert torch.equal(got.length[b], want.length[i]), f"{msg}: length of row {b}"
        assert (g["position"][b, :, n:] == -1).all(), f"{msg}: row {b} holds more than {n}"
        for name in ("position", *want.slot_meta):
            assert torch.equal(g[name][b, :, :n], w[name][i]), f"{msg}: {name} of row {b}"
        # merge_bias: the general path writes log(exp(x)) for every live entry, this step only a target's
        torch.testing.assert_close(g["log_weight"][b, :, :n], w["log_weight"][i], rtol=1e-6, atol=1e-6,
                                   msg=f"{msg}: log_weight of row {b}")
        rtol = 1e-6 if want.k.dtype == torch.float32 else 1e-9
        for name in ("k", "v"):   # the general path merges in fp32 (fp64 caches too); the sums' order differs
            torch.testing.assert_close(g[name][b, :, :n].double(), w[name][i].double(), rtol=rtol, atol=1e-6,
                                       msg=f"{msg}: {name} of row {b}")
        torch.testing.assert_close(got.state[TAU][b], want.state[TAU][i], rtol=0, atol=1e-6, msg=f"{msg}: tau")
        assert bool(got.state[TAU_SET][b]) == bool(want.state[TAU_SET][i]), f"{msg}: tau_set of row {b}"
    # live slots are [0, length) and the rest is empty
    live = torch.arange(got.capacity) < got.length[..., None]
    assert torch.equal(live, got.position >= 0) and torch.equal(live, got.log_weight > float("-inf")), msg
    for t in got.slot_meta.values():
        assert (t[~live] == 0).all(), f"{msg}: metadata of a freed slot"


OPTIONS = [dict(), dict(d2o_variant="code"), dict(scores="window"), dict(merge_into_sinks=False),
           dict(merge_into_sinks=False, d2o_variant="code", merge_floor=0.2), dict(merge=False),
           dict(sinks=0, n_m_ratio=(1, 0)), dict(merge_bias=True), dict(merge_bias=True, d2o_variant="code"),
           dict(merge_protect=0.5), dict(merge_protect=0.9, merge_into_sinks=False, d2o_variant="code"),
           dict(merge_weighting="score"), dict(merge_weighting="score", merge_protect=0.3, scores="window")]
BIASED = [o for o in OPTIONS if o.get("merge_bias") or o.get("merge_protect") or o.get("merge_weighting")]


@pytest.mark.parametrize("interval", [4, 16])
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_compress_into_equals_the_general_path(interval: int, options: dict, dtype: torch.dtype) -> None:
    """One budget: every row over it (full at C = keep + interval entries, or not) evicts down to it, the others
    (at most keep) nothing; every row as ``compress`` gives it, from a shuffled copy."""
    policy = D2O(interval=interval, **options)
    keep = 20
    c = keep + interval
    lengths = [[c, c, c], [c, 7, keep], [keep, 5, 1], [c, c, 11], [c - 1, keep + 1, keep + 2]]
    for seed in range(3):
        cache = ordered_cache(lengths, c, 8, seed, dtype)
        want = policy.compress(cache, keep)
        got = shuffled(cache, seed)
        policy.compress_into(got, keep)
        assert_rows_equal(got, want, list(range(len(lengths))), f"seed {seed}")
        if seed == 0 and options.get("merge", True):
            merged = (by_position(got)["k"][:, :, :keep] != by_position(cache)["k"][:, :, :keep])
            assert merged.any(), "no merge happened"
            if options.get("merge_bias"):
                assert (got.log_weight > 0.5).any(), "no entry stands for several tokens"


@pytest.mark.parametrize("interval", [4, 16])
@pytest.mark.parametrize("options", OPTIONS[:5] + BIASED, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_rows_of_their_own_budgets_in_one_call(interval: int, options: dict) -> None:
    """Per-row budgets (``compress_rows_into``): a due row (budget + interval entries in some head) is what
    ``compress`` gives it alone at its own budget and capacity; a row not due (fewer entries, even above its
    budget) and a row whose budget exceeds the capacity are left as they are."""
    policy = D2O(interval=interval, **options)
    keeps = [20, 12, 17, 9, 60]
    c = max(k for k in keeps if k < 60) + interval
    lengths = [[20 + interval] * 3, [12 + interval, 5, 12 + interval - 1], [19, 17, 3], [9 + interval, 9, 2],
               [c - 2, c, 1]]
    due = [0, 1, 3]
    for seed in range(3):
        cache = ordered_cache(lengths, c, 8, seed)
        got = shuffled(cache, seed)
        before = by_position(got)
        policy.compress_rows_into(got, torch.tensor(keeps))
        for b in due:
            row = with_capacity(take_rows(cache, [b]), keeps[b] + interval, check=False)
            assert_rows_equal(got, policy.compress(row, keeps[b]), [b], f"seed {seed}, row {b}")
        after = by_position(got)
        for b in (2, 4):
            for name, t in before.items():
                assert torch.equal(after[name][b], t[b]), f"seed {seed}: row {b} changed its {name}"
            assert torch.equal(got.length[b], cache.length[b])
            assert torch.equal(got.state[TAU][b], cache.state[TAU][b])


def test_rows_in_one_call_accepts_interval_rows(monkeypatch) -> None:
    policy = D2O(interval=4)
    assert policy.rows_in_one_call([10, 12], [14, 16])
    assert policy.rows_in_one_call([10, 30], [14, 20])           # a short row that never compresses
    assert not policy.rows_in_one_call([10, 12], [14, 15])        # a row due below budget + interval
    assert D2O(interval=4, merge_bias=True).rows_in_one_call([10, 12], [14, 16])
    assert D2O(interval=4, merge_weighting="score", merge_protect=0.5).rows_in_one_call([10, 12], [14, 16])
    monkeypatch.setattr(D2O, "in_place_many", False)             # the general path: per-row copies
    assert not D2O(interval=4).rows_in_one_call([10, 12], [14, 16])
    assert D2O(interval=1).rows_in_one_call([10, 12], [11, 13])


@pytest.mark.parametrize("kwargs", [dict(), dict(allocation="uniform"), dict(scores="window", merge_into_sinks=False),
                                    dict(d2o_variant="code"), dict(merge_bias=True),
                                    dict(merge_protect=0.5, merge_weighting="score")])
def test_generation_equals_the_general_path(kwargs: dict, prompt_ids: torch.Tensor, monkeypatch) -> None:
    """Through the runtime on a tiny Llama (batch of 2, per-row layer budgets unless uniform): the in-place step
    generates the same tokens as the general path, and it is the one that ran."""
    import kvpass.policies.d2o as d2o_module

    calls = []
    real = d2o_module.evict_many_in_place
    monkeypatch.setattr(d2o_module, "evict_many_in_place", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    out = {}
    for in_place in (True, False):
        monkeypatch.setattr(D2O, "in_place_many", in_place)
        model = apply_cached("llama", "d2o[interval=4]", 12, **kwargs)
        out[in_place] = model.generate(prompt_ids, max_new_tokens=14, do_sample=False, eos_token_id=None)
        assert all(n <= 12 + 4 for n in model.last_report.entries.values())
        if in_place:
            assert calls, "the in-place step did not run"
            n_calls, calls[:] = len(calls), []
    assert not calls
    assert n_calls > 0
    assert torch.equal(out[True], out[False])


@pytest.mark.parametrize("budget", [12, 0.5])
def test_rows_of_other_lengths_generate_as_alone(budget: float, monkeypatch) -> None:
    """A left-padded batch whose rows fill their buffers at different steps (a row over its budget but not due
    is left as it is, and the runtime keeps counting its entries): each row generates what it generates alone,
    and the same as the general path."""
    from tests.conftest import padded_batch

    ids, mask = padded_batch([24, 15], seed=3)
    out = {}
    for in_place in (True, False):
        monkeypatch.setattr(D2O, "in_place_many", in_place)
        model = apply_cached("llama", "d2o[interval=4]", budget)
        out[in_place] = model.generate(ids, attention_mask=mask, max_new_tokens=14, do_sample=False, eos_token_id=None)
    assert torch.equal(out[True], out[False])
    monkeypatch.setattr(D2O, "in_place_many", True)
    for row, n in ((0, 24), (1, 15)):
        alone = model.generate(ids[row:row + 1, -n:], max_new_tokens=14, do_sample=False, eos_token_id=None)
        assert torch.equal(alone[0, -14:], out[True][row, -14:]), f"row {row}"


def _tensors(cache: LayerCache) -> list[torch.Tensor]:
    return [cache.k, cache.v, cache.log_weight, cache.length, cache.position, *cache.slot_meta.values(),
            *cache.state.values()]


def _to(cache: LayerCache, device: str) -> LayerCache:
    return LayerCache(k=cache.k.to(device, copy=True), v=cache.v.to(device, copy=True),
                      log_weight=cache.log_weight.to(device, copy=True), length=cache.length.to(device, copy=True),
                      position=cache.position.to(device, copy=True),
                      slot_meta={n: t.to(device, copy=True) for n, t in cache.slot_meta.items()},
                      state={n: t.to(device, copy=True) for n, t in cache.state.items()})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("per_row", [False, True])
def test_cuda_graph_replay_equals_eager(per_row: bool) -> None:
    """On CUDA (``torch.ops.kvpass.cosine_match``) the step is captured in a CUDA graph (no host sync) and its
    replay from the same inputs equals the eager step; both equal the CPU step's entries."""
    policy, interval = D2O(interval=8), 8
    keeps = [20, 12, 17, 60] if per_row else [20] * 4
    c = 20 + interval
    lengths = [[c] * 3, [12 + interval, 5, 14], [19, 17, 3], [c - 2, c, 1]] if per_row else \
        [[c] * 3, [c, 7, 20], [20, 5, 1], [c, c, 11]]
    start = shuffled(ordered_cache(lengths, c, 64, 0, torch.float32), 0)

    def step(cache: LayerCache, keep: torch.Tensor) -> None:
        if per_row:
            policy.compress_rows_into(cache, keep)
        else:
            policy.compress_into(cache, 20)

    want = _to(start, "cpu")
    step(want, torch.tensor(keeps))
    eager = _to(start, "cuda")
    keep = torch.tensor(keeps, device="cuda")
    step(eager, keep)                                          # warm-up: Triton compilation
    captured = _to(start, "cuda")
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(_to(start, "cuda"), keep)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        step(captured, keep)
    for t, s in zip(_tensors(captured), _tensors(_to(start, "cuda")), strict=True):
        t.copy_(s)
    graph.replay()
    torch.cuda.synchronize()
    for got, ref in zip(_tensors(captured), _tensors(eager), strict=True):
        assert torch.equal(got, ref)
    g, w = by_position(_to(eager, "cpu")), by_position(want)
    for name in ("position", "log_weight", "col_sum", "window_scores"):
        assert torch.equal(g[name], w[name]), name
    for name in ("k", "v"):
        torch.testing.assert_close(g[name], w[name], rtol=1e-5, atol=1e-5)
