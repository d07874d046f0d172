from __future__ import annotations

import pytest
import torch

from kvpass.kernels.cosine_match import cosine_match, cosine_match_reference, cosine_match_triton

# the interpreter evaluates both sides of tl.where: log2(0) / 0-division warnings in masked lanes
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _case(b, hkv, s, n, d, seed, dtype=torch.float32, valid_frac=0.7):
    gen = torch.Generator().manual_seed(seed)
    src = torch.randn(b, hkv, s, d, generator=gen).to(dtype)
    dst = torch.randn(b, hkv, n, d, generator=gen).to(dtype)
    valid = torch.rand(b, hkv, n, generator=gen) < valid_frac
    return src, dst, valid


def _check(got, want, src, dst, tol):
    """Index and best agree with the float64 reference; where the indices differ (a near tie), the
    picked candidate's exact similarity must be within tol of the best."""
    gi, gb = (x.cpu() for x in got)
    wi, wb = want
    assert torch.equal(gi == -1, wi == -1)
    torch.testing.assert_close(gb.double(), wb.double(), rtol=0, atol=tol)
    x = torch.nn.functional.normalize(src.double(), dim=-1)
    y = torch.nn.functional.normalize(dst.double(), dim=-1)
    sim = x @ y.transpose(-1, -2)
    picked = torch.gather(sim, -1, gi.clamp(min=0)[..., None])[..., 0]
    has = wi >= 0
    assert ((picked - wb.double()).abs()[has] <= tol).all()
    assert (gi == wi).float().mean() > 0.95


@pytest.mark.parametrize("s, n, chunks", [(7, 13, (0, 0)), (40, 37, (0, 0)), (33, 30, (5, 4)), (16, 16, (4, 4))])
@pytest.mark.parametrize("with_valid", [False, True])
def test_cosine_match_matches_reference(s, n, chunks, with_valid, triton_device):
    src, dst, valid = _case(2, 2, s, n, 24, seed=s * 31 + n)
    valid = valid if with_valid else None
    want = cosine_match_reference(src.double(), dst.double(), valid, *chunks)
    dev = torch.device(triton_device)
    got = cosine_match_triton(src.to(dev), dst.to(dev), None if valid is None else valid.to(dev), *chunks,
                              block_s=16, block_n=16)
    _check(got, want, src, dst, 1e-5)


@pytest.mark.parametrize("n_splits", [1, 3])
@pytest.mark.parametrize("norm_here", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cosine_match_norms_and_candidate_splits(n_splits, norm_here, dtype, triton_device):
    """The candidates' norms computed from the loaded tiles (D2O's decode-time evictions) or by a pass before
    the kernel, the candidates in one program or split among 3 (then the first maximum over the splits): all
    match the reference, zero-norm candidates included, and a candidate repeated in a later split (an exact
    tie) loses to its first copy."""
    src, dst, valid = _case(2, 3, 16, 45, 32, seed=11 + norm_here, dtype=dtype)
    dst[0, 1, 5] = 0.0                                                   # |y| = 0: eps in the denominator
    src[1, 2, 7] = 0.0                                                   # source 7 = e_0; e_0 twice among the
    src[1, 2, 7, 0] = 1.0                                                # candidates, in splits 0 and 2: cosine
    dst[1, 2, [3, 40]] = 0.0                                             # exactly 1 at both (every sum is exact)
    dst[1, 2, [3, 40], 0] = 2.0
    valid[1, 2, [3, 40]] = True
    want = cosine_match_reference(src.double(), dst.double(), valid)
    assert want[0][1, 2, 7] == 3
    dev = torch.device(triton_device)
    got = cosine_match_triton(src.to(dev), dst.to(dev), valid.to(dev), block_n=16, norm_here=norm_here,
                              n_splits=n_splits)
    _check(got, want, src, dst, 1e-5 if dtype == torch.float32 else 1e-2)
    assert got[0][1, 2, 7] == 3


@pytest.mark.parametrize("chunks", [(0, 0), (2, 2)])
def test_cosine_match_of_no_candidates_at_all(chunks, triton_device):
    """A cache of N = 0 candidates: index -1 and best -inf for every source (one empty split, not a division
    by a zero split length)."""
    dev = torch.device(triton_device)
    src, dst = torch.randn(1, 2, 3, 16).to(dev), torch.randn(1, 2, 0, 16).to(dev)
    index, best = cosine_match_triton(src, dst, None, *chunks)
    assert (index.cpu() == -1).all() and (best.cpu() == float("-inf")).all()


def test_cosine_match_bf16_and_no_candidates(triton_device):
    src, dst, valid = _case(1, 2, 20, 9, 16, seed=3, dtype=torch.bfloat16)
    valid[0, 1] = False                                                  # a head with no valid candidate
    want = cosine_match_reference(src.double(), dst.double(), valid)
    dev = torch.device(triton_device)
    got = cosine_match_triton(src.to(dev), dst.to(dev), valid.to(dev), block_s=16, block_n=16)
    assert (got[0].cpu()[0, 1] == -1).all() and (got[1].cpu()[0, 1] == float("-inf")).all()
    _check(got, want, src, dst, 1e-5)          # the stored bf16 values multiplied exactly, summed in fp32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("chunks", [(0, 0), (16, 16)])
def test_cuda_matches_float64_at_real_shapes(chunks):
    """The tensor-core path (bf16 products, fp32 sums, norms applied after) against float64 at D2O's shape
    for a 4k prompt (evicted 3277 x kept 819, Hkv 8, D 128) and with Chelsea's chunks."""
    src, dst, valid = _case(1, 8, 3277, 819, 128, seed=11, dtype=torch.bfloat16, valid_frac=0.99)
    if chunks[0]:
        src, dst, valid = src[:, :, :3264], dst[:, :, :3264], None
    want = cosine_match_reference(src.double(), dst.double(), valid, *chunks)
    got = torch.ops.kvpass.cosine_match(src.cuda(), dst.cuda(), None if valid is None else valid.cuda(), *chunks)
    _check(got, want, src, dst, 1e-5)


def test_reference_hand_case_and_op():
    src = torch.tensor([[[[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]]])
    dst = torch.tensor([[[[0.0, 2.0], [3.0, 0.1], [3.0, 0.1]]]])                 # a tie: lowest index wins
    index, best = cosine_match(src, dst)
    assert index.flatten().tolist() == [1, 0, 1]
    assert best[0, 0, 1].item() == pytest.approx(1.0)
    index, _ = cosine_match(src, dst, None, 1, 1)                                  # chunks of one: i <-> j = i
    assert index.flatten().tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="both"):
        cosine_match_triton(src, dst, None, 2, 0)
