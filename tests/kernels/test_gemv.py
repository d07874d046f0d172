"""gemv: the one-launch Triton GEMV equals the float64 definition on fresh random inputs (ragged N and K,
with and without a bias, fp32 / bf16 / float64), the CUDA op takes the kernel for one row and F.linear for
more, and bad layouts are refused."""

from __future__ import annotations

import importlib

import pytest
import torch

from kvpass.kernels.gemv import gemv_reference, gemv_triton

# output tolerance per dtype: the kernel accumulates in fp32 (float64 for float64), then rounds once
TOL = {torch.float64: dict(rtol=1e-12, atol=1e-12), torch.float32: dict(rtol=1e-5, atol=1e-5),
       torch.bfloat16: dict(rtol=2 ** -7, atol=2 ** -7)}


def _inputs(n: int, k: int, dtype: torch.dtype, bias: bool, seed: int, lead: tuple[int, ...] = (1, 1)):
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=gen, dtype=torch.float64) * k ** -0.5).to(dtype)
    x = torch.randn(*lead, k, generator=gen, dtype=torch.float64).to(dtype)
    b = torch.randn(n, generator=gen, dtype=torch.float64).to(dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k, bias", [(40, 96, True), (64, 128, False), (33, 70, True), (8, 2048, False)])
def test_triton_matches_the_float64_definition(n, k, bias, dtype, triton_device):
    x, w, b = _inputs(n, k, dtype, bias, seed=n * 1000 + k)
    want = gemv_reference(x.double(), w.double(), None if b is None else b.double())
    dev = [t.to(triton_device) if t is not None else None for t in (x, w, b)]
    got = gemv_triton(*dev)
    assert got.shape == (1, 1, n) and got.dtype == dtype
    torch.testing.assert_close(got.cpu().double(), want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("n, k, bias", [(40, 96, True), (16, 2048, False)])
def test_triton_silu_gate_matches_the_definition(n, k, bias, dtype, triton_device):
    """y = W (silu(x[:K]) * x[K:]): the activation as eager computes it, the linear in float64. (bf16 only on
    CUDA, below: the interpreter truncates fp32 -> bf16 where the GPU rounds to nearest.)"""
    gen = torch.Generator().manual_seed(n + k)
    x = (2 * torch.randn(1, 1, 2 * k, generator=gen, dtype=torch.float64)).to(dtype)
    _, w, b = _inputs(n, k, dtype, bias, seed=k)
    act = torch.nn.functional.silu(x[..., :k]) * x[..., k:]
    want = gemv_reference(act.double(), w.double(), None if b is None else b.double())
    dev = [t.to(triton_device) if t is not None else None for t in (x, w, b)]
    got = gemv_triton(*dev, silu_gate=True)
    assert got.shape == (1, 1, n)
    torch.testing.assert_close(got.cpu().double(), want, **TOL[dtype])
    torch.testing.assert_close(gemv_reference(x, w, b, silu_gate=True).double(), want, **TOL[dtype])


def test_triton_blocks_smaller_than_the_problem_cover_it(triton_device):
    """Several row blocks and several K tiles, neither dividing the shape."""
    x, w, b = _inputs(37, 200, torch.float32, True, seed=3, lead=(1,))
    got = gemv_triton(x.to(triton_device), w.to(triton_device), b.to(triton_device), block_n=8, block_k=64, num_warps=4)
    torch.testing.assert_close(got.cpu().double(), gemv_reference(x.double(), w.double(), b.double()),
                               **TOL[torch.float32])


def test_triton_refuses_more_rows_and_strided_weights(triton_device):
    x, w, _ = _inputs(16, 32, torch.float32, False, seed=0, lead=(2,))
    with pytest.raises(ValueError, match="one row"):
        gemv_triton(x.to(triton_device), w.to(triton_device))
    with pytest.raises(ValueError, match="contiguous along K"):
        gemv_triton(x[:1].to(triton_device), w.to(triton_device).t().contiguous().t())
    with pytest.raises(ValueError, match="one row of 64"):                  # silu_gate: x holds 2K
        gemv_triton(x[:1].to(triton_device), w.to(triton_device), silu_gate=True)
    with pytest.raises(ValueError, match="bias"):
        gemv_triton(x[:1].to(triton_device), w.to(triton_device), torch.zeros(3, device=triton_device))


def test_op_is_f_linear_off_cuda():
    x, w, b = _inputs(24, 40, torch.float32, True, seed=5, lead=(3, 1))
    assert torch.equal(torch.ops.kvpass.gemv(x, w, b), torch.nn.functional.linear(x, w, b))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n, k", [(4096, 14336), (6144, 4096), (128256, 4096)])
def test_cuda_op_takes_the_kernel_for_one_row_at_real_shapes(n, k, monkeypatch):
    module = importlib.import_module("kvpass.kernels.gemv")
    calls = []
    kernel = module.gemv_triton
    monkeypatch.setattr(module, "gemv_triton", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    x, w, _ = (t.cuda() if t is not None else None for t in _inputs(n, k, torch.bfloat16, False, seed=7))
    got = torch.ops.kvpass.gemv(x, w)
    assert calls == [1]
    torch.testing.assert_close(got.double(), gemv_reference(x.double(), w.double()), **TOL[torch.bfloat16])
    rows = torch.cat([x, x], dim=1)                                  # two rows: cuBLAS, not the kernel
    torch.testing.assert_close(torch.ops.kvpass.gemv(rows, w), torch.nn.functional.linear(rows, w))
    assert calls == [1]
    gu = torch.randn(1, 1, 2 * k, device="cuda", dtype=torch.bfloat16)  # the SiLU-gated form (down_proj)
    act = torch.nn.functional.silu(gu[..., :k]) * gu[..., k:]
    torch.testing.assert_close(torch.ops.kvpass.gemv(gu, w, None, True).double(),
                               gemv_reference(act.double(), w.double()), **TOL[torch.bfloat16])
    assert calls == [1, 1]
