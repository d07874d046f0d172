"""D2O's in-place one-in-one-out step: the Triton kernels against the plain-torch reference.

The scalar outcome (which slot is evicted, where the newest entry goes, positions, scores,
log-weights, lengths, whether the threshold is set) must agree exactly. K, V and tau are compared to a
tight tolerance: the nearest key's cosine u* comes from a dot product summed in another order than
torch's matmul (and exp(u*) from another exp), so u*, hence tau and the merged K, V rows, may differ
in the last bits: one unit in the last place of the cache dtype for a merged row (under the interpreter
fp32 -> bf16 casts truncate where torch rounds to nearest, so bf16 merged rows often differ by one unit;
on CUDA both round to nearest). Rows nothing was merged into are copies: equal bit for bit."""

from __future__ import annotations

import importlib

import pytest
import torch

from kvpass.cache import LayerCache
from kvpass.kernels.d2o_evict_one import (
    d2o_evict_one_reference,
    d2o_evict_one_triton,
    ema_threshold,
    merge_weights,
    pick_one,
)
from kvpass.policies.d2o import D2O, TAU, TAU_SET

# the interpreter evaluates both sides of tl.where: log2(0) / 0-division warnings in masked lanes
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

EXACT = ("col_sum", "window", "position", "log_weight", "length", "tau_set")


def random_layer(b: int, h: int, keep: int, d: int, seed: int, dtype: torch.dtype, length: torch.Tensor | None = None,
                 near: float = 0.3) -> dict[str, torch.Tensor]:
    """A layer of capacity keep + 1: ragged rows (by default random lengths, every other row full: full
    rows evict, shorter ones do not), distinct live positions with gaps in no slot order (as after earlier
    in-place steps) except the newest of a full row in slot C - 1, scores on a coarse grid (ties), a fraction ``near`` of keys near-copies of others
    (merges), garbage K/V in empty slots, and tau set in some batch rows. 'window' is one more
    slot-metadata tensor, moved with its slot like col_sum."""
    gen = torch.Generator().manual_seed(seed)
    c = keep + 1
    if length is None:
        length = torch.randint(1, c + 1, (b, h), generator=gen)
        length.view(-1)[:: 2] = c
    live = torch.arange(c) < length[..., None]
    position = torch.full((b, h, c), -1)
    for row, n in zip(position.view(-1, c), length.view(-1).tolist(), strict=True):
        row[:n] = torch.randperm(2 * c, generator=gen)[:n]              # distinct, with gaps, in no order
        if n == c:                                                      # but a full row's newest is in slot C - 1,
            newest = int(row.argmax())                                  # which the decode step just wrote
            row[[newest, c - 1]] = row[[c - 1, newest]]
    k = torch.randn(b, h, c, d, generator=gen, dtype=torch.float64)
    src = torch.randint(0, c, (b, h, c), generator=gen)
    copy = torch.rand(b, h, c, generator=gen) < near
    k = torch.where(copy[..., None], torch.gather(k, 2, src[..., None].expand(-1, -1, -1, d))
                    + 0.05 * k, k)
    col_sum = (torch.randint(0, 8, (b, h, c), generator=gen) / 8.0).float() * live
    return dict(k=k.to(dtype), v=torch.randn(b, h, c, d, generator=gen, dtype=torch.float64).to(dtype),
                col_sum=col_sum, position=position, log_weight=torch.where(live, 0.0, float("-inf")).float(),
                length=length, tau=torch.rand(b, generator=gen) - 0.3, tau_set=torch.rand(b, generator=gen) < 0.5,
                window=torch.rand(b, h, c, generator=gen) * live)


def decode_write(layer: dict[str, torch.Tensor], step: int, gen: torch.Generator) -> None:
    """One decode step's write at slot length: a fresh entry (every third step a near-copy of slot 1's
    key), position newest + 1, a score; every live score grows by a function of its position."""
    b, h, c, d = layer["k"].shape
    slot = layer["length"][..., None]
    k_new = torch.randn(b, h, 1, d, generator=gen, dtype=torch.float64).to(layer["k"].dtype)
    if step % 3 == 1:
        k_new = layer["k"][:, :, 1:2] + 0.01 * k_new
    layer["k"].scatter_(2, slot[..., None].expand(-1, -1, 1, d), k_new)
    layer["v"].scatter_(2, slot[..., None].expand(-1, -1, 1, d),
                        torch.randn(b, h, 1, d, generator=gen, dtype=torch.float64).to(layer["v"].dtype))
    layer["position"].scatter_(2, slot, layer["position"].amax(-1, keepdim=True) + 1)
    layer["log_weight"].scatter_(2, slot, 0.0)
    live = layer["log_weight"] > float("-inf")
    layer["col_sum"] += torch.where(live, (layer["position"] * (step + 3) % 5).float() / 8, 0.0)
    layer["col_sum"].scatter_(2, slot, (torch.randint(0, 8, (b, h, 1), generator=gen) / 8.0).float())
    layer["window"].scatter_(2, slot, torch.rand(b, h, 1, generator=gen))
    layer["length"].add_(1)


def copied(layer: dict[str, torch.Tensor], device: str | torch.device) -> dict[str, torch.Tensor]:
    return {name: t.to(device, copy=True) for name, t in layer.items()}


def run_step(impl, layer: dict[str, torch.Tensor], keep: int, sinks: int, recent: int, variant: str,
             **kwargs) -> None:
    impl(layer["k"], layer["v"], layer["col_sum"], layer["position"], layer["log_weight"], layer["length"],
         layer["tau"], layer["tau_set"], [layer["window"]], [], keep, sinks, recent, 0.7, variant, **kwargs)


def merge_outcomes(layer: dict[str, torch.Tensor], keep: int, sinks: int, recent: int, variant: str
                   ) -> tuple[int, int]:
    """(evictions that merge, evictions that do not) in this step, from the reference's pieces."""
    pick = pick_one(layer["k"], layer["v"], layer["col_sum"], layer["position"], layer["length"], keep, sinks, recent)
    tau, _ = ema_threshold(pick.u_star, pick.valid, layer["tau"], layer["tau_set"], 0.7)
    merged, _, _ = merge_weights(pick.u_star, pick.valid, tau, variant)
    return int(merged.sum()), int((pick.valid & ~merged).sum())


def assert_replay_equals(step, start: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """``step(layer)`` (an in-place op on a dict of CUDA tensors) captured once in a CUDA graph over a copy of
    ``start`` and replayed from ``start``'s values equals ``want`` exactly (the eager result from ``start``)."""
    layer = copied(start, "cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(layer)
    for name, t in layer.items():
        t.copy_(start[name])
    graph.replay()
    torch.cuda.synchronize()
    for name in want:
        assert torch.equal(layer[name], want[name]), name


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], msg: str) -> None:
    for name in EXACT:
        assert torch.equal(got[name].cpu(), want[name]), f"{msg}: {name}"
    torch.testing.assert_close(got["tau"].cpu(), want["tau"], rtol=0, atol=1e-6, msg=f"{msg}: tau")
    rtol = {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}.get(want["k"].dtype, 1e-6)
    for name in ("k", "v"):
        torch.testing.assert_close(got[name].cpu(), want[name], rtol=rtol, atol=1e-6, msg=f"{msg}: {name}")


@pytest.mark.parametrize("variant", ["paper", "code"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_triton_equals_reference_over_steps(variant: str, dtype: torch.dtype, triton_device: str) -> None:
    """Several in-place steps from a random unordered layer, for windows from none to most of the row
    and one or three key-scan splits; merges both happen and are refused."""
    keep, dev = 12, torch.device(triton_device)
    outcomes = [0, 0]
    for case, (sinks, recent, splits) in enumerate([(4, 3, 1), (0, 0, 3), (1, 8, 2)]):
        want = random_layer(2, 3, keep, 16, seed=case + 10 * (dtype == torch.bfloat16), dtype=dtype)
        gen = torch.Generator().manual_seed(case)
        for step in range(4):
            got, before = copied(want, dev), copied(want, "cpu")         # each step from the same inputs
            for i, n in enumerate(merge_outcomes(want, keep, sinks, recent, variant)):
                outcomes[i] += n
            run_step(d2o_evict_one_reference, want, keep, sinks, recent, variant)
            run_step(d2o_evict_one_triton, got, keep, sinks, recent, variant, splits=splits, block_c=4,
                     block_scan=8)
            assert_same(got, want, f"case {case} step {step}")
            for name in ("k", "v"):                                    # only written slots may differ
                written = (want[name] != before[name]).any(-1)
                assert not ((got[name].cpu() != want[name]).any(-1) & ~written).any(), name
            decode_write(want, step, gen)
    assert outcomes[0] > 0 and outcomes[1] > 0, outcomes


def test_rows_that_evict_nothing_are_left_unchanged(triton_device: str) -> None:
    """No row full: every tensor, garbage in empty slots and -0.0 included, keeps its bits; tau too."""
    layer = random_layer(2, 3, 12, 16, seed=5, dtype=torch.bfloat16)
    layer["length"].clamp_(max=12)
    live = torch.arange(13) < layer["length"][..., None]
    for name, empty in (("position", -1), ("log_weight", float("-inf")), ("col_sum", 0.0), ("window", 0.0)):
        layer[name].masked_fill_(~live, empty)
    layer["k"].view(-1)[::7] = -0.0
    for impl, kwargs in ((d2o_evict_one_reference, {}), (d2o_evict_one_triton, dict(splits=2, block_c=4, block_scan=8))):
        got = copied(layer, triton_device if kwargs else "cpu")
        run_step(impl, got, 12, 4, 3, "paper", **kwargs)
        for name, t in layer.items():
            assert torch.equal(got[name].cpu().view(torch.uint8), t.view(torch.uint8)), f"{impl.__name__}: {name}"


@pytest.mark.parametrize("variant", ["paper", "code"])
def test_newest_entry_is_merged_into_before_it_moves(variant: str, triton_device: str) -> None:
    """Row (0, 0): the evicted entry's nearest key is the newest entry (slot C - 1), which then moves into
    the evicted slot, merged. Row (0, 1): recent = 0 and the newest entry has the lowest score, so it is
    evicted itself (e = C - 1) and its slot is emptied."""
    keep = 6
    layer = random_layer(1, 2, keep, 8, seed=1, dtype=torch.float32)
    layer["length"].fill_(keep + 1)
    layer["position"][:] = torch.arange(keep + 1)
    layer["log_weight"].zero_()
    layer["col_sum"][:] = torch.arange(keep + 1, 0, -1).float()                   # the newest scores lowest
    layer["col_sum"][0, 0, 3] = 0.0                                               # row 0: slot 3 is evicted
    layer["k"][0, 0, keep] = 2 * layer["k"][0, 0, 3]                              # ... into the newest entry
    layer["k"][0, 1, keep - 1] = layer["k"][0, 1, keep] + 0.01                    # row 1 merges too
    layer["tau"][:], layer["tau_set"][:] = 0.5, True
    want = copied(layer, "cpu")
    run_step(d2o_evict_one_reference, want, keep, 1, 0, variant)
    got = copied(layer, triton_device)
    run_step(d2o_evict_one_triton, got, keep, 1, 0, variant, splits=2, block_c=4, block_scan=4)
    assert_same(got, want, variant)
    assert want["position"][0, 0].tolist() == [0, 1, 2, 6, 4, 5, -1]
    assert not torch.equal(want["v"][0, 0, 3], layer["v"][0, 0, keep])           # merged, then moved
    assert want["position"][0, 1].tolist() == [0, 1, 2, 3, 4, 5, -1]             # the newest itself went


@pytest.mark.parametrize("splits, block_c", [(1, 16), (1, 4), (2, 4), (3, 4)])  # one block, blocks, splits
def test_ties_go_to_the_lowest_slot(splits: int, block_c: int, triton_device: str) -> None:
    """Equal lowest scores (in one chunk, or in two: splits 2): the lower slot is evicted; equally similar
    keys (exact copies, in one block or in different splits): the lower slot is merged into."""
    keep = 12
    layer = random_layer(1, 1, keep, 8, seed=2, dtype=torch.float32)
    layer["length"].fill_(keep + 1)
    layer["position"][:] = torch.arange(keep + 1)
    layer["log_weight"].zero_()
    layer["col_sum"][:] = 1.0
    layer["col_sum"][0, 0, [8, 5]] = 0.0                                         # slot 5 goes, not 8
    layer["k"][0, 0, [2, 11]] = 3 * layer["k"][0, 0, 5]                         # both nearest: slot 2 takes it
    layer["tau_set"][:] = False
    want = copied(layer, "cpu")
    run_step(d2o_evict_one_reference, want, keep, 1, 1, "paper")
    got = copied(layer, triton_device)
    run_step(d2o_evict_one_triton, got, keep, 1, 1, "paper", splits=splits, block_c=block_c, block_scan=8)
    assert_same(got, want, f"splits {splits}")
    assert want["position"][0, 0, 5] == keep and want["position"][0, 0, 8] == 8
    assert not torch.equal(want["v"][0, 0, 2], layer["v"][0, 0, 2])
    assert torch.equal(want["v"][0, 0, 11], layer["v"][0, 0, 11])


def test_op_runs_the_reference_on_cpu_and_checks_inputs() -> None:
    layer = random_layer(2, 2, 8, 8, seed=3, dtype=torch.float32)
    want = copied(layer, "cpu")
    run_step(d2o_evict_one_reference, want, 8, 2, 2, "code")
    run_step(torch.ops.kvpass.d2o_evict_one, layer, 8, 2, 2, "code")
    for name in want:
        assert torch.equal(layer[name], want[name]), name
    with pytest.raises(ValueError, match="keep \\+ 1"):
        run_step(d2o_evict_one_triton, layer, 7, 2, 2, "code")
    with pytest.raises(ValueError, match="at most keep"):
        run_step(d2o_evict_one_triton, layer, 8, 2, 7, "code")
    layer["tau"] = layer["tau"].double()
    with pytest.raises(ValueError, match="tau must be"):
        run_step(d2o_evict_one_triton, layer, 8, 2, 2, "code")


# ------------------------------------------------------------------------------------------- CUDA
def _cuda_layer(b: int, seed: int) -> dict[str, torch.Tensor]:
    """Real shapes: Hkv = 8, C = 6555, D = 128, bf16, all rows full but one. No near-copies: at C = 6555 two
    near-copies of one key could tie to within the last-bit differences and swap the nearest."""
    length = torch.full((b, 8), 6555)
    length[0, 3] = 6000
    layer = random_layer(b, 8, 6554, 128, seed=seed, dtype=torch.bfloat16, length=length, near=0.0)
    return {name: t.cuda() for name, t in layer.items()}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("b", [1, 4])
@pytest.mark.parametrize("variant", ["paper", "code"])
def test_cuda_op_equals_reference_at_real_shapes(b: int, variant: str) -> None:
    """The registered op on CUDA (the Triton kernels) against the reference on CUDA, five steps."""
    want = _cuda_layer(b, seed=b)
    gen = torch.Generator().manual_seed(b)
    sinks, recent = 4, 1638
    for step in range(5):
        got = copied(want, "cuda")
        run_step(torch.ops.kvpass.d2o_evict_one, got, 6554, sinks, recent, variant)
        run_step(d2o_evict_one_reference, want, 6554, sinks, recent, variant)
        assert_same({n: t.cpu() for n, t in got.items()}, {n: t.cpu() for n, t in want.items()}, f"step {step}")
        cpu = {name: t.cpu() for name, t in want.items()}
        decode_write(cpu, step, gen)
        want = {name: t.cuda() for name, t in cpu.items()}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_op_replays_in_a_cuda_graph() -> None:
    """Captured once and replayed: the op neither synchronises nor allocates per step beyond scratch,
    and a replay equals an eager call on the same inputs."""
    layer = _cuda_layer(2, seed=7)
    start = copied(layer, "cuda")
    want = copied(layer, "cuda")
    run_step(torch.ops.kvpass.d2o_evict_one, want, 6554, 4, 1638, "paper")
    run_step(torch.ops.kvpass.d2o_evict_one, layer, 6554, 4, 1638, "paper")       # warm-up (compiles)
    assert_replay_equals(lambda x: run_step(torch.ops.kvpass.d2o_evict_one, x, 6554, 4, 1638, "paper"), start, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_policy_compress_into_takes_the_triton_op_on_cuda(monkeypatch) -> None:
    """``D2O.compress_into`` on a CUDA cache runs the Triton kernels (once per layer) and creates the
    threshold state it then mutates; same result as the reference from an unset threshold."""
    module = importlib.import_module("kvpass.kernels.d2o_evict_one")
    calls = []
    triton_impl = module.d2o_evict_one_triton
    monkeypatch.setattr(module, "d2o_evict_one_triton", lambda *a, **kw: calls.append(1) or triton_impl(*a, **kw))
    layer = _cuda_layer(1, seed=3)
    layer["tau"].zero_()
    layer["tau_set"].zero_()
    want = copied(layer, "cuda")
    cache = LayerCache(k=layer["k"], v=layer["v"], log_weight=layer["log_weight"], length=layer["length"],
                       position=layer["position"], slot_meta={"col_sum": layer["col_sum"], "window": layer["window"]})
    D2O(d2o_variant="code").compress_into(cache, 6554)
    assert calls == [1]
    run_step(d2o_evict_one_reference, want, 6554, *D2O().split(6554)[::2], "code")
    got = dict(layer, tau=cache.state[TAU], tau_set=cache.state[TAU_SET])
    assert_same({n: t.cpu() for n, t in got.items()}, {n: t.cpu() for n, t in want.items()}, "policy")


@pytest.mark.parametrize("variant", ["paper", "code"])
def test_triton_equals_reference_with_the_merge_guard_and_bias(variant: str, triton_device: str) -> None:
    """D2O's options (a cosine floor, no merge into the sinks, the log-size bias) over several steps: the
    kernels equal the reference (log-weights to float tolerance: another exp/log), and the reference does
    what the options say: merges only at u >= floor, never into a slot below target_from, and the target's
    log-weight becomes the log of the summed sizes."""
    keep, sinks, recent, floor, dev = 12, 3, 2, 0.5, torch.device(triton_device)
    merged_total = refused_by_floor = 0
    for case in range(3):
        want = random_layer(2, 3, keep, 16, seed=40 + case, dtype=torch.float32, near=0.5)
        gen = torch.Generator().manual_seed(case)
        for step in range(4):
            got, before = copied(want, dev), copied(want, "cpu")
            pick = pick_one(want["k"], want["v"], want["col_sum"], want["position"], want["length"], keep, sinks,
                            recent, target_from=sinks)
            tau, _ = ema_threshold(pick.u_star, pick.valid, want["tau"], want["tau_set"], 0.7)
            merged, _, _ = merge_weights(pick.u_star, pick.valid, tau, variant, floor)
            plain, _, _ = merge_weights(pick.u_star, pick.valid, tau, variant)
            assert bool((pick.nearest[pick.valid] >= sinks).all())
            assert bool((pick.u_star[merged] >= floor).all())
            merged_total += int(merged.sum())
            refused_by_floor += int((plain & ~merged).sum())
            kwargs = dict(min_cos=floor, target_from=sinks, bias=True)
            d2o_evict_one_reference(*_args(want, keep, sinks, recent, variant), **kwargs)
            d2o_evict_one_triton(*_args(got, keep, sinks, recent, variant), **kwargs, splits=2, block_c=4, block_scan=8)
            lw_got, lw_want = got.pop("log_weight").cpu(), want["log_weight"]
            torch.testing.assert_close(lw_got, lw_want, rtol=0, atol=1e-6, msg=f"case {case} step {step}: log_weight")
            assert_same({**got, "log_weight": lw_want}, want, f"case {case} step {step}")
            # the bias: a merged target's size is the sum of both sizes (before the newest moves into e)
            for b, g in merged[..., 0].nonzero().tolist():
                n, e = int(pick.nearest[b, g, 0]), int(pick.e[b, g, 0])
                size = before["log_weight"][b, g, n].exp() + before["log_weight"][b, g, e].exp()
                slot = e if n == keep else n                              # slot C - 1 moves into e
                assert abs(float(want["log_weight"][b, g, slot].exp() - size)) < 1e-5
            decode_write(want, step, gen)
    assert merged_total > 0 and refused_by_floor > 0, (merged_total, refused_by_floor)


def _args(layer: dict[str, torch.Tensor], keep: int, sinks: int, recent: int, variant: str) -> tuple:
    return (layer["k"], layer["v"], layer["col_sum"], layer["position"], layer["log_weight"], layer["length"],
            layer["tau"], layer["tau_set"], [layer["window"]], [], keep, sinks, recent, 0.7, variant)
