"""Deferred scores: the decode steps' queries kept by ``write_query`` and their rows summed at once by
``recent_query_column_sums`` give what the steps' own ``decode_attention(want_scores=True)`` rows add up to
(float64, rows of different lengths, merged entries, a ring that wraps and one that is not full); the Triton
kernels compute the reference's values."""

from __future__ import annotations

import pytest
import torch

from kvpass.kernels.decode_attention import decode_attention_reference
from kvpass.kernels.recent_query_column_sums import (
    recent_query_column_sums_reference,
    recent_query_column_sums_triton,
)
from kvpass.kernels.write_kv import write_kv_reference
from kvpass.kernels.write_query import write_query_reference, write_query_triton

SCALE = 0.3


def _cache(b: int, hkv: int, c: int, d: int, lengths: list[int], gen: torch.Generator, dtype=torch.float64):
    """Live slots [0, length) per row (the same for every head), positions ascending with gaps, some merged
    entries (log-weight log N), empty slots after."""
    k = torch.randn(b, hkv, c, d, generator=gen, dtype=dtype)
    v = torch.randn(b, hkv, c, d, generator=gen, dtype=dtype)
    log_weight = torch.full((b, hkv, c), float("-inf"), dtype=torch.float32)
    position = torch.full((b, hkv, c), -1, dtype=torch.long)
    for row, n in enumerate(lengths):
        gaps = torch.randint(1, 4, (hkv, n), generator=gen)
        position[row, :, :n] = gaps.cumsum(-1)
        log_weight[row, :, :n] = torch.log(torch.randint(1, 4, (hkv, n), generator=gen).float())
    length = torch.tensor(lengths)[:, None].expand(b, hkv).clone()
    return k, v, log_weight, length, position


@pytest.mark.parametrize("ring, steps, softcap", [(4, 4, None), (6, 4, None), (5, 5, 2.0)])
def test_deferred_rows_equal_the_steps_rows(ring, steps, softcap):
    """m steps of write_kv + decode attention (scores accumulated per step) against the same steps' queries
    kept in a ring and summed at the end; row 1 starts shorter and further on (its ring slots wrap)."""
    gen = torch.Generator().manual_seed(ring * 10 + steps)
    b, hkv, g, d, c = 2, 2, 3, 8, 16
    k, v, log_weight, length, position = _cache(b, hkv, c, d, [9, 5], gen)
    start = position.amax(dim=(1, 2)) + 1                       # [B]: the first step's position per row
    start[1] += ring - 2                                        # row 1's ring index wraps
    per_step = torch.zeros(b, hkv, c, dtype=torch.float64)
    recent_q = torch.zeros(b, hkv * g, ring, d, dtype=torch.float64)
    recent_pos = torch.full((b, ring), -1, dtype=torch.long)
    for t in range(steps):
        pos = (start + t)[:, None]
        q = torch.randn(b, hkv * g, 1, d, generator=gen, dtype=torch.float64)
        k_new, v_new = (torch.randn(b, hkv, 1, d, generator=gen, dtype=torch.float64) for _ in range(2))
        write_kv_reference(k, v, log_weight, length.clone(), position, pos, k_new, v_new)
        length += 1
        _, scores = decode_attention_reference(q, k, v, log_weight, SCALE, softcap, want_scores=True)
        per_step += scores
        write_query_reference(recent_q, recent_pos, pos, q)
    assert int((recent_pos >= 0).sum()) == b * steps
    deferred = recent_query_column_sums_reference(recent_q, recent_pos, k, log_weight, position, SCALE, softcap)
    torch.testing.assert_close(deferred, per_step, rtol=1e-12, atol=1e-12)
    assert float(per_step.sum()) == pytest.approx(b * hkv * steps)      # each step's row sums to one per head


def _random_inputs(b, hq, hkv, m, c, d, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    k, _, log_weight, _, position = _cache(b, hkv, c, d, [c - 3 - 2 * i for i in range(b)], gen, torch.float32)
    q = torch.randn(b, hq, m, d, generator=gen)
    top = position.amax(dim=(1, 2))
    q_position = (top[:, None] - torch.randint(0, 6, (b, m), generator=gen)).clamp(min=0)
    q_position[0, 0] = -1                                       # an empty ring slot
    return q.to(dtype), q_position, k.to(dtype), log_weight, position


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("b, hq, hkv, m, c, d", [(2, 4, 2, 5, 37, 16), (1, 6, 2, 3, 20, 24), (3, 2, 2, 8, 64, 32)])
def test_triton_equals_the_reference(b, hq, hkv, m, c, d, dtype, tol, triton_device):
    q, q_position, k, log_weight, position = _random_inputs(b, hq, hkv, m, c, d, dtype, seed=b + c)
    want = recent_query_column_sums_reference(q.double(), q_position, k.double(), log_weight, position, SCALE)
    on = [t.to(triton_device) for t in (q, q_position, k, log_weight, position)]
    got = recent_query_column_sums_triton(*on, SCALE).cpu()
    assert got.dtype == torch.float32 and got.shape == (b, hkv, c)
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    assert torch.all(got[log_weight == float("-inf")] == 0)     # empty slots get nothing


@pytest.mark.parametrize("splits", [2, 3, 9])
def test_triton_in_splits_of_the_slots_equals_the_reference(splits, triton_device):
    """The log-sum-exp pass in parts of the slots (some parts past a short row's live slots, some rows with no
    slot in a part), combined: the same sums."""
    q, q_position, k, log_weight, position = _random_inputs(2, 4, 2, 5, 70, 16, torch.float32, seed=splits)
    want = recent_query_column_sums_reference(q.double(), q_position, k.double(), log_weight, position, SCALE)
    on = [t.to(triton_device) for t in (q, q_position, k, log_weight, position)]
    got = recent_query_column_sums_triton(*on, SCALE, splits=splits).cpu()
    torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-5)
    assert torch.all(got[log_weight == float("-inf")] == 0)


def test_triton_of_an_empty_ring_is_zero(triton_device):
    q, q_position, k, log_weight, position = _random_inputs(2, 4, 2, 4, 24, 16, torch.float32, seed=3)
    q_position.fill_(-1)
    on = [t.to(triton_device) for t in (q, q_position, k, log_weight, position)]
    assert torch.count_nonzero(recent_query_column_sums_triton(*on, SCALE)) == 0
    assert torch.count_nonzero(recent_query_column_sums_reference(q, q_position, k, log_weight, position, SCALE)) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_query_triton_writes_what_the_reference_writes(dtype, triton_device):
    gen = torch.Generator().manual_seed(5)
    b, hq, m, d = 3, 4, 5, 24
    ring = torch.randn(b, hq, m, d, generator=gen).to(dtype)
    ring_pos = torch.randint(-1, 50, (b, m), generator=gen)
    pos = torch.tensor([[7], [12], [0]])
    q = torch.randn(b, 1, hq, d, generator=gen).to(dtype).transpose(1, 2)      # strided as the graph's
    want = [ring.clone(), ring_pos.clone()]
    write_query_reference(*want, pos, q)
    got = [t.to(triton_device, copy=True) for t in (ring, ring_pos)]
    write_query_triton(*got, pos.to(triton_device), q.to(triton_device))
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])
    assert want[1][:, [2, 2, 0]].diagonal().tolist() == [7, 12, 0]              # pos mod m
    assert torch.equal(want[0][torch.arange(b), :, torch.tensor([2, 2, 0])], q[:, :, 0])
