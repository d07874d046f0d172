"""Assignment step of ClusterKV's cosine K-means (docs/policies.md §2.4 step 2 and step 3).

For each (b, g) and key i, over the centroids c that are usable:

    cos(i, c) = x_i . mu_c / (max(|x_i|, eps) max(|mu_c|, eps))          (eps = 1e-6, as kmeans.py)
    label_i   = argmax_c cos(i, c)     (ties: the lowest c; 0 when no centroid is usable, as
                                        torch.argmax over a row of -inf)
    label_i   = -1 where key i is not valid (sinks, padding, empty slots, tokens not clustered)

Shapes: x: [B, Hkv, N, D] (any float dtype: the cached keys); centroids: [B, Hkv, K, D] (fp32 in
the policy); valid: [B, Hkv, N] bool or None (all valid); usable: [B, Hkv, K] bool or None (all
usable). Returns labels [B, Hkv, N] int64.
Cost: N*K*D multiply-adds per (b, g); reads x once and the centroids once per block of keys.

Triton path: one program per (b, g, block of BLOCK_N keys) normalises its keys in fp32 and loops
over tiles of BLOCK_K centroids, so at most a [BLOCK_N, BLOCK_K] block of the N x K cosine matrix
exists at a time; a block without a valid key skips the loop. On CUDA the products run on tensor
cores in tf32 when either input is 16-bit (bf16 keys: a near tie may then pick another centroid,
|cos difference| ~1e-3), in exact fp32 otherwise; always exact under the interpreter.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvpass.kernels._triton import HAS_TRITON, check_device, next_pow2, require_triton, tl, triton
from kvpass.kernels.cosine_match import cosine_tile_argmax, unit_rows

_EPS = 1e-6


def _acc(*ts: Tensor) -> torch.dtype:
    """Accumulation dtype: a float64 input gives a float64 reference, anything else float32."""
    return torch.float64 if any(t.dtype == torch.float64 for t in ts) else torch.float32


def cosine_kmeans_assign_reference(x: Tensor, centroids: Tensor, valid: Tensor | None = None,
                                   usable: Tensor | None = None) -> Tensor:
    acc = _acc(x, centroids)
    xn = torch.nn.functional.normalize(x.to(acc), dim=-1, eps=_EPS)              # reads x
    mn = torch.nn.functional.normalize(centroids.to(acc), dim=-1, eps=_EPS)      # reads the centroids
    cos = xn @ mn.transpose(-1, -2)                                              # [B, Hkv, N, K]
    if usable is not None:
        cos = cos.masked_fill(~usable[:, :, None], float("-inf"))
    labels = cos.argmax(-1)                                                      # the first maximum
    return labels if valid is None else labels.masked_fill(~valid, -1)


# --------------------------------------------------------------------------------------- Triton
# Program (b, g, keys i in [i0, i0 + BLOCK_N)): xn_i = x_i / max(|x_i|, eps) (fp32).
# For each tile of BLOCK_K centroids: mn_c = mu_c / max(|mu_c|, eps); s_ic = xn_i . mn_c, -inf unless
# c < K and usable; best_i, label_i = running (max, first argmax); a later tile wins only if strictly
# greater, and label starts at 0, so rows of -inf keep 0 (torch.argmax). Finally label_i = -1 unless valid.

@triton.jit
def _cosine_kmeans_assign_kernel(
    X, MU, VALID, USABLE, LABEL,
    sxb, sxh, sxn, sxd, smb, smh, smk, smd,
    HKV, N, K, eps,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_VALID: tl.constexpr, HAS_USABLE: tl.constexpr, EXACT: tl.constexpr,
):
    pid_bg = tl.program_id(0)
    b = (pid_bg // HKV).to(tl.int64)
    g = pid_bg % HKV
    offs_i = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    i_mask = offs_i < N
    d_mask = offs_d < HEAD_DIM
    row = pid_bg.to(tl.int64)
    if HAS_VALID:
        valid = (tl.load(VALID + row * N + offs_i, mask=i_mask, other=0) != 0) & i_mask
    else:
        valid = i_mask
    k_hi = tl.where(tl.max(valid.to(tl.int32), 0) > 0, K, 0)          # no valid key: nothing to compare
    x = tl.load(X + b * sxb + g * sxh + offs_i[:, None] * sxn + offs_d[None, :] * sxd,
                mask=valid[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
    x = unit_rows(x, eps)
    best = tl.full([BLOCK_N], float("-inf"), tl.float32)
    label = tl.zeros([BLOCK_N], tl.int64)
    for c0 in range(0, k_hi, BLOCK_K):
        offs_c = c0 + tl.arange(0, BLOCK_K)
        c_mask = offs_c < K
        mu = tl.load(MU + b * smb + g * smh + offs_c[:, None] * smk + offs_d[None, :] * smd,
                     mask=c_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
        ok = c_mask
        if HAS_USABLE:
            ok = ok & (tl.load(USABLE + row * K + offs_c, mask=c_mask, other=0) != 0)
        best, label = cosine_tile_argmax(x, mu, ok[None, :], best, label, c0, eps, EXACT)
    label = tl.where(valid, label, -1)
    tl.store(LABEL + row * N + offs_i, label, mask=i_mask)


def check_assign_inputs(x: Tensor, centroids: Tensor, valid: Tensor | None, usable: Tensor | None) -> None:
    """ValueError naming the tensor, the expected and the actual shape/dtype."""
    if x.dim() != 4 or not x.dtype.is_floating_point:
        raise ValueError(f"x must be a float [B, Hkv, N, D], got {x.dtype} {tuple(x.shape)}")
    b, hkv, n, d = x.shape
    if centroids.dim() != 4 or (centroids.shape[0], centroids.shape[1], centroids.shape[3]) != (b, hkv, d) \
            or centroids.shape[2] == 0 or not centroids.dtype.is_floating_point:
        raise ValueError(f"centroids must be float [B={b}, Hkv={hkv}, K >= 1, D={d}], "
                         f"got {centroids.dtype} {tuple(centroids.shape)}")
    for name, m, shape in (("valid", valid, (b, hkv, n)), ("usable", usable, tuple(centroids.shape[:3]))):
        if m is not None and (tuple(m.shape) != shape or m.dtype != torch.bool):
            raise ValueError(f"{name} must be bool {list(shape)}, got {m.dtype} {tuple(m.shape)}")
    for name, t in (("x", x), ("centroids", centroids), ("valid", valid), ("usable", usable)):
        if t is not None:
            check_device(name, t, x.device)


def cosine_kmeans_assign_triton(x: Tensor, centroids: Tensor, valid: Tensor | None = None,
                                usable: Tensor | None = None, *, block_n: int = 64, block_k: int = 64,
                                num_warps: int = 4) -> Tensor:
    """The Triton assignment (same contract as ``cosine_kmeans_assign_reference``)."""
    require_triton()
    check_assign_inputs(x, centroids, valid, usable)
    b, hkv, n, d = x.shape
    k = centroids.shape[2]
    labels = torch.empty(b, hkv, n, device=x.device, dtype=torch.int64)
    if n == 0:
        return labels
    dummy = labels
    vm = valid.contiguous().view(torch.int8) if valid is not None else dummy
    um = usable.contiguous().view(torch.int8) if usable is not None else dummy
    exact = x.device.type != "cuda" or (x.element_size() >= 4 and centroids.element_size() >= 4)
    _cosine_kmeans_assign_kernel[(b * hkv, triton.cdiv(n, block_n))](
        x, centroids, vm, um, labels, *x.stride(), *centroids.stride(), hkv, n, k, _EPS,
        HEAD_DIM=d, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_D=max(16, next_pow2(d)),
        HAS_VALID=valid is not None, HAS_USABLE=usable is not None, EXACT=exact, num_warps=num_warps)
    return labels


@torch.library.custom_op("kvpass::cosine_kmeans_assign", mutates_args=())
def cosine_kmeans_assign(x: Tensor, centroids: Tensor, valid: Tensor | None = None,
                         usable: Tensor | None = None) -> Tensor:
    return cosine_kmeans_assign_reference(x, centroids, valid, usable)


@cosine_kmeans_assign.register_fake
def _(x, centroids, valid=None, usable=None):
    return x.new_empty(x.shape[:3], dtype=torch.int64)


if HAS_TRITON:
    @cosine_kmeans_assign.register_kernel("cuda")
    def _(x, centroids, valid=None, usable=None):
        return cosine_kmeans_assign_triton(x, centroids, valid, usable)
