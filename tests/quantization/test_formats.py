"""The 8-bit entry formats (kvpass/quantization/formats.py) against their definition written out in float64: the
scale is the row's absmax over QMAX rounded to the model's dtype, the codes the row over its scale rounded (int8 half
to even; e4m3 to its nearest value), and a decoded entry within the format's stated error of the original."""

from __future__ import annotations

import pytest
import torch

from kvpass.quantization.formats import KV_FORMATS, dequantize_entries, quantize_entries

E4M3_MAX = 448.0


def _e4m3_nearest(y: torch.Tensor) -> torch.Tensor:
    """float64 y (|y| <= 448) -> the nearest e4m3 value, ties to even mantissa, by enumerating the format's grid."""
    values = []
    for e in range(-6, 9):                       # normals: (1 + m/8) 2^e, m = 0..7
        values += [(1 + m / 8) * 2.0 ** e for m in range(8)]
    values += [m / 8 * 2.0 ** -6 for m in range(8)]                     # subnormals and 0
    grid = torch.tensor(sorted(v for v in set(values) if v <= E4M3_MAX), dtype=torch.float64)
    a = y.abs()
    idx = torch.searchsorted(grid, a).clamp(1, len(grid) - 1)
    lo, hi = grid[idx - 1], grid[idx]
    # a tie goes to the value whose mantissa is even: its index in the grid is even (the grid alternates)
    pick_hi = (hi - a < a - lo) | ((hi - a == a - lo) & (idx % 2 == 0))
    return torch.where(pick_hi, hi, lo) * torch.sign(y)


def _definition(x: torch.Tensor, kv_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    top = KV_FORMATS[kv_dtype][1]
    scale = (x.double().abs().amax(-1) / top).to(x.dtype)
    s = scale.double()[..., None]
    y = torch.where(s > 0, x.double() / torch.where(s > 0, s, 1.0), 0.0).clamp(-top, top)
    codes = torch.round(y) if kv_dtype == "int8" else _e4m3_nearest(y)
    return codes, scale


def _rows(dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 2, 17, 24, generator=gen) * torch.rand(3, 2, 17, 1, generator=gen) * 5
    x[0, 0, 3] = 0.0                                          # an all-zero row: scale 0, codes 0
    x[1, 1, 4, :5] = 1e-6                                     # tiny features: e4m3 subnormals
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("kv_dtype", sorted(KV_FORMATS))
def test_codes_and_scales_are_the_definitions(kv_dtype: str, dtype: torch.dtype) -> None:
    x = _rows(dtype, seed=len(kv_dtype))
    codes, scale = quantize_entries(x, kv_dtype)
    want_codes, want_scale = _definition(x, kv_dtype)
    assert codes.dtype == KV_FORMATS[kv_dtype][0] and scale.dtype == dtype
    assert torch.equal(scale, want_scale)
    assert torch.equal(codes.double(), want_codes)
    assert (scale[0, 0, 3] == 0) and (codes[0, 0, 3].double() == 0).all()


@pytest.mark.parametrize("kv_dtype, bound", [("int8", 0.5 / 127), ("fp8_e4m3", 2.0 ** -4)])
def test_decoded_entries_within_the_formats_error(kv_dtype: str, bound: float) -> None:
    """int8: half a step, |x|max / 254, per feature; e4m3: half an ulp (2^-4 relative) of normals, or the
    subnormal step's half (2^-10 s) near 0. The scale's own rounding to fp32 adds nothing measurable here."""
    x = _rows(torch.float32, seed=5)
    codes, scale = quantize_entries(x, kv_dtype)
    back = dequantize_entries(codes, scale, torch.float64)
    err = (back - x.double()).abs()
    amax = x.double().abs().amax(-1, keepdim=True)
    if kv_dtype == "int8":
        allowed = bound * amax * (1 + 1e-6)
    else:
        allowed = torch.maximum(bound * x.double().abs(), 2.0 ** -10 * scale.double()[..., None]) * (1 + 1e-6)
    assert (err <= allowed).all(), float((err - allowed).max())
    assert err.max() > 0                                      # the format does lose precision (the check can fail)


def test_dequantize_is_exact_in_fp32() -> None:
    """8-bit codes times a bf16 scale are exact in fp32: decoding to fp32 equals decoding in float64."""
    x = _rows(torch.bfloat16, seed=7)
    for kv_dtype in KV_FORMATS:
        codes, scale = quantize_entries(x, kv_dtype)
        assert torch.equal(dequantize_entries(codes, scale, torch.float32).double(),
                           codes.double() * scale.double()[..., None])
