"""Write one new token's key and value into the cache, in place.

For every (b, g), with s = slot[b, g]: k_cache[b, g, s] = k_new[b, g, 0], likewise v,
log_weight[b, g, s] = 0 (a plain, live entry) and position[b, g, s] = pos[b, 0] (the token's
absolute position). ``slot`` is the cache length for a growing layer and ``position % window`` for
a sliding-window ring.

Shapes: k_cache, v_cache: [B, Hkv, C, D]; log_weight: [B, Hkv, C] fp32; slot: [B, Hkv] int64;
position: [B, Hkv, C] int64; pos: [B, 1] int64 (the step's position_ids); k_new, v_new: [B, Hkv, 1, D].
The K, V buffers may live on another device than the new token (a recall policy's host-resident K, V;
``Policy.host_resident``). Traffic: 2*B*Hkv*D elements written.

On CUDA (all tensors on one device) one Triton launch writes all four, where the reference's four
scatters are four launches: at batch 1 the step is launch-bound, and this runs once per layer per token.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvpass.kernels._triton import HAS_TRITON, check_device, next_pow2, require_triton, tl, triton


def write_kv_reference(k_cache: Tensor, v_cache: Tensor, log_weight: Tensor, slot: Tensor, position: Tensor,
                       pos: Tensor, k_new: Tensor, v_new: Tensor) -> None:
    idx = slot.to(k_cache.device)[:, :, None, None].expand(-1, -1, 1, k_cache.shape[-1])
    k_cache.scatter_(2, idx, k_new.to(k_cache.device, k_cache.dtype))      # k, v may be host-resident
    v_cache.scatter_(2, idx, v_new.to(v_cache.device, v_cache.dtype))
    row_slot = slot.to(log_weight.device)[:, :, None]                      # [B, Hkv, 1]
    log_weight.scatter_(2, row_slot, 0.0)
    position.scatter_(2, row_slot, pos.to(position)[:, :, None].expand_as(row_slot))


# Program (b, g): s = slot[b, g];  k_cache[b, g, s, :] = k_new[b, g, 0, :] (cast to the cache dtype),
# v likewise, log_weight[b, g, s] = 0, position[b, g, s] = pos[b, 0]. One program a row: D elements each of k, v.
@triton.jit
def _write_kv_kernel(KC, VC, LW, SLOT, POSITION, POS, KN, VN, HKV, C, spb,
                     skcb, skch, skcc, skcd, svcb, svch, svcc, svcd,
                     sknb, sknh, sknd, svnb, svnh, svnd,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    b = (row // HKV).to(tl.int64)
    g = (row % HKV).to(tl.int64)
    s = tl.load(SLOT + row)
    d = tl.arange(0, BLOCK_D)
    m = d < HEAD_DIM
    k = tl.load(KN + b * sknb + g * sknh + d * sknd, mask=m)
    v = tl.load(VN + b * svnb + g * svnh + d * svnd, mask=m)
    tl.store(KC + b * skcb + g * skch + s * skcc + d * skcd, k.to(KC.dtype.element_ty), mask=m)
    tl.store(VC + b * svcb + g * svch + s * svcc + d * svcd, v.to(VC.dtype.element_ty), mask=m)
    tl.store(LW + row.to(tl.int64) * C + s, 0.0)
    tl.store(POSITION + row.to(tl.int64) * C + s, tl.load(POS + b * spb))


def check_write_kv_inputs(k_cache: Tensor, v_cache: Tensor, log_weight: Tensor, slot: Tensor, position: Tensor,
                          pos: Tensor, k_new: Tensor, v_new: Tensor) -> None:
    """Raise ValueError unless the write's tensors are on k_cache's device with the shapes and layouts of the
    module docstring (what the kernels here and in rope_write_kv.py index)."""
    b, h, c, d = k_cache.shape
    for name, t in (("v_cache", v_cache), ("log_weight", log_weight), ("slot", slot), ("position", position),
                    ("pos", pos), ("k_new", k_new), ("v_new", v_new)):
        check_device(name, t, k_cache.device)
    if (v_cache.shape != k_cache.shape or k_new.shape != (b, h, 1, d) or v_new.shape != k_new.shape
            or log_weight.shape != (b, h, c) or not log_weight.is_contiguous() or slot.shape != (b, h)
            or position.shape != (b, h, c) or not position.is_contiguous() or position.dtype != torch.int64
            or pos.shape != (b, 1)):
        raise ValueError(f"write_kv: k_cache, v_cache [B, Hkv, C, D] = {tuple(k_cache.shape)} need log_weight "
                         f"contiguous [B, Hkv, C], slot [B, Hkv], position contiguous int64 [B, Hkv, C], pos [B, 1], "
                         f"k_new, v_new [B, Hkv, 1, D]; got {tuple(log_weight.shape)}, {tuple(slot.shape)}, "
                         f"{tuple(position.shape)} {position.dtype}, {tuple(pos.shape)}, {tuple(k_new.shape)}, "
                         f"{tuple(v_new.shape)}")


def write_kv_triton(k_cache: Tensor, v_cache: Tensor, log_weight: Tensor, slot: Tensor, position: Tensor,
                    pos: Tensor, k_new: Tensor, v_new: Tensor) -> None:
    """The reference's writes in one launch (same contract; every tensor on one device)."""
    require_triton()
    check_write_kv_inputs(k_cache, v_cache, log_weight, slot, position, pos, k_new, v_new)
    b, h, c, d = k_cache.shape
    pos = pos.to(torch.int64)                      # a copy if it was not: its stride is the copy's
    _write_kv_kernel[(b * h,)](
        k_cache, v_cache, log_weight, slot.to(torch.int64).contiguous(), position, pos, k_new,
        v_new, h, c, pos.stride(0),
        *k_cache.stride(), *v_cache.stride(), k_new.stride(0), k_new.stride(1), k_new.stride(3),
        v_new.stride(0), v_new.stride(1), v_new.stride(3), HEAD_DIM=d, BLOCK_D=max(16, next_pow2(d)), num_warps=1)


@torch.library.custom_op("kvpass::write_kv", mutates_args=("k_cache", "v_cache", "log_weight", "position"))
def write_kv(k_cache: Tensor, v_cache: Tensor, log_weight: Tensor, slot: Tensor, position: Tensor, pos: Tensor,
             k_new: Tensor, v_new: Tensor) -> None:
    write_kv_reference(k_cache, v_cache, log_weight, slot, position, pos, k_new, v_new)


@write_kv.register_fake
def _(k_cache, v_cache, log_weight, slot, position, pos, k_new, v_new):
    return None


if HAS_TRITON:
    @write_kv.register_kernel("cuda")
    def _(k_cache, v_cache, log_weight, slot, position, pos, k_new, v_new):
        args = (k_cache, v_cache, log_weight, slot, position, pos, k_new, v_new)
        if len({t.device for t in args}) == 1:
            write_kv_triton(*args)
        else:                                          # host-resident K, V: the reference moves the rows
            write_kv_reference(*args)
