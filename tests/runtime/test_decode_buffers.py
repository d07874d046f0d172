"""``generate`` keeps its cache buffers for the next call of the same layout (kvpass/runtime/decode_buffers.py):
the decode step's recorded graphs replay there, on the new call's prompt, with eager's tokens. On the CPU the
graphs are ``CpuReplay``'s (a recorded step replays the closure of the session that recorded it, as a CUDA graph
replays the work it recorded)."""

from __future__ import annotations

import pytest
import torch

import kvpass
import kvpass.decode_step as ds
from benchmarks.bench.models import TINY_LLAMA, build_model
from kvpass.errors import OutOfDeviceMemory
from tests.cpu_replay import CpuReplay
from tests.policies.test_chelsea_calibration import tiny_calibration

# policy -> (budget, options): every decode-time path of the step (per-step eviction, a period, per-layer and
# per-row budgets, deferred scores, slot metadata, split heads)
CHELSEA = {"sinks": 4, "recent": 8, "interval": 4, "r_min": 0.1}
CASES = {"streamingllm": (24, {}), "snapkv": (24, {}), "d2o": (24, {}), "d2o[interval=4]": (24, {}),
         "pyramidkv": (24, {}), "h2o": (24, {}), "chelsea": (100, CHELSEA),
         # split-group layout: layer 1's KV head 0 keeps every token in a cache of its own (``Layer.full``)
         "chelsea-full-heads": (100, {**CHELSEA, "calibration": tiny_calibration([(1, 0)], head_dim=16)})}


def _prompts(n: int, length: int, batch: int = 2, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` prompts [batch, length], left-padded alike (row 0 by 3 tokens): one layout, different tokens."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(1, TINY_LLAMA["vocab_size"], (batch, length), generator=gen)
        mask = torch.ones_like(ids)
        mask[0, :3] = 0
        out.append((ids, mask))
    return out


def _generate_each(kv, prompts, new: int) -> tuple[list[torch.Tensor], list]:
    """Greedy ``generate`` of each (ids, mask) in turn -> (the sequences, each call's ``last_report``)."""
    got, reports = [], []
    for ids, mask in prompts:
        got.append(kv.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False))
        reports.append(kv.last_report)
    return got, reports


def _model(policy: str, budget: int, options: dict):
    torch.manual_seed(0)
    model = build_model(TINY_LLAMA, torch.device("cpu"), torch.float32)
    return kvpass.apply(model, policy=policy, budget=budget, **options)


@pytest.mark.parametrize("policy", list(CASES))
def test_calls_of_one_layout_replay_the_first_calls_graphs_with_eager_tokens(monkeypatch, policy):
    budget, options = CASES[policy]
    length = 200 if policy.startswith("chelsea") else 40
    prompts = _prompts(3, length)
    kv = _model(policy.removesuffix("-full-heads"), budget, options)
    assert bool(kv.graphs.full_heads) == policy.endswith("-full-heads")
    want, _ = _generate_each(kv, prompts, 20)
    assert not kv.decode_buffers.held                             # eager (CPU): nothing kept
    monkeypatch.setattr(ds, "graphs_enabled", lambda device: True)
    kv.decode_step = CpuReplay()
    got, reports = _generate_each(kv, prompts, 20)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    assert reports[0].graph_captures >= 1 and not reports[0].reused_buffers
    assert kv.decode_buffers.held
    if policy.startswith("d2o") or policy == "pyramidkv":
        # per-layer budgets follow each prompt's own attention: buffers are reused where the last call's are alike
        same = [r.row_layer_budgets == before.row_layer_budgets for before, r in zip(reports, reports[1:], strict=False)]
    else:
        same = [True, True]
    for r, s in zip(reports[1:], same, strict=True):
        assert r.reused_buffers == s
        assert (r.graph_captures == 0) == s
    assert any(same) or policy.startswith("d2o") or policy == "pyramidkv"


def test_a_call_of_another_layout_and_a_users_session_between_calls_stay_exact(monkeypatch):
    """A call of another batch drops the kept buffers (new ones, new captures); a session the user steps between
    two calls has its own buffers; each gives eager's tokens, and the call after the user's session reuses the
    kept buffers but captures anew (the session's steps dropped the graphs)."""
    kv = _model("streamingllm", 24, {})
    (a, ma), (b, mb) = _prompts(2, 40)
    one = _prompts(1, 33, batch=1, seed=1)[0]
    reports = []

    def generate(ids, mask):
        out = kv.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
        reports.append(kv.last_report)
        return out

    def calls():
        out = [generate(a, ma), generate(b, mb), generate(*one), generate(a, ma)]
        session = kv.start(b, attention_mask=mb, max_new_tokens=20)
        tok, steps = session.logits.argmax(-1), []
        for _ in range(19):
            steps.append(tok)
            tok = session.step(tok).argmax(-1)
        return [*out, torch.stack(steps, 1), generate(a, ma)]

    want = calls()
    monkeypatch.setattr(ds, "graphs_enabled", lambda device: True)
    kv.decode_step = CpuReplay()
    reports.clear()
    got = calls()
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    assert [r.reused_buffers for r in reports] == [False, True, False, False, True]
    assert [r.graph_captures > 0 for r in reports] == [True, False, True, True, True]


def test_turned_off_chunked_or_deferred_every_call_captures_and_nothing_is_kept(monkeypatch):
    monkeypatch.setattr(ds, "graphs_enabled", lambda device: True)
    kv = _model("snapkv", 24, {})
    kv.decode_step = CpuReplay()
    ids, mask = _prompts(1, 40)[0]
    kv.reuse_decode_buffers = False
    for _ in range(2):
        kv.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
        assert kv.last_report.graph_captures >= 1 and not kv.decode_buffers.held
    kv.reuse_decode_buffers = True
    kv.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    assert kv.decode_buffers.held
    kv.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, prefill_chunk=16)
    assert kv.last_report.graph_captures >= 1 and not kv.decode_buffers.held
    deferred = _model("cam", 24, {"first_compression": "decode"})      # new buffers at its first step anyway
    deferred.decode_step = CpuReplay()
    for _ in range(2):
        deferred.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
        assert deferred.last_report.graph_captures >= 1 and not deferred.decode_buffers.held


def test_a_memory_check_that_fails_with_buffers_kept_frees_them_first(monkeypatch):
    """The prefill's memory check counts the kept buffers as in use: where they are what is in the way, they are
    freed (graphs too) and the call goes on; where the prompt does not fit anyway, the refusal stands."""
    monkeypatch.setattr(ds, "graphs_enabled", lambda device: True)
    kv = _model("snapkv", 24, {})
    kv.decode_step = CpuReplay()
    ids, mask = _prompts(1, 40)[0]
    kv.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    assert kv.decode_buffers.held and kv.decode_buffers.nbytes() > 0
    kv.free_bytes = lambda device: 0 if kv.decode_buffers.held else 1 << 40
    kv.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    assert kv.last_report.graph_captures >= 1 and not kv.last_report.reused_buffers
    kv.free_bytes = lambda device: 0
    with pytest.raises(OutOfDeviceMemory):
        kv.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    assert not kv.decode_buffers.held
    kv.free_bytes = None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("policy", ["snapkv", "d2o", "streamingllm"])
def test_cuda_calls_in_kept_buffers_give_eager_tokens(policy):
    """On CUDA (real graphs, compiled decode): calls of one layout on different prompts replay the first call's
    graphs in its buffers, a call of another layout captures its own; every call gives the eager step's tokens
    (float32)."""
    torch.manual_seed(0)
    model = build_model(TINY_LLAMA, torch.device("cuda"), torch.float32)
    prompts = [(ids.cuda(), mask.cuda()) for ids, mask in _prompts(3, 40)]
    other = [(ids.cuda(), mask.cuda()) for ids, mask in _prompts(1, 33, seed=1)]
    calls = [prompts[0], prompts[1], other[0], prompts[2], prompts[2]]
    eager = kvpass.apply(model, policy=policy, budget=24, compile=False)
    eager.decode_step.enabled = False
    want, _ = _generate_each(eager, calls, 24)
    kv = kvpass.apply(model, policy=policy, budget=24)
    got, reports = _generate_each(kv, calls, 24)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    assert reports[0].graph_captures >= 1 and not reports[0].reused_buffers
    assert reports[-1].reused_buffers and reports[-1].graph_captures == 0
