"""Write one new token's key and value into a quantized cache (kvpass/quantization), in place: ``write_kv`` with the
entry encoded on the way.

For every (b, g), with s = slot[b, g]: (k_cache[b, g, s], k_scale[b, g, s]) = quantize_entries(k_new[b, g, 0]),
likewise v; log_weight[b, g, s] = 0 and position[b, g, s] = pos[b, 0] (``write_kv``'s contract otherwise). The format
is the codes' dtype: int8 (QMAX 127, round half to even) or float8_e4m3fn (QMAX 448); kvpass/quantization/formats.py
defines both.

Shapes: k_cache, v_cache: [B, Hkv, C, D] int8 or float8_e4m3fn; k_scale, v_scale: [B, Hkv, C] in the model's dtype
(k_new's); log_weight: [B, Hkv, C] fp32; slot: [B, Hkv] int64; position: [B, Hkv, C] int64; pos: [B, 1];
k_new, v_new: [B, Hkv, 1, D]. Traffic: 2*B*Hkv*(D + 2) bytes written in bf16 (D codes and a 2-byte scale each).

On CUDA one Triton launch does it all (a program per (b, g)): the absmax, the scale rounded to the model's dtype, the
IEEE division (``div_rn``) and the rounding of the reference, so the codes are the reference's bit for bit.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvpass.cache import bits
from kvpass.kernels._triton import HAS_TRITON, check_device, next_pow2, require_triton, tl, triton
from kvpass.kernels.write_kv import check_write_kv_inputs
from kvpass.quantization.formats import format_of, qmax, quantize_entries

# 1.5 * 2^23 (fp32), 1.5 * 2^52 (fp64): y + M - M rounds |y| < 2^22 to an integer, half to even, as torch.round
ROUNDING_MAGIC = {False: 12582912.0, True: 6755399441055744.0}


def write_kv_quantized_reference(k_cache: Tensor, v_cache: Tensor, k_scale: Tensor, v_scale: Tensor,
                                 log_weight: Tensor, slot: Tensor, position: Tensor, pos: Tensor, k_new: Tensor,
                                 v_new: Tensor) -> None:
    kv_dtype = format_of(k_cache)
    idx = slot[:, :, None]                                                 # [B, Hkv, 1]
    for cache, scale, new in ((k_cache, k_scale, k_new), (v_cache, v_scale, v_new)):
        codes, s = quantize_entries(new.to(scale.dtype), kv_dtype)         # [B, Hkv, 1, D], [B, Hkv, 1]
        bits(cache).scatter_(2, idx[..., None].expand(-1, -1, 1, cache.shape[-1]), bits(codes))
        scale.scatter_(2, idx, s)
    log_weight.scatter_(2, idx, 0.0)
    position.scatter_(2, idx, pos.to(position)[:, :, None].expand_as(idx))


@triton.jit
def _div(a, b, ACC: tl.constexpr):
    """a / b correctly rounded: ``div_rn`` in fp32 (Triton's ``/`` is approximate there), ``/`` in fp64 (IEEE)."""
    if ACC == tl.float64:
        return a / b
    else:
        return tl.math.div_rn(a, b)


@triton.jit
def _round_to(x, TY: tl.constexpr):
    """x (fp32, or fp64 for an fp64 TY) rounded to TY, to nearest even. bf16 by its bits (the interpreter's cast
    truncates): add 0x7FFF plus the kept lowest bit, clear the 16 dropped ones (finite x)."""
    if TY == tl.bfloat16:
        b = x.to(tl.float32).to(tl.int32, bitcast=True)
        return ((b + 0x7FFF + ((b >> 16) & 1)) & -65536).to(tl.float32, bitcast=True).to(TY)
    else:
        return x.to(TY)


@triton.jit
def _e4m3_grid(y):
    """fp32 y (|y| <= 448) rounded to the nearest e4m3 value, ties to even, as an fp32 (then cast exactly: the
    interpreter's fp32 -> e4m3 cast mis-rounds across binades). The step in y's binade 2^(e - 3), at least
    e4m3's subnormal step 2^-9; y / step < 16 is rounded by the 1.5 * 2^23 addition. Zero keeps y's sign."""
    e = tl.maximum((y.to(tl.int32, bitcast=True) >> 23) & 0xFF, 121)      # biased exponent, >= 127 - 6
    step = ((e - 3) << 23).to(tl.float32, bitcast=True)
    inv = ((257 - e) << 23).to(tl.float32, bitcast=True)                   # 1 / step
    r = ((y * inv + 12582912.0) - 12582912.0) * step
    return tl.where(r == 0.0, y * 0.0, r)


@triton.jit
def _encode(x, TOP: tl.constexpr, INT8: tl.constexpr, SCALE_TY: tl.constexpr, ACC: tl.constexpr,
            MAGIC: tl.constexpr):
    """One entry x [BLOCK_D] (0 past D) -> (codes as exact fp32 values, scale in SCALE_TY): quantize_entries'
    arithmetic."""
    xf = x.to(ACC)
    amax = tl.max(tl.abs(xf), 0)
    scale = _round_to(_div(amax, tl.zeros_like(amax) + TOP, ACC), SCALE_TY)
    s = scale.to(ACC)
    y = tl.where(s > 0, _div(xf, tl.zeros_like(xf) + tl.where(s > 0, s, 1.0), ACC), 0.0)
    y = tl.minimum(tl.maximum(y, -TOP), TOP)
    if INT8:                       # round half to even: adding and taking away 1.5 * 2^(mantissa bits) (|y| <= 127)
        return ((y + MAGIC) - MAGIC).to(tl.float32), scale
    else:                          # (torch casts to float8 through fp32 as well)
        return _e4m3_grid(y.to(tl.float32)), scale


# Program (b, g): s = slot[b, g]; each of k, v: one entry encoded, its codes and scale stored at slot s;
# log_weight[b, g, s] = 0, position[b, g, s] = pos[b, 0].
@triton.jit
def _write_kv_quantized_kernel(KC, VC, KS, VS, LW, SLOT, POSITION, POS, KN, VN, HKV, C, spb,
                               skcb, skch, skcc, svcb, svch, svcc, sksb, sksh, svsb, svsh,
                               sknb, sknh, sknd, svnb, svnh, svnd,
                               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, INT8: tl.constexpr,
                               TOP: tl.constexpr, ACC: tl.constexpr, MAGIC: tl.constexpr):
    row = tl.program_id(0)
    b = (row // HKV).to(tl.int64)
    g = (row % HKV).to(tl.int64)
    s = tl.load(SLOT + row)
    d = tl.arange(0, BLOCK_D)
    m = d < HEAD_DIM
    k = tl.load(KN + b * sknb + g * sknh + d * sknd, mask=m, other=0.0)
    v = tl.load(VN + b * svnb + g * svnh + d * svnd, mask=m, other=0.0)
    kq, ks = _encode(k, TOP, INT8, KS.dtype.element_ty, ACC, MAGIC)
    vq, vs = _encode(v, TOP, INT8, VS.dtype.element_ty, ACC, MAGIC)
    tl.store(KC + b * skcb + g * skch + s * skcc + d, kq.to(KC.dtype.element_ty), mask=m)
    tl.store(VC + b * svcb + g * svch + s * svcc + d, vq.to(VC.dtype.element_ty), mask=m)
    tl.store(KS + b * sksb + g * sksh + s, ks)
    tl.store(VS + b * svsb + g * svsh + s, vs)
    tl.store(LW + row.to(tl.int64) * C + s, 0.0)
    tl.store(POSITION + row.to(tl.int64) * C + s, tl.load(POS + b * spb))


def check_write_kv_quantized_inputs(k_cache: Tensor, v_cache: Tensor, k_scale: Tensor, v_scale: Tensor,
                                    log_weight: Tensor, slot: Tensor, position: Tensor, pos: Tensor, k_new: Tensor,
                                    v_new: Tensor) -> None:
    """ValueError unless the codes are one 8-bit format in contiguous rows, the scales [B, Hkv, C] with unit slot stride
    on k_cache's device, and the rest as ``write_kv`` takes it."""
    format_of(k_cache)
    check_write_kv_inputs(k_cache, v_cache, log_weight, slot, position, pos, k_new, v_new)
    b, h, c, _ = k_cache.shape
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        check_device(name, t, k_cache.device)
        if t.shape != (b, h, c) or t.stride(2) != 1 or not t.is_floating_point():
            raise ValueError(f"write_kv_quantized: {name} must be a float [B, Hkv, C] = {(b, h, c)} with unit stride "
                             f"along C, got {tuple(t.shape)} {t.dtype} strides {t.stride()}")
    if v_cache.dtype != k_cache.dtype or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError(f"write_kv_quantized: k_cache, v_cache must share one 8-bit dtype with unit stride along D, "
                         f"got {k_cache.dtype}, {v_cache.dtype}, strides {k_cache.stride()}, {v_cache.stride()}")


def write_kv_quantized_triton(k_cache: Tensor, v_cache: Tensor, k_scale: Tensor, v_scale: Tensor, log_weight: Tensor,
                              slot: Tensor, position: Tensor, pos: Tensor, k_new: Tensor, v_new: Tensor) -> None:
    """The reference's writes in one launch (same contract; every tensor on one device)."""
    require_triton()
    check_write_kv_quantized_inputs(k_cache, v_cache, k_scale, v_scale, log_weight, slot, position, pos, k_new, v_new)
    b, h, c, d = k_cache.shape
    pos = pos.to(torch.int64)
    k_new, v_new = k_new.to(k_scale.dtype), v_new.to(v_scale.dtype)
    wide = k_scale.dtype == torch.float64
    _write_kv_quantized_kernel[(b * h,)](
        k_cache, v_cache, k_scale, v_scale, log_weight, slot.to(torch.int64).contiguous(), position, pos, k_new, v_new,
        h, c, pos.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), k_scale.stride(0), k_scale.stride(1), v_scale.stride(0), v_scale.stride(1),
        k_new.stride(0), k_new.stride(1), k_new.stride(3), v_new.stride(0), v_new.stride(1), v_new.stride(3),
        HEAD_DIM=d, BLOCK_D=max(16, next_pow2(d)), INT8=k_cache.dtype == torch.int8, TOP=qmax(format_of(k_cache)),
        ACC=tl.float64 if wide else tl.float32, MAGIC=ROUNDING_MAGIC[wide], num_warps=1)


@torch.library.custom_op("kvpass::write_kv_quantized",
                         mutates_args=("k_cache", "v_cache", "k_scale", "v_scale", "log_weight", "position"))
def write_kv_quantized(k_cache: Tensor, v_cache: Tensor, k_scale: Tensor, v_scale: Tensor, log_weight: Tensor,
                       slot: Tensor, position: Tensor, pos: Tensor, k_new: Tensor, v_new: Tensor) -> None:
    write_kv_quantized_reference(k_cache, v_cache, k_scale, v_scale, log_weight, slot, position, pos, k_new, v_new)


@write_kv_quantized.register_fake
def _(k_cache, v_cache, k_scale, v_scale, log_weight, slot, position, pos, k_new, v_new):
    return None


if HAS_TRITON:
    @write_kv_quantized.register_kernel("cuda")
    def _(k_cache, v_cache, k_scale, v_scale, log_weight, slot, position, pos, k_new, v_new):
        write_kv_quantized_triton(k_cache, v_cache, k_scale, v_scale, log_weight, slot, position, pos, k_new, v_new)
