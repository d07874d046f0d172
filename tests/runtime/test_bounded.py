"""Bounded and finite (issue 27): decoding thousands of tokens, every compressed layer holds at most its
budget + interval entries after every step (each batch row its own), and every step's logits are finite.
The 4,000-token run of every policy in fp32 and bf16 is ``slow`` (minutes per case on 2 shared cores); an
80-token run of each (several compressions at budget 48) is not."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import transformers

import kvpass
from kvpass.policies import POLICIES

SMALL = {"chelsea": dict(sinks=2, recent=8, chunk=16, interval=8), "ems": dict(local_window=8),
         "snapkv": dict(window=4), "pyramidkv": dict(window=4), "streamingllm": dict(sinks=4),
         "clusterkv": dict(sinks=4, window=32, cluster_ratio=8, full_layers=0), "quest": dict(page_size=8, full_layers=0)}
BUDGET = 48


@functools.cache
def _model(dtype: torch.dtype, context: int) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context,
                                      initializer_range=0.1)
    return transformers.AutoModelForCausalLM.from_config(config).eval().to(dtype)


# What ``_decode_checked`` checks after the prefill and after every decode step; a failure reports the first step
CHECKS = ("logits finite",
          "every KV head of a compressed layer within its row's budget (+ the policy's per-head extra) + interval",
          "a row's heads together within Hkv x (budget + interval)",
          "a layer that is not compressed holds every token",
          "every live K, V entry finite (merged entries: no fp16 overflow, no NaN)")


def _violations(session, interval: int, seen: int, limits: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """[len(CHECKS)] bool on the model's device, True where the check fails now; no host sync (the step stays
    asynchronous on CUDA). ``seen``: tokens so far; ``limits``: per layer, its rows' (budgets, extra) on the
    device (made once: the rows' budgets do not change during a session)."""
    dev = session.logits.device
    bad = [~torch.isfinite(session.logits).all()] + [torch.zeros((), dtype=torch.bool, device=dev)] * 4
    for i, lay in enumerate(session.layers):
        length = lay.cache.length                                            # [B, Hkv]
        if lay.compressible:
            budgets, extra = limits[i]
            bad[1] = bad[1] | (length.amax(-1) > budgets + extra + interval).any()
            bad[2] = bad[2] | (length.sum(-1) > length.shape[1] * (budgets + interval)).any()
        else:
            bad[3] = bad[3] | (length.amax() != seen)
        for cache in lay.caches():
            live = (cache.log_weight > float("-inf"))[..., None]
            if cache.k.device != dev:                # a recall policy's host-resident K, V (Quest, ClusterKV)
                torch.cuda.synchronize(dev)
                live = live.to(cache.k.device)
            finite = torch.isfinite(torch.where(live, cache.k, 0)).all() & torch.isfinite(torch.where(live, cache.v, 0)).all()
            bad[4] = bad[4] | ~finite.to(dev)
    return torch.stack(bad)


def _decode_checked(policy: str, dtype: torch.dtype, new: int, device: str = "cpu") -> None:
    """Prefill 2 rows of 40 tokens at BUDGET, decode ``new`` greedy tokens and check ``CHECKS`` after the prefill
    and after every step (on the device; one host read at the end)."""
    model = _model(dtype, new + 64)
    if device != "cpu":
        model = copy.deepcopy(model).to(device)
    kv = kvpass.apply(model, policy, BUDGET, **SMALL.get(policy, {}))
    ids = torch.randint(1, 128, (2, 40), generator=torch.Generator().manual_seed(1)).to(device)
    session = kv.start(ids, max_new_tokens=new)
    interval = getattr(kv.policy, "interval", 1)
    # a head may hold more than the budget where the policy splits a layer's budget unevenly over heads
    # (adakv: row_extra); the row's heads together never more than Hkv (budget + interval)
    limits = {i: (torch.tensor(lay.row_budgets, device=device),
                  torch.tensor(getattr(lay, "row_extra", None) or [0] * len(lay.row_budgets), device=device))
              for i, lay in enumerate(session.layers) if lay.compressible}
    first = torch.zeros(len(CHECKS), dtype=torch.long, device=device)       # 1 + the first step a check failed
    for step in range(new + 1):
        failed = _violations(session, interval, 40 + step, limits)
        first = torch.where((first == 0) & failed, step + 1, first)
        if step < new:
            session.step(session.logits.argmax(-1))
    failures = {check: f"first at step {at - 1}" for check, at in zip(CHECKS, first.tolist(), strict=True) if at}
    assert not failures, (policy, dtype, failures)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_bounded_and_finite_short(policy):
    _decode_checked(policy, torch.float32, 80)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_bounded_and_finite_4000(policy, dtype):
    _decode_checked(policy, dtype, 4000)


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="fp16 needs a device that computes it (CUDA)")
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_bounded_and_finite_fp16_gpu(policy):
    """``-m slow -k fp16`` on a CUDA machine: every policy, 4,000 steps in fp16, checked on the device every step
    (no per-step host sync, so the steps run at the GPU's pace)."""
    _decode_checked(policy, torch.float16, 4000, device="cuda")
