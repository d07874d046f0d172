"""The 8-bit formats a cache may store its entries in (``kvpass.apply(..., kv_dtype=...)``), defined in plain torch.

An entry (one token's key or value of one KV head, D features x) is stored as D 8-bit codes q and one scale s in the
model's dtype (per (token, head)):

    s = round_model(max_d |x_d| / QMAX)                      (0 for an all-zero row)
    q_d = encode(clamp(x_d / s, -QMAX, QMAX))                 (0 where s = 0)
    x_d ~ q_d * s                                              (``dequantize_entries``: exact in fp32)

``int8``: QMAX = 127, encode = round half to even, torch.int8 codes (symmetric: -128 is never written).
``fp8_e4m3``: QMAX = 448 (e4m3's largest finite value), encode = the cast to torch.float8_e4m3fn (round to nearest
even; the clamp keeps it finite). The divisions are IEEE (correctly rounded) in fp32 (fp64 for a float64 model): the
Triton writes (kvpass/kernels/write_kv_quantized.py) compute the same codes bit for bit.

The scale is rounded to the model's dtype so the scales cost what one more feature would (2 bytes an entry in bf16):
with D = 128 an fp8 entry holds 130 bytes against bf16's 256, so K and V together take 0.508x; a slot's log-weight and
position (12 bytes) come on top in both. Relative error of a decoded feature: at most 2^-8 |x|_max / |x| ... for int8
(half a step of |x|_max / 127), 2^-4 |x| for e4m3 normals (3 mantissa bits) plus e4m3's subnormal step 2^-9 s near 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

# kv_dtype -> (the codes' torch dtype, QMAX)
KV_FORMATS: dict[str, tuple[torch.dtype, float]] = {
    "int8": (torch.int8, 127.0),
    "fp8_e4m3": (torch.float8_e4m3fn, 448.0),
}
CODE_DTYPES = {dtype: name for name, (dtype, _) in KV_FORMATS.items()}
# the first CUDA compute capability whose Triton loads and converts e4m3 (Ada, Hopper and later)
FP8_CAPABILITY = (8, 9)


def code_dtype(kv_dtype: str) -> torch.dtype:
    return KV_FORMATS[kv_dtype][0]


def qmax(kv_dtype: str) -> float:
    return KV_FORMATS[kv_dtype][1]


def format_of(codes: Tensor) -> str:
    """The kv_dtype whose codes ``codes`` holds (ValueError for another dtype)."""
    if codes.dtype not in CODE_DTYPES:
        raise ValueError(f"quantized cache codes must be {' or '.join(map(str, CODE_DTYPES))}, got {codes.dtype}")
    return CODE_DTYPES[codes.dtype]


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def quantize_entries(x: Tensor, kv_dtype: str) -> tuple[Tensor, Tensor]:
    """x: [..., D] (the model's dtype) -> (codes [..., D] int8 or float8_e4m3fn, scale [...] in x's dtype)."""
    top = qmax(kv_dtype)
    acc = _acc(x.dtype)
    xf = x.to(acc)
    scale = (xf.abs().amax(-1) / top).to(x.dtype)
    s = scale.to(acc)[..., None]
    y = torch.where(s > 0, xf / torch.where(s > 0, s, 1.0), 0.0).clamp(-top, top)
    codes = y.round().to(torch.int8) if kv_dtype == "int8" else y.to(torch.float8_e4m3fn)
    return codes, scale


def dequantize_entries(codes: Tensor, scale: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """codes [..., D], scale [...] -> codes * scale [..., D] in ``dtype`` (default the scale's, the model's). The product
    is exact in fp32 (8-bit codes times a 16-bit scale); rounding to ``dtype`` is the only error."""
    acc = torch.float64 if torch.float64 in (scale.dtype, dtype) else torch.float32
    return (codes.to(acc) * scale.to(acc)[..., None]).to(dtype or scale.dtype)


def cuda_capability(device: torch.device) -> tuple[int, int]:
    """The compute capability of CUDA ``device`` (a function of its own, so tests can stand one in)."""
    return torch.cuda.get_device_capability(device)


def fp8_unsupported(device: torch.device) -> str | None:
    """Why ``device`` cannot hold an fp8_e4m3 cache, or None: a CUDA GPU below compute capability 8.9 (its Triton has
    no e4m3 conversions). The CPU runs the plain-torch references."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    cap = tuple(cuda_capability(device))
    if cap < FP8_CAPABILITY:
        return f"{torch.cuda.get_device_name(device) if torch.cuda.is_available() else device} has compute " \
               f"capability {cap[0]}.{cap[1]}"
    return None
