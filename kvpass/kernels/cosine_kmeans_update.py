"""Centroid update step of ClusterKV's cosine K-means (docs/policies.md §2.4 step 2).

For each (b, g) and cluster c with members I_c = {i : labels[i] = c} (labels = -1: no cluster):

    size_c = |I_c|
    mu'_c  = (1 / size_c) sum_{i in I_c} x_i      (the mean of the raw, unnormalised member keys [PAPER])
    mu'_c  = mu_c                                  when size_c = 0 (an empty cluster keeps its centroid [OURS])

The assignment step is by cosine (``kvpass::cosine_kmeans_assign``), which ignores |mu|; the raw mean
keeps the centroid's norm for ClusterKV's selection score q . mu (§2.6 step 3).

Shapes: x: [B, Hkv, N, D] (any float dtype); labels: [B, Hkv, N] int64 in [-1, K) (a label >= K is a
precondition violation, not checked: it would synchronise); centroids: [B, Hkv, K, D] (fp32 in the
policy). Returns centroids' [B, Hkv, K, D] (dtype of centroids, accumulated in fp32, float64 for
float64 inputs) and sizes [B, Hkv, K] int64.
Traffic: reads x once (members only) and the centroids; writes the centroids and sizes.

Triton path: a stable sort of the labels (torch) lays every cluster's members out as one contiguous
segment of the sorted order, found by ``searchsorted``; one program per (b, g, cluster, block of D)
walks its own segment in blocks of BLOCK_M gathered rows and reduces them in registers. No atomics and
no scatter: every output row is written by exactly one program, so the result is deterministic.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvpass.kernels._triton import HAS_TRITON, check_device, next_pow2, require_triton, tl, triton


def _acc(*ts: Tensor) -> torch.dtype:
    """Accumulation dtype: a float64 input gives a float64 reference, anything else float32."""
    return torch.float64 if any(t.dtype == torch.float64 for t in ts) else torch.float32


def cosine_kmeans_update_reference(x: Tensor, labels: Tensor, centroids: Tensor) -> tuple[Tensor, Tensor]:
    acc = _acc(x, centroids)
    b, hkv, k, d = centroids.shape
    idx = labels.clamp(min=0)
    w = (labels >= 0).to(acc)                                                    # non-members add 0
    sums = torch.zeros(b, hkv, k, d, dtype=acc, device=x.device).scatter_add_(
        2, idx[..., None].expand(-1, -1, -1, d), x.to(acc) * w[..., None])        # reads x
    counts = torch.zeros(b, hkv, k, dtype=acc, device=x.device).scatter_add_(2, idx, w)
    new = torch.where(counts[..., None] > 0, sums / counts.clamp(min=1)[..., None], centroids.to(acc))
    return new.to(centroids.dtype), counts.long()


# --------------------------------------------------------------------------------------- Triton
# Program (b, g, cluster c, block of D). order: the keys sorted by label (stable; non-members, key K,
# last), so the members of c are order[lo[c]:hi[c]].
#     acc_c = sum_{m in [lo_c, hi_c)} x_{order[m]}  (blocks of BLOCK_M rows, fp32)
#     size_c = hi_c - lo_c;   mu'_c = acc_c / size_c  (mu_c if size_c = 0)

@triton.jit
def _cosine_kmeans_update_kernel(
    X, MU, ORDER, LO, HI, MUO, SIZE,
    sxb, sxh, sxn, sxd, smb, smh, smk, smd,
    HKV, N, K,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_bg = tl.program_id(0)
    c = tl.program_id(1)
    b = (pid_bg // HKV).to(tl.int64)
    g = pid_bg % HKV
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    row = pid_bg.to(tl.int64)
    lo = tl.load(LO + row * K + c)
    hi = tl.load(HI + row * K + c)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for m0 in range(lo, hi, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        m_mask = offs_m < hi
        src = tl.load(ORDER + row * N + offs_m, mask=m_mask, other=0)
        xs = tl.load(X + b * sxb + g * sxh + src[:, None] * sxn + offs_d[None, :] * sxd,
                     mask=m_mask[:, None] & d_mask[None, :], other=0.0)
        acc += tl.sum(xs.to(tl.float32), 0)
    size = hi - lo
    mu_off = b * smb + g * smh + c * smk + offs_d * smd
    mu = tl.load(MU + mu_off, mask=d_mask, other=0.0).to(tl.float32)
    out = tl.where(size > 0, acc / tl.maximum(size, 1).to(tl.float32), mu)
    tl.store(MUO + row * K * HEAD_DIM + c * HEAD_DIM + offs_d, out.to(MUO.dtype.element_ty), mask=d_mask)
    if tl.program_id(2) == 0:
        tl.store(SIZE + row * K + c, size.to(tl.int64))


def check_update_inputs(x: Tensor, labels: Tensor, centroids: Tensor) -> None:
    """ValueError naming the tensor, the expected and the actual shape/dtype."""
    if x.dim() != 4 or not x.dtype.is_floating_point:
        raise ValueError(f"x must be a float [B, Hkv, N, D], got {x.dtype} {tuple(x.shape)}")
    b, hkv, n, d = x.shape
    if tuple(labels.shape) != (b, hkv, n) or labels.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"labels must be int32/int64 [{b}, {hkv}, {n}], got {labels.dtype} {tuple(labels.shape)}")
    if centroids.dim() != 4 or (centroids.shape[0], centroids.shape[1], centroids.shape[3]) != (b, hkv, d) \
            or not centroids.dtype.is_floating_point:
        raise ValueError(f"centroids must be float [B={b}, Hkv={hkv}, K, D={d}], "
                         f"got {centroids.dtype} {tuple(centroids.shape)}")
    for name, t in (("x", x), ("labels", labels), ("centroids", centroids)):
        check_device(name, t, x.device)


def cosine_kmeans_update_triton(x: Tensor, labels: Tensor, centroids: Tensor, *, block_m: int = 32,
                                num_warps: int = 4) -> tuple[Tensor, Tensor]:
    """The Triton update (same contract as ``cosine_kmeans_update_reference``); each program walks only
    its own cluster's members."""
    require_triton()
    check_update_inputs(x, labels, centroids)
    b, hkv, n, d = x.shape
    k = centroids.shape[2]
    new = torch.empty(b, hkv, k, d, device=x.device, dtype=centroids.dtype)
    sizes = torch.empty(b, hkv, k, device=x.device, dtype=torch.int64)
    if k == 0:
        return new, sizes
    key = torch.where(labels < 0, k, labels.long())                           # non-members sort last
    sorted_key, order = torch.sort(key, dim=-1, stable=True)
    clusters = torch.arange(k, device=x.device).expand(b, hkv, k).contiguous()
    lo = torch.searchsorted(sorted_key, clusters, right=False)
    hi = torch.searchsorted(sorted_key, clusters, right=True)
    block_d = min(128, max(16, next_pow2(d)))
    grid = (b * hkv, k, triton.cdiv(d, block_d))
    _cosine_kmeans_update_kernel[grid](
        x, centroids, order.contiguous(), lo, hi, new, sizes, *x.stride(), *centroids.stride(), hkv, n, k,
        HEAD_DIM=d, BLOCK_M=block_m, BLOCK_D=block_d, num_warps=num_warps)
    return new, sizes


@torch.library.custom_op("kvpass::cosine_kmeans_update", mutates_args=())
def cosine_kmeans_update(x: Tensor, labels: Tensor, centroids: Tensor) -> tuple[Tensor, Tensor]:
    return cosine_kmeans_update_reference(x, labels, centroids)


@cosine_kmeans_update.register_fake
def _(x, labels, centroids):
    return torch.empty_like(centroids, memory_format=torch.contiguous_format), \
        centroids.new_empty(centroids.shape[:3], dtype=torch.int64)


if HAS_TRITON:
    @cosine_kmeans_update.register_kernel("cuda")
    def _(x, labels, centroids):
        return cosine_kmeans_update_triton(x, labels, centroids)
