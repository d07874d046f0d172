"""RoPE of the step's query and key, and the key and value written into the cache, in place: one launch.

With x1, x2 the two halves of the first R <= D features of a head and rotate_half(x) = cat(-x2, x1) (Llama's
rotary form; Phi-3's and GPT-NeoX's partial one, R < D, passes the other D - R features through):

    rope(x) = cat(x[:R] * cos + rotate_half(x[:R]) * sin, x[R:])
    q_rot = rope(q);  k_cache[b, g, s] = rope(k_new)[b, g, 0], v_cache[b, g, s] = v_new[b, g, 0],
    log_weight[b, g, s] = 0, position[b, g, s] = pos[b, 0]            s = slot[b, g]   (``write_kv``)

Shapes: k_cache, v_cache [B, Hkv, C, D]; log_weight [B, Hkv, C] fp32; slot [B, Hkv] int64; position
[B, Hkv, C] int64; pos [B, 1] int64; q [B, Hq, 1, D] (Hq = G Hkv, head h in group h // G); k_new, v_new
[B, Hkv, 1, D]; cos, sin [B, 1, 1, R] -> q_rot [B, Hq, 1, D] in q's dtype.

At batch 1 a decode step is launch-bound between its GEMVs: Inductor rotates q and k in two kernels of their
own (their consumers are the two custom ops) before ``write_kv``'s; here one program per (b, g) rotates the
G query heads and the key of its group and writes the cache (kvpass/rewrites/rope_into_write_kv.py folds the
graph's rotations in). Products and the sum are rounded to the inputs' dtype as eager rounds them.
Traffic: (G + 2) D elements read and written per (b, g).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvpass.kernels._triton import HAS_TRITON, check_device, next_pow2, require_triton, tl, triton
from kvpass.kernels.write_kv import check_write_kv_inputs, write_kv_reference


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x * cos + rotate_half(x) * sin over the first R = cos.shape[-1] features, the rest passed through, op for
    op as transformers' ``apply_rotary_pos_emb`` (Llama's; Phi-3's where R < D)."""
    r = cos.shape[-1]
    if r != x.shape[-1]:
        return torch.cat((rotate(x[..., :r], cos, sin), x[..., r:]), dim=-1)
    h = r // 2
    return x * cos + torch.cat((-x[..., h:], x[..., :h]), dim=-1) * sin


def rope_write_kv_reference(k_cache: Tensor, v_cache: Tensor, log_weight: Tensor, slot: Tensor, position: Tensor,
                            pos: Tensor, q: Tensor, k_new: Tensor, v_new: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    write_kv_reference(k_cache, v_cache, log_weight, slot, position, pos, rotate(k_new, cos, sin), v_new)
    return rotate(q, cos, sin)


# Program (b, g), features d < R with partner p(d) = d + R/2 (d < R/2, sign -1) or d - R/2 (sign +1):
#     y_d = round(round(x_d cos_d) + round(sign x_p(d) sin_d)),  y_d = x_d for R <= d < D
# for x = k_new[b, g] and q[b, g G + i], i < G; then write_kv's four stores at s = slot[b, g].
@triton.jit
def _rotate(X, rows, offs, rotary, m, c, s, ACC: tl.constexpr):
    """rope of the [rows, BLOCK_D] tile at X + rows[:, None] + offs (stride 1 along D) over its first ``rotary``
    features, rounded as eager; the others as they are."""
    half = rotary // 2
    turns = (offs < rotary)[None, :]
    x = tl.load(X + rows[:, None] + offs[None, :], mask=m, other=0.0)
    partner = tl.where(offs < half, offs + half, offs - half)
    xr = tl.load(X + rows[:, None] + partner[None, :], mask=m & turns, other=0.0)
    xr = tl.where((offs < half)[None, :], -xr, xr)
    a = (x.to(ACC) * c.to(ACC)[None, :]).to(x.dtype)
    b = (xr.to(ACC) * s.to(ACC)[None, :]).to(x.dtype)
    return tl.where(turns, (a.to(ACC) + b.to(ACC)).to(x.dtype), x)


@triton.jit
def _rope_write_kv_kernel(KC, VC, LW, SLOT, POSITION, POS, Q, KN, VN, COS, SIN, QO, HKV, C, spb,
                          skcb, skch, skcc, skcd, svcb, svch, svcc, svcd,
                          sqb, sqh, sknb, sknh, svnb, svnh, svnd, scb, ssb, sob, soh,
                          GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, ROTARY: tl.constexpr,
                          BLOCK_D: tl.constexpr, ACC: tl.constexpr):
    row = tl.program_id(0)
    b = (row // HKV).to(tl.int64)
    g = (row % HKV).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dm = d < HEAD_DIM
    c = tl.load(COS + b * scb + d, mask=d < ROTARY, other=0.0)
    s = tl.load(SIN + b * ssb + d, mask=d < ROTARY, other=0.0)
    one = tl.zeros([1], tl.int64)
    k = _rotate(KN + b * sknb + g * sknh, one, d, ROTARY, dm[None, :], c, s, ACC)
    i = tl.arange(0, BLOCK_G)
    heads = g * GROUP + i
    qm = (i < GROUP)[:, None] & dm[None, :]
    q = _rotate(Q + b * sqb, heads * sqh, d, ROTARY, qm, c, s, ACC)
    tl.store(QO + b * sob + heads[:, None] * soh + d[None, :], q, mask=qm)
    slot = tl.load(SLOT + row)
    v = tl.load(VN + b * svnb + g * svnh + d * svnd, mask=dm)
    tl.store(KC + b * skcb + g * skch + slot * skcc + d[None, :] * skcd, k.to(KC.dtype.element_ty), mask=dm[None, :])
    tl.store(VC + b * svcb + g * svch + slot * svcc + d * svcd, v.to(VC.dtype.element_ty), mask=dm)
    tl.store(LW + row.to(tl.int64) * C + slot, 0.0)
    tl.store(POSITION + row.to(tl.int64) * C + slot, tl.load(POS + b * spb))


def rope_write_kv_triton(k_cache: Tensor, v_cache: Tensor, log_weight: Tensor, slot: Tensor, position: Tensor,
                         pos: Tensor, q: Tensor, k_new: Tensor, v_new: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The reference's rotations and writes in one launch (same contract; every tensor on one device)."""
    require_triton()
    check_write_kv_inputs(k_cache, v_cache, log_weight, slot, position, pos, k_new, v_new)
    b, h, c, d = k_cache.shape
    hq, r = q.shape[1], cos.shape[-1]
    for name, t in (("q", q), ("cos", cos), ("sin", sin)):
        check_device(name, t, k_cache.device)
    if (q.shape != (b, hq, 1, d) or hq % h or r % 2 or r > d or cos.shape != (b, 1, 1, r) or sin.shape != cos.shape
            or not q.dtype == k_new.dtype == cos.dtype == sin.dtype):
        raise ValueError(f"rope_write_kv: with k_new [B, Hkv, 1, D] = {tuple(k_new.shape)} it needs q [B, G Hkv, 1, D] "
                         f"and cos, sin [B, 1, 1, R] (even R <= D; q, k_new, cos, sin of one dtype); got q "
                         f"{tuple(q.shape)} {q.dtype}, cos {tuple(cos.shape)} {cos.dtype}, sin {tuple(sin.shape)} "
                         f"{sin.dtype}, k_new {k_new.dtype}")
    q, k_new, cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k_new, cos, sin))
    pos = pos.to(torch.int64)
    out = torch.empty(b, hq, 1, d, dtype=q.dtype, device=q.device)
    group = hq // h
    _rope_write_kv_kernel[(b * h,)](
        k_cache, v_cache, log_weight, slot.to(torch.int64).contiguous(), position, pos, q, k_new, v_new, cos, sin,
        out, h, c, pos.stride(0), *k_cache.stride(), *v_cache.stride(), q.stride(0), q.stride(1),
        k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1), v_new.stride(3), cos.stride(0),
        sin.stride(0), out.stride(0), out.stride(1), GROUP=group, BLOCK_G=next_pow2(group), HEAD_DIM=d, ROTARY=r,
        BLOCK_D=max(16, next_pow2(d)), ACC=tl.float64 if q.dtype == torch.float64 else tl.float32, num_warps=1,
        enable_fp_fusion=False)                    # no FMA: each product rounded, as eager
    return out


@torch.library.custom_op("kvpass::rope_write_kv", mutates_args=("k_cache", "v_cache", "log_weight", "position"))
def rope_write_kv(k_cache: Tensor, v_cache: Tensor, log_weight: Tensor, slot: Tensor, position: Tensor, pos: Tensor,
                  q: Tensor, k_new: Tensor, v_new: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return rope_write_kv_reference(k_cache, v_cache, log_weight, slot, position, pos, q, k_new, v_new, cos, sin)


@rope_write_kv.register_fake
def _(k_cache, v_cache, log_weight, slot, position, pos, q, k_new, v_new, cos, sin):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


if HAS_TRITON:
    @rope_write_kv.register_kernel("cuda")
    def _(k_cache, v_cache, log_weight, slot, position, pos, q, k_new, v_new, cos, sin):
        args = (k_cache, v_cache, log_weight, slot, position, pos, q, k_new, v_new, cos, sin)
        b, d, r = q.shape[0], q.shape[-1], cos.shape[-1]
        shaped = cos.shape == (b, 1, 1, r) and sin.shape == cos.shape and cos.dtype == q.dtype == sin.dtype
        if len({t.device for t in args}) == 1 and shaped and r % 2 == 0 and r <= d:
            return rope_write_kv_triton(*args)
        return rope_write_kv_reference(*args)
