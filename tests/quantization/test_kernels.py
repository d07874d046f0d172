"""The quantized cache's kernels against their plain-torch references on fresh random inputs: ``write_kv_quantized``
(Triton: the reference's codes and scales bit for bit), ``decode_attention_quantized`` (Triton against the float64
attention over the decoded entries, scores included), ``dequantize_kv``. Triton runs on CUDA where there is one, else
through the interpreter (TRITON_INTERPRET, tests/conftest.py); the ``gpu`` tests need CUDA (fp8: capability 8.9)."""

from __future__ import annotations

import pytest
import torch

from kvpass.kernels.decode_attention import decode_attention_reference
from kvpass.kernels.decode_attention_quantized import (
    decode_attention_quantized_reference,
    decode_attention_quantized_triton,
)
from kvpass.kernels.dequantize_kv import dequantize_kv_reference
from kvpass.kernels.write_kv_quantized import write_kv_quantized_reference, write_kv_quantized_triton
from kvpass.quantization.formats import KV_FORMATS, code_dtype, dequantize_entries, quantize_entries
from tests.kernels.test_decode_attention import random_case

FORMATS = sorted(KV_FORMATS)


def _fp8_ok() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.fixture
def triton_device() -> str:
    pytest.importorskip("triton")
    return "cuda" if torch.cuda.is_available() else "cpu"


def _skip_unsupported(kv_dtype: str, device: str) -> None:
    if device == "cuda" and kv_dtype == "fp8_e4m3" and not _fp8_ok():
        pytest.skip("fp8 needs compute capability 8.9")


def _write_inputs(b: int, h: int, c: int, d: int, kv_dtype: str, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    k_cache, k_scale = quantize_entries(torch.randn(b, h, c, d, generator=gen).to(dtype), kv_dtype)
    v_cache, v_scale = quantize_entries(torch.randn(b, h, c, d, generator=gen).to(dtype), kv_dtype)
    log_weight = -torch.rand(b, h, c, generator=gen)
    slot = torch.randint(0, c, (b, h), generator=gen)
    position = torch.randint(-1, 1000, (b, h, c), generator=gen)
    pos = torch.randint(1000, 2000, (b, 1), generator=gen)
    spread = torch.rand(b, 1, h, 1, generator=gen) * 8            # rows of very different magnitudes
    k_new = (torch.randn(b, 1, h, d, generator=gen) * spread).to(dtype).transpose(1, 2)   # strided, as the graph's
    v_new = (torch.randn(b, 1, h, d, generator=gen) * spread).to(dtype).transpose(1, 2)
    k_new[0, 0, 0, : d // 2] = 0.0                                # half-zero: e4m3 subnormals after the division
    return [k_cache, v_cache, k_scale, v_scale, log_weight, slot, position, pos, k_new, v_new]


MUTATED = ("k_cache", "v_cache", "k_scale", "v_scale", "log_weight", None, "position")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_dtype", FORMATS)
@pytest.mark.parametrize("b, h, c, d", [(1, 1, 5, 16), (3, 2, 9, 24)])
def test_triton_write_is_the_reference_bit_for_bit(b, h, c, d, kv_dtype, dtype, triton_device):
    _skip_unsupported(kv_dtype, triton_device)
    args = _write_inputs(b, h, c, d, kv_dtype, dtype, seed=b * 10 + d + len(kv_dtype))
    want = [t.clone() for t in args]
    write_kv_quantized_reference(*want)
    got = [t.to(triton_device, copy=True) for t in args]
    write_kv_quantized_triton(*got)
    for name, g, w, before in zip(MUTATED, got, want, args, strict=False):
        g = g.cpu()
        same = torch.equal(g.view(torch.uint8), w.view(torch.uint8)) if g.dtype.itemsize == 1 else torch.equal(g, w)
        assert same, name
        if name is not None:
            assert not torch.equal(w.float() if w.dtype.itemsize == 1 else w, before.float()
                                   if before.dtype.itemsize == 1 else before), name     # the step wrote something


@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_written_entry_decodes_to_the_new_token(kv_dtype):
    """The reference's write: the written slot decodes to k_new within the format's error (not just equal codes)."""
    args = _write_inputs(2, 2, 7, 32, kv_dtype, torch.float32, seed=3)
    write_kv_quantized_reference(*args)
    k_cache, _, k_scale, _, _, slot, _, _, k_new, _ = args
    idx = slot[:, :, None, None].expand(-1, -1, 1, 32)
    back = dequantize_entries(k_cache.view(torch.uint8).gather(2, idx).view(code_dtype(kv_dtype)),
                              k_scale.gather(2, slot[:, :, None]))
    err = (back - k_new).abs().amax() / k_new.abs().amax()
    assert err < (1 / 254 if kv_dtype == "int8" else 1 / 16)


def _quantized_case(b, hq, hkv, t, c, d, kv_dtype, dtype, seed):
    q, k, v, lw = random_case(b, hq, hkv, t, c, d, seed=seed, dtype=dtype)
    kq, ks = quantize_entries(k, kv_dtype)
    vq, vs = quantize_entries(v, kv_dtype)
    return q, kq, vq, ks, vs, lw


def _close(got: torch.Tensor, want: torch.Tensor, tol: float, name: str) -> None:
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    err = (got.double() - want.double()).norm() / want.double().norm()
    assert err < tol, f"{name}: relative error {err:.2e} >= {tol:.0e}"


@pytest.mark.parametrize("want_scores", [False, True])
@pytest.mark.parametrize("kv_dtype", FORMATS)
@pytest.mark.parametrize("hq, hkv, t, c, splits", [(2, 2, 1, 37, 1), (8, 2, 1, 300, None), (4, 1, 3, 70, 3)])
def test_triton_decode_matches_float64_attention_over_decoded_entries(hq, hkv, t, c, splits, kv_dtype,
                                                                      want_scores, triton_device):
    """fp32 queries: the kernel's attention over the codes equals the float64 attention over codes x scales
    (``decode_attention_reference`` on the decoded K, V) to 1e-5, across splits, GQA groups and T > 1."""
    _skip_unsupported(kv_dtype, triton_device)
    q, kq, vq, ks, vs, lw = _quantized_case(2, hq, hkv, t, c, 32, kv_dtype, torch.float32, seed=hq + c)
    kd, vd = dequantize_entries(kq, ks, torch.float64), dequantize_entries(vq, vs, torch.float64)
    want_o, want_s = decode_attention_reference(q.double(), kd, vd, lw, 0.2, None, want_scores)
    dev = [x.to(triton_device) for x in (q, kq, vq, ks, vs, lw)]
    got_o, got_s = decode_attention_quantized_triton(*dev, 0.2, None, want_scores, num_splits=splits)
    _close(got_o.cpu(), want_o, 1e-5, "o")
    if want_scores:
        _close(got_s.cpu(), want_s, 1e-5, "scores")
    ref_o, _ = decode_attention_quantized_reference(q, kq, vq, ks, vs, lw, 0.2, None, want_scores)
    _close(ref_o, want_o, 1e-5, "reference o")


@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_triton_decode_bf16_and_softcap(kv_dtype, triton_device):
    """bf16 queries and scales (the tensor-core path on a GPU) with a softcap: within bf16's rounding of the
    float64 attention over the decoded entries."""
    _skip_unsupported(kv_dtype, triton_device)
    q, kq, vq, ks, vs, lw = _quantized_case(1, 4, 2, 1, 90, 64, kv_dtype, torch.bfloat16, seed=11)
    want_o, _ = decode_attention_reference(q.double(), dequantize_entries(kq, ks, torch.float64),
                                           dequantize_entries(vq, vs, torch.float64), lw, 0.125, 30.0, False)
    got_o, _ = decode_attention_quantized_triton(*[x.to(triton_device) for x in (q, kq, vq, ks, vs, lw)],
                                                 0.125, 30.0, False)
    _close(got_o.float().cpu(), want_o, 1e-2, "o")


def test_a_wrong_scale_is_seen():
    """The check above can fail: attention with the V scales of other slots is far from the float64 answer."""
    q, kq, vq, ks, vs, lw = _quantized_case(1, 4, 2, 1, 64, 32, "int8", torch.float32, seed=2)
    want_o, _ = decode_attention_reference(q.double(), dequantize_entries(kq, ks, torch.float64),
                                           dequantize_entries(vq, vs, torch.float64), lw, 0.2, None, False)
    got_o, _ = decode_attention_quantized_reference(q, kq, vq, ks, vs.roll(1, -1), lw, 0.2, None, False)
    err = (got_o.double() - want_o).norm() / want_o.norm()
    assert err > 1e-2


@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_dequantize_kv_reference_is_codes_times_scales(kv_dtype):
    gen = torch.Generator().manual_seed(4)
    codes, scale = quantize_entries(torch.randn(2, 3, 11, 16, generator=gen).to(torch.bfloat16), kv_dtype)
    out = dequantize_kv_reference(codes, scale)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, (codes.double() * scale.double()[..., None]).to(torch.bfloat16))


def test_checks_name_the_bad_tensor():
    q, kq, vq, ks, vs, lw = _quantized_case(1, 4, 2, 1, 16, 16, "int8", torch.float32, seed=1)
    with pytest.raises(ValueError, match="k_scale"):
        decode_attention_quantized_triton(q, kq, vq, ks[:, :, :-1], vs, lw, 0.2)
    with pytest.raises(ValueError, match="one format"):
        decode_attention_quantized_triton(q, kq, vq.view(torch.uint8).view(torch.float8_e4m3fn), ks, vs, lw, 0.2)
    with pytest.raises(ValueError, match="int8 or"):
        decode_attention_quantized_triton(q, kq.float(), vq.float(), ks, vs, lw, 0.2)


@pytest.mark.gpu
@pytest.mark.skipif(not _fp8_ok(), reason="needs CUDA of compute capability 8.9 (fp8)")
@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_cuda_ops_take_the_kernels_at_real_shapes(kv_dtype):
    """The registered CUDA ops at a real shape (Hq 32, Hkv 8, 6,570 slots, D 128, bf16): the write bit for bit,
    the attention within bf16's rounding of the float64 attention over the decoded entries."""
    q, kq, vq, ks, vs, lw = (x.cuda() for x in _quantized_case(2, 32, 8, 1, 6570, 128, kv_dtype, torch.bfloat16, 3))
    want_o, want_s = decode_attention_reference(q.double(), dequantize_entries(kq, ks, torch.float64),
                                                dequantize_entries(vq, vs, torch.float64), lw, 128 ** -0.5, None, True)
    got_o, got_s = torch.ops.kvpass.decode_attention_quantized(q, kq, vq, ks, vs, lw, 128 ** -0.5, None, True)
    _close(got_o.float(), want_o, 1e-2, "o")
    _close(got_s, want_s, 1e-2, "scores")
    args = [t.cuda() for t in _write_inputs(4, 8, 655, 128, kv_dtype, torch.bfloat16, 1)]
    want = [t.clone() for t in args]
    write_kv_quantized_reference(*want)
    torch.ops.kvpass.write_kv_quantized(*args)
    for g, w in zip(args[:7], want[:7], strict=True):
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8)) if g.dtype.itemsize == 1 else torch.equal(g, w)
