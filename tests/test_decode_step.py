from __future__ import annotations

import pytest
import torch

import kvpass
import kvpass.decode_step as ds
from benchmarks.bench.models import TINY_LLAMA, build_model
from kvpass.cache import LayerCache, load_into, with_capacity
from kvpass.decode_step import StaticDecodeStep, capture_key
from tests.cpu_replay import CpuReplay


def _step_inputs(step: int) -> list[torch.Tensor]:
    return [torch.full((1,), step), torch.full((1, 1), 10 + step)]


def test_capture_key_changes_only_when_a_persistent_buffer_changes():
    cache = LayerCache.empty(1, 2, 8, 4, torch.float32, "cpu")
    key = capture_key(_step_inputs(0), cache.tensors())
    assert capture_key(_step_inputs(1), cache.tensors()) == key          # new step tensors, same buffers
    other = LayerCache.empty(1, 2, 8, 4, torch.float32, "cpu")
    other.k.normal_()
    other.length.fill_(3)
    load_into(cache, other)                                              # compression writes in place
    assert capture_key(_step_inputs(2), cache.tensors()) == key
    assert capture_key(_step_inputs(2), with_capacity(cache, 12).tensors()) != key   # reallocated
    assert capture_key([torch.zeros(2), torch.zeros(2, 1)], cache.tensors()) != key  # new batch size


def test_cpu_runs_eagerly():
    step = StaticDecodeStep()
    out = step(lambda a, b: (a * 2,), _step_inputs(3), [])
    assert torch.equal(out[0], torch.full((1,), 6)) and step.captures == 0


@pytest.mark.parametrize("elsewhere", [False, True])
def test_a_step_over_tensors_of_another_device_runs_eagerly_without_a_capture(monkeypatch, elsewhere):
    """A persistent tensor on another device than the step inputs (ClusterKV's host-resident cache on a CUDA
    model): the step's work on it would not replay from a graph, and its capture fails (a copy to pageable host
    memory), so it is not tried; the step runs eagerly, now and at the next call."""
    monkeypatch.setattr(ds, "graphs_enabled", lambda device: True)
    step = CpuReplay()
    calls = []

    def fn(x):
        calls.append(1)
        return (x * 2,)

    persistent = [torch.zeros(2, device="meta" if elsewhere else "cpu")]
    for _ in range(2):
        out = step(fn, [torch.ones(1)], persistent)
        assert torch.equal(out[0], torch.full((1,), 2.0))
    assert step.captures == (0 if elsewhere else 1)
    assert step.graphed(torch.device("cpu")) is not elsewhere
    assert len(calls) == 2          # eager twice; or the capture's warm-up (the step) and one replay


@pytest.mark.parametrize("warmup", [1, 3])
def test_warm_up_applies_the_step_exactly_once(warmup):
    """The warm-up's last run is the step (its outputs returned); runs before it put back what they advanced.
    With one run (the default) nothing is saved: no copy of the cache exists at any moment."""
    length = torch.zeros(2, dtype=torch.long)
    written = torch.zeros(4)

    def fn(x):
        written[length] = x            # idempotent write at the current slot
        length.add_(1)                 # advanced: put back after every run but the step's
        return (written.sum()[None],)

    clones = []
    original = torch.Tensor.clone
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.Tensor, "clone", lambda t, *a, **k: clones.append(1) or original(t, *a, **k))
        outs = CpuReplay(warmup=warmup)._warm_up(fn, [torch.tensor(5.0)], [length])
    assert length.tolist() == [1, 1] and written.tolist() == [5.0, 0, 0, 0] and outs[0].item() == 5.0
    assert len(clones) == warmup - 1


@pytest.mark.parametrize("policy, options", [("d2o", {}), ("streamingllm", {}), ("d2o", {"interval": 4})])
def test_replayed_steps_equal_eager_steps(monkeypatch, policy, options):
    """With the step's capture warm-up as the step itself, replayed steps (CPU stand-in of the graphs) give the
    same logits and caches as eager steps, compressing steps included (d2o every step, streamingllm every 16,
    d2o[interval=4] with deferred scores every 4)."""
    torch.manual_seed(0)
    model = build_model(TINY_LLAMA, torch.device("cpu"), torch.float32)
    ids = torch.randint(1, TINY_LLAMA["vocab_size"], (1, 40))
    kv = kvpass.apply(model, policy=policy, budget=24, **options)

    def run() -> list[torch.Tensor]:
        session = kv.start(ids, max_new_tokens=24)
        tok, logits = session.logits.argmax(-1), []
        for _ in range(24):
            logits.append(session.step(tok))
            tok = logits[-1].argmax(-1)
        return logits + [t.clone() for lay in session.layers for c in lay.caches() for t in c.tensors()]

    want = run()
    monkeypatch.setattr(ds, "graphs_enabled", lambda device: True)
    kv.decode_step = CpuReplay()
    got = run()
    assert kv.decode_step.captures == 2                              # the plain and the compressing step
    for a, b in zip(got, want, strict=True):      # NaN: D2O's unknown key norms (kvpass/kernels/decode_attention_nearest.py)
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


# Chelsea compressing every 4 steps by one CSM step (its in-graph form: r_min * middle > interval)
POLICY_KWARGS = {"chelsea": {"sinks": 4, "recent": 8, "interval": 4, "r_min": 0.1}}


@pytest.mark.parametrize("policy, budget", [("full", 1.0), ("streamingllm", 24), ("d2o", 24), ("d2o[interval=16]", 24),
                                            ("h2o", 24), ("snapkv", 24), ("pyramidkv", 24), ("cam", 24), ("chelsea", 100),
                                            ("kvmerger", 24), ("clusterkv", 24), ("quest", 24), ("ems", 40)])
def test_replayed_generate_matches_eager_with_bounded_captures(monkeypatch, policy, budget):
    """Through the runtime: replaying the recorded steps (the plain step, and the step that first
    compresses every due layer) gives eager's tokens; compressions write into the same buffers, so
    there is one capture per variant, not one per token."""
    torch.manual_seed(0)
    model = build_model(TINY_LLAMA, torch.device("cpu"), torch.float32)
    ids = torch.randint(1, TINY_LLAMA["vocab_size"], (2, {"chelsea": 200, "ems": 80}.get(policy, 40)))
    kv = kvpass.apply(model, policy=policy, budget=budget, **POLICY_KWARGS.get(policy, {}))
    want = kv.generate(ids, max_new_tokens=24, do_sample=False)
    eager_compressions = kv.last_report.compressions
    monkeypatch.setattr(ds, "graphs_enabled", lambda device: True)
    kv.decode_step = CpuReplay()
    got = kv.generate(ids, max_new_tokens=24, do_sample=False)
    assert torch.equal(got, want)
    assert kv.last_report.compressions == eager_compressions
    variants = 1 + (kv.last_report.compressions > 0)
    assert kv.decode_step.captures <= variants + 1
    if policy in ("streamingllm", "d2o", "chelsea"):                   # decode-time compressions too
        assert kv.last_report.compressions > {"d2o": 20, "chelsea": 8}.get(policy, 1)
    before = kv.decode_step.captures
    kv.generate(ids[:1], max_new_tokens=3, do_sample=False)              # new buffers: new captures
    assert kv.decode_step.captures > before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("policy, budget", [("d2o", 24), ("h2o", 24), ("streamingllm", 24), ("snapkv", 24),
                                            ("chelsea", 100)])
def test_cuda_graph_decode_with_compression_matches_eager(policy, budget):
    """On CUDA: the replayed steps (compression inside the graph) give the eager tokens, and the number
    of captures stays bounded (one per step variant, not one per token)."""
    torch.manual_seed(0)
    model = build_model(TINY_LLAMA, torch.device("cuda"), torch.float32)
    ids = torch.randint(1, TINY_LLAMA["vocab_size"], (2, 200 if policy == "chelsea" else 40), device="cuda")
    # the eager graph under a CUDA graph (compiled decode, the CUDA default, is tests/runtime/test_compiled_decode.py's)
    kv = kvpass.apply(model, policy=policy, budget=budget, compile=False, **POLICY_KWARGS.get(policy, {}))
    kv.decode_step.enabled = False
    want = kv.generate(ids, max_new_tokens=32, do_sample=False)
    kv.decode_step = StaticDecodeStep()
    got = kv.generate(ids, max_new_tokens=32, do_sample=False)
    assert torch.equal(got, want)
    assert 1 <= kv.decode_step.captures <= 3
    assert kv.last_report.compressions > 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 6, 20])
def test_d2o_tokens_do_not_depend_on_how_many_streams_its_evictions_fork_over(rows):
    """D2O's per-step evictions, forked over ``forked_branches(rows, 1, 8)`` streams (1, 2 and 8 here) and over 8
    forced: the same tokens, every step replayed from a CUDA graph."""
    torch.manual_seed(0)
    model = build_model(TINY_LLAMA, torch.device("cuda"), torch.float32)
    ids = torch.randint(1, TINY_LLAMA["vocab_size"], (rows, 40), device="cuda")
    kv = kvpass.apply(model, policy="d2o", budget=24, compile=False)
    tokens = []
    for forced in (None, 8):
        kv.decode_step = StaticDecodeStep()
        kv.decode_step.fork_branches = forced
        tokens.append(kv.generate(ids, max_new_tokens=24, do_sample=False))
        assert kv.decode_step.captures >= 1 and kv.last_report.compressions > 1
    assert torch.equal(tokens[0], tokens[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_side_by_side_calls_replay_in_a_graph_and_join():
    """More calls than streams (round robin), each a chain of kernels on its own tensor, captured in a
    CUDA graph: every replay runs every call once, and the step's stream sees their results (joined)."""
    xs = [torch.zeros(1 << 16, device="cuda") for _ in range(11)]
    step = StaticDecodeStep(branches=4)

    def body():
        ds.run_side_by_side([lambda x=x, i=i: x.add_(i).mul_(2) for i, x in enumerate(xs)],
                            step.side_streams(torch.device("cuda")))
        return torch.stack([x[-1] for x in xs])

    graph = torch.cuda.CUDAGraph()
    body()                                                               # warm-up: x = 2 i
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        out = body()
    graph.replay()                                                       # x = 2 (2 i + i) = 6 i
    assert out.tolist() == [6.0 * i for i in range(11)]


def test_one_in_one_out_evictions_fork_over_fewer_streams_at_small_batches():
    """forked_branches: a policy compressing every step (interval 1) forks over 1 stream up to batch 4, 2 up to
    16, then ``most``; one compressing many entries at once (interval > 1) always over ``most``; never above it."""
    assert [ds.forked_branches(b, 1, 8) for b in (1, 4, 5, 16, 17, 64)] == [1, 1, 2, 2, 8, 8]
    assert [ds.forked_branches(b, 16, 8) for b in (1, 8, 64)] == [8, 8, 8]
    assert ds.forked_branches(8, 1, 1) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("branches", [1, 4])
@pytest.mark.parametrize("graphed", [False, True])
def test_forked_work_is_awaited_per_buffer_before_it_is_read(graphed, branches):
    """fork_side_by_side + await_compression: each buffer's side-stream work (a long chain of kernels) is
    complete where the step's stream awaits that buffer, though the stream did not wait at the fork;
    replayed from a CUDA graph too, where every branch must rejoin."""
    xs = [torch.zeros(1 << 20, device="cuda") for _ in range(6)]
    slot = torch.zeros(1, 1, dtype=torch.long, device="cuda")
    step = StaticDecodeStep(branches=branches)

    def body():
        ds.fork_side_by_side([(x, lambda x=x: [x.add_(1.0) for _ in range(40)]) for x in xs],
                             step.side_streams(torch.device("cuda")))
        sums = []
        for x in xs:
            torch.ops.kvpass.await_compression(slot, x)
            sums.append(x.sum())
        ds.join_pending()
        return torch.stack(sums)

    if not graphed:
        got = body()
        assert got.tolist() == [40.0 * xs[0].numel()] * len(xs)
        return
    body()                                                               # warm-up: x = 40
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = body()                                                     # captured, not run
    graph.replay()                                                       # x = 80
    assert out.tolist() == [80.0 * xs[0].numel()] * len(xs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("policy, compressions", [("d2o", 20), ("d2o[interval=16]", 2)])
def test_compiled_decode_with_forked_compression_matches_eager(policy, compressions):
    """torch.compile'd graphs (the await op inside Inductor's code) replayed from CUDA graphs give the
    eager steps' tokens (float32): the default one-in-one-out step compressing at every step, and interval 16
    (the prompt's compression and one more per layer in 24 steps)."""
    from kvpass.compile_backend import compile_graphs

    torch.manual_seed(0)
    model = build_model(TINY_LLAMA, torch.device("cuda"), torch.float32)
    ids = torch.randint(1, TINY_LLAMA["vocab_size"], (2, 40), device="cuda")
    kv = kvpass.apply(model, policy=policy, budget=24, compile=False)     # eager steps: the reference
    kv.decode_step.enabled = False
    want = kv.generate(ids, max_new_tokens=24, do_sample=False)
    kv.decode_step = StaticDecodeStep()
    compile_graphs(kv)
    got = kv.generate(ids, max_new_tokens=24, do_sample=False)
    assert kv.last_report.compressions > compressions and kv.decode_step.captures >= 1
    assert torch.equal(got, want)


class _Graph:
    """A stand-in for a CUDAGraph whose capture failed: reset() runs, and nothing else is asked of it."""

    def __init__(self):
        self.resets = 0

    def reset(self):
        self.resets += 1


@pytest.mark.parametrize(("torch_released_it", "live"), [(False, False), (True, False), (True, True)])
def test_a_failed_capture_pool_is_released_only_where_torch_kept_it(monkeypatch, torch_released_it, live):
    """torch before pytorch#190348 keeps a failed capture's pool (its segments stay, all free, after reset and
    empty_cache): then, and only then, kvpass drops the pool's use (releasePool) and empties the cache again.
    Where torch dropped the use itself but live tensors keep segments of the pool (``live``), a second drop would
    send the use count below zero (torch 2.11 then failed an internal assert at every later empty_cache): the
    pool is left alone."""
    pool, other = (7, 1), (0, 3)
    state = {"kept": not torch_released_it or live, "released": [], "ended": [], "emptied": 0}

    def snapshot():
        segs = [{"device": 0, "total_size": 1 << 20, "active_size": 1 << 10, "segment_pool_id": other}]
        ours = {"device": 0, "total_size": 1 << 30, "active_size": (1 << 20) if live else 0, "segment_pool_id": pool}
        return segs + ([ours] if state["kept"] else [])

    def release(index, p):
        state["released"].append((index, tuple(p)))
        state["kept"] = False

    def end(index, p):
        state["ended"].append((index, tuple(p)))
        order.append("end routing")
        raise RuntimeError("endAllocatePool: not currently recording to mempool_id")   # routing had ended

    monkeypatch.setattr(torch.cuda, "memory_snapshot", snapshot)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: state.__setitem__("emptied", state["emptied"] + 1))
    monkeypatch.setattr(torch._C, "_cuda_releasePool", release, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", end, raising=False)
    restored, order = [], []

    def restore(device):
        restored.append(device)
        order.append("restore generator")

    monkeypatch.setattr(ds, "restore_generator_after_capture", restore)   # a real capture (GPU test)
    graph = _Graph()
    ds.release_failed_capture(graph, pool, torch.device("cuda", 0))
    assert restored == [torch.device("cuda", 0)]
    assert order == ["end routing", "restore generator"]     # its scratch tensor is not allocated in the pool
    assert graph.resets == 1 and state["ended"] == [(0, pool)]
    assert state["released"] == ([] if torch_released_it else [(0, pool)])
    assert state["emptied"] == (1 if torch_released_it else 2)
    assert ds.pool_bytes(torch.device("cuda", 0), pool) == (((1 << 30), (1 << 20)) if live else (0, 0))
    assert ds.pool_bytes(torch.device("cuda", 0), other) == (1 << 20, 1 << 10)


@pytest.mark.parametrize(("free", "unused", "empties"), [(10, 4, False), (3, 4, True), (0, 0, False)])
def test_cache_is_emptied_before_a_capture_only_where_the_driver_has_less_free(monkeypatch, free, unused, empties):
    emptied = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free << 30, 80 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: (20 + unused) << 30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 20 << 30)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    ds.make_room_for_capture(torch.device("cuda", 0))
    assert bool(emptied) == empties


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_capture_that_fails_runs_eagerly_and_gives_its_memory_back():
    """A step that allocates 256 MiB and then synchronises (not allowed while capturing): the step runs eagerly,
    with the eager result, and the failed capture's pool does not stay reserved (torch 2.11 kept it)."""
    x = torch.arange(1 << 10, device="cuda", dtype=torch.float32)

    def fn(t):
        big = torch.empty(1 << 26, device="cuda")               # 256 MiB, from the capture's pool
        big.fill_(1.0)
        if torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize()                            # fails the capture
        return (t + big[: t.numel()],)

    step = StaticDecodeStep()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    other_pools = _pool_ids()                                   # earlier tests' graphs may still hold theirs
    out = step(fn, [x], [])
    assert torch.equal(out[0], x + 1)
    assert not step.graphed(x.device)                           # eager from now on
    torch.cuda.synchronize()
    del out
    torch.cuda.empty_cache()
    assert _pool_ids() <= other_pools, _pool_ids() - other_pools
    assert torch.cuda.memory_reserved() <= before + (1 << 26) + (32 << 20)   # the warm-up's block, at most
    assert torch.equal(step(fn, [x], [])[0], x + 1)
    # random draws work again (the failed capture had left the generator capturing: "Offset increment outside
    # graph capture encountered unexpectedly" at the next sampling)
    torch.randn(8, device="cuda")
    assert torch.multinomial(torch.ones(4, device="cuda"), 1).item() in range(4)


def _pool_ids() -> set[tuple[int, int]]:
    """The private memory pools that hold segments now (CUDA graphs' pools; (0, 0) is the default one)."""
    return {tuple(s["segment_pool_id"]) for s in torch.cuda.memory_snapshot()} - {(0, 0)}
