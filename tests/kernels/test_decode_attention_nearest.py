"""The fused nearest-key search of ``decode_attention_nearest`` against its reference, on fresh random inputs:
(o, scores) equal the plain decode attention's (bit for bit from the same launch), and each candidate's nearest
live key (slot exactly where the top two cosines are apart, the cosine to fp32 rounding)."""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from kvpass.kernels.decode_attention import decode_attention_triton
from kvpass.kernels.decode_attention_nearest import (
    decode_attention_nearest_reference,
    decode_attention_nearest_triton,
    nearest_of_candidates_reference,
)
from tests.kernels.test_decode_attention import random_case

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
# the module, not the op of the same name that kvpass.kernels exports
nearest_module = importlib.import_module("kvpass.kernels.decode_attention_nearest")


@pytest.fixture(autouse=True)
def fuse_at_every_batch(monkeypatch):
    monkeypatch.setattr(nearest_module, "FUSE_FROM_BATCH", 1)


def inverse_norms(k: torch.Tensor) -> torch.Tensor:
    return (1 / k.double().norm(dim=-1).clamp(min=1e-12)).float()


def random_candidates(lw: torch.Tensor, m: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, Hkv, M] candidate slots (live ones, some rows with -1 entries) and [B, Hkv] first target slots."""
    gen = torch.Generator().manual_seed(seed)
    b, h, c = lw.shape
    live = (lw > float("-inf")).sum(-1)                                   # live slots are a prefix
    cand = (torch.rand(b, h, m, generator=gen) * live[..., None]).long()
    cand[0, 0, -1] = -1                                                   # a missing candidate
    return cand, torch.randint(0, 3, (b, h), generator=gen)


def assert_nearest(got_best, got_slot, k, lw, cand, target_from) -> None:
    want_best, want_slot = nearest_of_candidates_reference(k.double(), lw, cand, target_from)
    torch.testing.assert_close(got_best.cpu(), want_best, rtol=0, atol=2e-6)
    # the slot must be exact unless another key's cosine is within rounding of the best
    sim_best = want_best.double()
    j = torch.arange(k.shape[2])
    x = torch.nn.functional.normalize(k.double().gather(2, cand.clamp(min=0)[..., None].expand(-1, -1, -1, k.shape[3])), dim=-1)
    y = torch.nn.functional.normalize(k.double(), dim=-1)
    sim = (x @ y.transpose(-1, -2)).masked_fill(
        ~((cand >= 0)[..., None] & (lw > float("-inf"))[:, :, None] & (j != cand[..., None])
          & (j >= target_from[..., None, None])), float("-inf"))
    second = sim.scatter(-1, want_slot[..., None], float("-inf")).amax(-1)
    clear = (sim_best - second) > 1e-5
    assert torch.equal(got_slot.cpu()[clear], want_slot[clear])
    assert clear.float().mean() > 0.5, "the case left too few clear maxima to check slots"


@pytest.mark.parametrize("hq, hkv", [(8, 2), (4, 4)])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nearest_matches_reference(hq, hkv, num_splits, dtype, triton_device):
    q, k, v, lw = random_case(2, hq, hkv, 1, 70, 16, seed=hq + num_splits, dtype=dtype)
    cand, target_from = random_candidates(lw, 4, seed=hq)
    dev = torch.device(triton_device)
    outs = [torch.empty(2, hkv, 4, dtype=torch.long, device=dev), torch.empty(2, hkv, 4, device=dev),
            torch.empty(2, hkv, 4, dtype=torch.long, device=dev)]
    scale = 1 / math.sqrt(16)
    got_o, got_s = decode_attention_nearest_triton(q.to(dev), k.to(dev), v.to(dev), lw.to(dev), cand.to(dev),
                                                   target_from.to(dev), inverse_norms(k).to(dev), *outs, scale,
                                                   None, True, num_splits=num_splits, block_n=16)
    plain_o, plain_s = decode_attention_triton(q.to(dev), k.to(dev), v.to(dev), lw.to(dev), scale, None, True,
                                               num_splits=num_splits, block_n=16)
    assert torch.equal(got_o, plain_o) and torch.equal(got_s, plain_s)     # the spare rows change nothing
    assert torch.equal(outs[0].cpu(), cand)
    assert_nearest(outs[1], outs[2], k, lw, cand, target_from)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_slots_of_unknown_norm_are_left_out(num_splits, triton_device):
    """A NaN inverse norm (the newest entry's, written by this step) leaves that slot out of the search: the
    result is the reference's over the other slots, here where the left-out slot is every candidate's nearest."""
    q, k, v, lw = random_case(2, 8, 2, 1, 70, 16, seed=21)
    lw[..., :40] = 0.0                                                    # slots 0-39 live in every row
    cand, target_from = random_candidates(lw[..., :30], 4, seed=22)
    out = 35
    k[:, :, out] = k.gather(2, cand[..., :1, None].clamp(min=0).expand(-1, -1, 1, 16))[:, :, 0] + 1e-3
    inv = inverse_norms(k)
    inv[:, :, out] = float("nan")
    dev = torch.device(triton_device)
    outs = [torch.empty(2, 2, 4, dtype=torch.long, device=dev), torch.empty(2, 2, 4, device=dev),
            torch.empty(2, 2, 4, dtype=torch.long, device=dev)]
    decode_attention_nearest_triton(q.to(dev), k.to(dev), v.to(dev), lw.to(dev), cand.to(dev), target_from.to(dev),
                                    inv.to(dev), *outs, 0.25, None, False, num_splits=num_splits, block_n=16)
    _, with_it = nearest_of_candidates_reference(k, lw, cand, target_from)
    assert (with_it[..., 0][cand[..., 0] >= 0] == out).all()             # the left-out slot would have won
    without = lw.clone()
    without[:, :, out] = float("-inf")
    assert_nearest(outs[1], outs[2], k, without, cand, target_from)


def test_reference_op_writes_its_outputs():
    q, k, v, lw = random_case(1, 4, 2, 1, 20, 8, seed=3)
    cand, target_from = random_candidates(lw, 2, seed=4)
    outs = [torch.empty(1, 2, 2, dtype=torch.long), torch.empty(1, 2, 2), torch.empty(1, 2, 2, dtype=torch.long)]
    o, _ = torch.ops.kvpass.decode_attention_nearest(q, k, v, lw, cand, target_from, inverse_norms(k), *outs, 0.3)
    best, slot = nearest_of_candidates_reference(k, lw, cand, target_from)
    assert torch.equal(outs[0], cand) and torch.equal(outs[1], best) and torch.equal(outs[2], slot)
    assert (slot[cand < 0] == 0).all() and (best[cand < 0] == float("-inf")).all()
    want_o, _ = decode_attention_nearest_reference(q, k, v, lw, cand, target_from, inverse_norms(k),
                                                   *[t.clone() for t in outs], 0.3)
    assert torch.equal(o, want_o)
    none = torch.full_like(cand, -1)                                       # no candidates: the search is skipped
    o, _ = torch.ops.kvpass.decode_attention_nearest(q, k, v, lw, none, target_from, inverse_norms(k), *outs, 0.3)
    assert (outs[0] == -1).all() and (outs[1] == float("-inf")).all() and (outs[2] == 0).all()
    assert torch.equal(o, want_o)


def test_bad_candidate_shapes_are_refused():
    q, k, v, lw = random_case(1, 4, 2, 1, 20, 8, seed=3)
    good = [torch.zeros(1, 2, 4, dtype=torch.long), torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, 20),
            torch.zeros(1, 2, 4, dtype=torch.long), torch.zeros(1, 2, 4), torch.zeros(1, 2, 4, dtype=torch.long)]
    with pytest.raises(ValueError, match="near_best must be"):
        decode_attention_nearest_triton(q, k, v, lw, *good[:4], torch.zeros(1, 2, 4, dtype=torch.float64), good[5], 0.3)
    with pytest.raises(ValueError, match="inv_norm must be"):
        decode_attention_nearest_triton(q, k, v, lw, *good[:2], torch.zeros(1, 2, 19), *good[3:], 0.3)
    three = [torch.zeros(1, 2, 3, dtype=torch.long), good[1], good[2], torch.zeros(1, 2, 3, dtype=torch.long),
             torch.zeros(1, 2, 3), torch.zeros(1, 2, 3, dtype=torch.long)]
    with pytest.raises(ValueError, match="power of 2"):
        decode_attention_nearest_triton(q, k, v, lw, *three, 0.3)
