"""A linear over one row: the decode step's projections at batch 1 (nn.Linear's layout).

    y[m, n] = sum_k x[m, k] W[n, k] (+ bias[n])

Shapes: x [..., K] (any leading dims), weight [N, K] with K contiguous, bias [N] or None -> y [..., N]
in x's dtype, accumulated in fp32 (float64 for float64 inputs).

With ``silu_gate`` x is a gated MLP's fused gate/up output [..., 2K] and the linear reads
silu(x[..., :K]) * x[..., K:] (each rounded to x's dtype, as eager computes it): down_proj takes the
activation in its loads instead of from a separate elementwise launch.

At batch 1 a decode step is weight bytes over bandwidth. cuBLAS runs o_proj and down_proj (N = 4096)
as split-K GEMVs followed by a reduction kernel: two launches, and an fp32 partial buffer written and
read back. Here, when x is one row on CUDA, one Triton launch streams W once with no split-K; more rows
(batch > 1: a real GEMM) and other devices use ``F.linear``. Traffic: N*K weight elements read, N written.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kvpass.kernels._triton import HAS_TRITON, check_device, next_pow2, require_triton, tl, triton


def gemv_reference(x: Tensor, weight: Tensor, bias: Tensor | None = None, silu_gate: bool = False) -> Tensor:
    """``F.linear`` (of the SiLU-gated activation with ``silu_gate``): the definition, and the path for more
    than one row or off CUDA."""
    if silu_gate:
        k = weight.shape[1]
        x = F.silu(x[..., :k]) * x[..., k:]
    return F.linear(x, weight, bias)


# Program p owns rows n in [p BLOCK_N, (p + 1) BLOCK_N) of W:   y_n = sum_k W[n, k] x_k
# It streams its BLOCK_N x K slab in [BLOCK_N, BLOCK_K] tiles, multiplies each elementwise by that chunk of
# x and adds it into an fp32 [BLOCK_N, BLOCK_K] accumulator; the K axis is summed once, after the loop.
# No split-K: each output is complete in one program, so there is no partial buffer and no second launch.
# SILU_GATE: x_k = silu(g_k) u_k with g = X[:K], u = X[K:2K], silu(g) = g / (1 + e^-g), each product rounded to
# X's dtype as eager rounds it.
@triton.jit
def _load_x(X, k, K, mask, ACC: tl.constexpr, SILU_GATE: tl.constexpr):
    """The chunk k of the linear's input, in X's dtype: X[k], or silu(X[k]) X[K + k] with SILU_GATE."""
    if mask is None:
        g = tl.load(X + k)
    else:
        g = tl.load(X + k, mask=mask, other=0.0)
    if SILU_GATE:
        if mask is None:
            u = tl.load(X + K + k)
        else:
            u = tl.load(X + K + k, mask=mask, other=0.0)
        gf = g.to(ACC)
        act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
        g = (act.to(ACC) * u.to(ACC)).to(g.dtype)
    return g


@triton.jit
def _gemv_kernel(X, W, B, Y, N, K, swn, ACC: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN: tl.constexpr,
                 SILU_GATE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    w_rows = W + n[:, None].to(tl.int64) * swn
    acc = tl.zeros([BLOCK_N, BLOCK_K], ACC)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        if EVEN:
            w = tl.load(w_rows + k[None, :], eviction_policy="evict_first")
            x = _load_x(X, k, K, None, ACC, SILU_GATE)
        else:
            w = tl.load(w_rows + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K), other=0.0,
                        eviction_policy="evict_first")
            x = _load_x(X, k, K, k < K, ACC, SILU_GATE)
        acc += w.to(ACC) * x.to(ACC)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(B + n, mask=n < N, other=0.0).to(ACC)
    tl.store(Y + n, y.to(Y.dtype.element_ty), mask=n < N)


# (BLOCK_N, BLOCK_K, num_warps) from an H100 sweep of the Llama-3.1-8B shapes, each call timed back to back
# in a CUDA graph over weights larger than L2 (benchmarks/probes/gemv_sweep.py,
# gemv-sweep-nvidia-h100-80gb-hbm3.json): 4 x 2048 tiles over 4 warps (64 fp32 products per thread and tile,
# 8 x 16 B loads in flight) were the fastest of 24 configs for q/k/v, o, gate/up and down and within 0.5% of
# the best for lm_head; on an H200 (gemv-sweep-nvidia-h200.json) the fastest for every shape. Small K: one tile
# of the next power of two.
def gemv_config(n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for a [N, K] weight."""
    return 4, min(2048, max(64, next_pow2(k))), 4


def gemv_triton(x: Tensor, weight: Tensor, bias: Tensor | None = None, silu_gate: bool = False, *,
                block_n: int | None = None, block_k: int | None = None, num_warps: int | None = None) -> Tensor:
    """One row of x (x.numel() == K, or 2K with ``silu_gate``): y [..., N] from one launch."""
    require_triton()
    n, k = weight.shape
    width = 2 * k if silu_gate else k
    if x.shape[-1] != width or x.numel() != width or weight.stride(1) != 1:
        raise ValueError(f"gemv: x {tuple(x.shape)} must be one row of {width} and weight [N, K] = "
                         f"{tuple(weight.shape)} contiguous along K")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"gemv: bias must be [{n}], got {tuple(bias.shape)}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None:
            check_device(name, t, x.device)
    bn, bk, warps = gemv_config(n, k)
    bn, bk, warps = block_n or bn, block_k or bk, num_warps or warps
    xc = x.reshape(width).contiguous()
    y = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    acc = tl.float64 if x.dtype == torch.float64 else tl.float32
    _gemv_kernel[(triton.cdiv(n, bn),)](
        xc, weight, bias if bias is not None else xc, y, n, k, weight.stride(0), ACC=acc, HAS_BIAS=bias is not None,
        EVEN=n % bn == 0 and k % bk == 0, SILU_GATE=silu_gate, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)
    return y


@torch.library.custom_op("kvpass::gemv", mutates_args=())
def gemv(x: Tensor, weight: Tensor, bias: Tensor | None = None, silu_gate: bool = False) -> Tensor:
    return gemv_reference(x, weight, bias, silu_gate)


@gemv.register_fake
def _(x, weight, bias=None, silu_gate=False):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


if HAS_TRITON:
    @gemv.register_kernel("cuda")
    def _(x, weight, bias=None, silu_gate=False):
        if x.numel() == x.shape[-1] and weight.stride(1) == 1 and x.dtype == weight.dtype:
            return gemv_triton(x, weight, bias, silu_gate)
        return gemv_reference(x, weight, bias, silu_gate)
