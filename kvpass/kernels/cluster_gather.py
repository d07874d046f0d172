"""Gather of the entries ClusterKV selected, into contiguous buffers on the compute device
(docs/policies.md §2.6 step 3-4, §2.8; the gathered path of ``kvpass::cluster_recall_attention``).

``keep`` [B, Hkv, G, C] says which slots query head (g, j) of KV head g attends (the recalled clusters,
the sinks and the pending generated tokens: ``cluster_recall_attention.select_slots``). For each row
(b, g, j), with s_0 < s_1 < ... its kept slots in slot (= position) order:

    k_sel[b, g, j, w] = k[b, g, s_w],  v_sel likewise,  lw_sel[b, g, j, w] = log_weight[b, g, s_w]
    for w < min(count, W);  the rest is padding: k_sel = v_sel = 0, lw_sel = -inf

so softmax over (q . k_sel + lw_sel) is attention over the kept slots (a row keeping more than W slots
keeps its W lowest). The outputs live on ``keep``'s device; k and v may live elsewhere: ClusterKV keeps
them in pinned host memory on an accelerator (``Policy.host_resident``).

Shapes: k, v: [B, Hkv, C, D] (any float dtype, same device); log_weight: [B, Hkv, C] fp32 (on keep's
device, or k's); keep: [B, Hkv, G, C] bool; width W: 0 <= W <= C. Returns k_sel, v_sel
[B, Hkv, G, W, D] (k's dtype) and lw_sel [B, Hkv, G, W] fp32.
Traffic: reads 2*B*Hkv*G*W*D elements of k, v (over PCIe when they are host-resident) and writes as
many; the compaction reads keep once.

Triton path: the compaction is a cumulative count of ``keep`` and a ``searchsorted`` of 1..W into it
(torch, on keep's device; no sort); one program per (row, block of BLOCK_W outputs, block of D)
gathers its rows, so every output row is written once and the writes are contiguous. Host-resident
k, v must be pinned: the kernel reads them in place through unified addressing (zero-copy), with no
staging copy; unpinned host tensors take the reference path (gather on the host, then one copy).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvpass.kernels._triton import HAS_TRITON, interpreting, next_pow2, require_triton, tl, triton


def cluster_gather_reference(k: Tensor, v: Tensor, log_weight: Tensor, keep: Tensor,
                             width: int) -> tuple[Tensor, Tensor, Tensor]:
    b, hkv, group, c = keep.shape
    d = k.shape[-1]
    dev = keep.device
    idx = torch.sort((~keep).to(torch.int8), dim=-1, stable=True).indices[..., :width]   # kept slots first
    ok = torch.gather(keep, -1, idx)                                                     # [B, Hkv, G, W]
    idx_k = idx.to(k.device)[..., None].expand(-1, -1, -1, -1, d)
    ks = torch.gather(k[:, :, None].expand(-1, -1, group, -1, -1), 3, idx_k)            # reads G*W rows of k
    vs = torch.gather(v[:, :, None].expand(-1, -1, group, -1, -1), 3, idx_k)
    lw = torch.gather(log_weight[:, :, None].expand(-1, -1, group, -1), -1, idx.to(log_weight.device))
    ks, vs, lw = ks.to(dev, non_blocking=True), vs.to(dev, non_blocking=True), lw.to(dev)
    return ks.masked_fill(~ok[..., None], 0), vs.masked_fill(~ok[..., None], 0), \
        lw.float().masked_fill(~ok, float("-inf"))


# --------------------------------------------------------------------------------------- Triton
# Row r = (b, g, j). idx[r, w] = first slot s with cumsum(keep[r])[s] >= w + 1 (C when the row keeps
# fewer than w + 1 slots). Program (r, block of BLOCK_W outputs, block of D):
#     k_sel[r, w] = k[b, g, idx[r, w]] if idx[r, w] < C else 0      (same for v)
#     lw_sel[r, w] = log_weight[b, g, idx[r, w]] if idx[r, w] < C else -inf     (the d-block 0 program)

@triton.jit
def _cluster_gather_kernel(
    K, V, LW, IDX, KO, VO, LWO,
    skb, skh, skc, skd, svb, svh, svc, svd,
    HKV, G, C, W,
    HEAD_DIM: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    bg = r // G
    b = bg // HKV
    g = bg % HKV
    offs_w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    w_mask = offs_w < W
    d_mask = offs_d < HEAD_DIM
    idx = tl.load(IDX + r * W + offs_w, mask=w_mask, other=C)
    ok = idx < C
    mask2 = ok[:, None] & d_mask[None, :]
    ks = tl.load(K + b * skb + g * skh + idx[:, None] * skc + offs_d[None, :] * skd, mask=mask2, other=0.0)
    vs = tl.load(V + b * svb + g * svh + idx[:, None] * svc + offs_d[None, :] * svd, mask=mask2, other=0.0)
    o_off = (r * W + offs_w)[:, None] * HEAD_DIM + offs_d[None, :]
    smask = w_mask[:, None] & d_mask[None, :]
    tl.store(KO + o_off, ks, mask=smask)
    tl.store(VO + o_off, vs, mask=smask)
    if tl.program_id(2) == 0:
        lw = tl.load(LW + bg * C + idx, mask=ok, other=float("-inf"))
        tl.store(LWO + r * W + offs_w, lw, mask=w_mask)


def check_gather_inputs(k: Tensor, v: Tensor, log_weight: Tensor, keep: Tensor, width: int) -> None:
    """ValueError naming the tensor, the expected and the actual shape/dtype/device."""
    if k.dim() != 4 or not k.dtype.is_floating_point:
        raise ValueError(f"k must be a float [B, Hkv, C, D], got {k.dtype} {tuple(k.shape)}")
    b, hkv, c, _ = k.shape
    if v.shape != k.shape or v.dtype != k.dtype or v.device != k.device:
        raise ValueError(f"v must match k ({k.dtype} {tuple(k.shape)} on {k.device}), "
                         f"got {v.dtype} {tuple(v.shape)} on {v.device}")
    if tuple(log_weight.shape) != (b, hkv, c) or log_weight.dtype != torch.float32:
        raise ValueError(f"log_weight must be float32 [{b}, {hkv}, {c}], got {log_weight.dtype} {tuple(log_weight.shape)}")
    if keep.dim() != 4 or (keep.shape[0], keep.shape[1], keep.shape[3]) != (b, hkv, c) or keep.dtype != torch.bool:
        raise ValueError(f"keep must be bool [B={b}, Hkv={hkv}, G, C={c}], got {keep.dtype} {tuple(keep.shape)}")
    if not 0 <= width <= c:
        raise ValueError(f"width must be in [0, C={c}], got {width}")


def _zero_copy_ok(k: Tensor, keep: Tensor) -> bool:
    """Triton can read k where keep is: the same device, or pinned host memory seen from CUDA."""
    if k.device == keep.device:
        return keep.device.type == "cuda" or interpreting()
    return k.device.type == "cpu" and keep.device.type == "cuda" and k.is_pinned()


def cluster_gather_triton(k: Tensor, v: Tensor, log_weight: Tensor, keep: Tensor, width: int, *,
                          block_w: int = 32, num_warps: int = 4) -> tuple[Tensor, Tensor, Tensor]:
    """The Triton gather (same contract as ``cluster_gather_reference``). k, v on keep's device, or in
    pinned host memory with keep on CUDA; anything else is a ValueError."""
    require_triton()
    check_gather_inputs(k, v, log_weight, keep, width)
    if not _zero_copy_ok(k, keep):
        raise ValueError(f"k is on {k.device} (pinned: {k.device.type == 'cpu' and k.is_pinned()}), keep on "
                         f"{keep.device}: the Triton gather needs both on CUDA, pinned host k, v with keep on "
                         f"CUDA, or TRITON_INTERPRET=1 on CPU")
    b, hkv, group, c = keep.shape
    d = k.shape[-1]
    dev = keep.device
    k_sel = torch.empty(b, hkv, group, width, d, device=dev, dtype=k.dtype)
    v_sel = torch.empty_like(k_sel)
    lw_sel = torch.empty(b, hkv, group, width, device=dev, dtype=torch.float32)
    if width == 0 or b * hkv * group == 0:
        return k_sel, v_sel, lw_sel
    count = keep.to(torch.int32).cumsum(-1, dtype=torch.int32)                      # [B, Hkv, G, C]
    want = torch.arange(1, width + 1, device=dev, dtype=torch.int32).expand(b, hkv, group, width).contiguous()
    idx = torch.searchsorted(count, want)                                             # C where fewer kept
    lw = log_weight.to(dev).contiguous()
    block_d = min(128, max(16, next_pow2(d)))
    grid = (b * hkv * group, triton.cdiv(width, block_w), triton.cdiv(d, block_d))
    _cluster_gather_kernel[grid](
        k, v, lw, idx, k_sel, v_sel, lw_sel, *k.stride(), *v.stride(), hkv, group, c, width,
        HEAD_DIM=d, BLOCK_W=block_w, BLOCK_D=block_d, num_warps=num_warps)
    return k_sel, v_sel, lw_sel


@torch.library.custom_op("kvpass::cluster_gather", mutates_args=())
def cluster_gather(k: Tensor, v: Tensor, log_weight: Tensor, keep: Tensor, width: int) -> tuple[Tensor, Tensor, Tensor]:
    return cluster_gather_reference(k, v, log_weight, keep, width)


@cluster_gather.register_fake
def _(k, v, log_weight, keep, width):
    b, hkv, group, _ = keep.shape
    k_sel = keep.new_empty(b, hkv, group, width, k.shape[-1], dtype=k.dtype)
    return k_sel, torch.empty_like(k_sel), keep.new_empty(b, hkv, group, width, dtype=torch.float32)


if HAS_TRITON:
    @cluster_gather.register_kernel("cuda")
    def _(k, v, log_weight, keep, width):
        if _zero_copy_ok(k, keep) and (k.device.type == "cuda" or v.is_pinned()):
            return cluster_gather_triton(k, v, log_weight, keep, width)
        return cluster_gather_reference(k, v, log_weight, keep, width)
