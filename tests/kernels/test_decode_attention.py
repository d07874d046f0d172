from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kvpass.kernels._triton import DEFAULT_SHARED_MEMORY, SHARED_MEMORY_MARGIN, fit_pipeline
from kvpass.kernels.decode_attention import decode_attention_reference, decode_attention_triton

# the interpreter evaluates both sides of tl.where: log2(0) / 0-division warnings in masked lanes
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def random_case(b: int, hq: int, hkv: int, t: int, c: int, d: int, seed: int, dtype=torch.float32):
    """Fresh random inputs with a non-zero log-weight bias and ragged -inf tails per (b, g)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, t, d, generator=gen)
    k = torch.randn(b, hkv, c, d, generator=gen)
    v = torch.randn(b, hkv, c, d, generator=gen)
    lw = torch.rand(b, hkv, c, generator=gen) * 2.0 - 0.5            # non-zero bias (merged entries)
    length = torch.randint(1, c + 1, (b, hkv), generator=gen)
    length[0, 0] = c                                                  # one full row
    lw = lw.masked_fill(torch.arange(c)[None, None, :] >= length[:, :, None], float("-inf"))
    return q.to(dtype), k.to(dtype), v.to(dtype), lw


def _close(got: torch.Tensor, want: torch.Tensor, tol: float, name: str) -> None:
    assert torch.isfinite(got).all(), f"{name}: non-finite values (an unwritten or NaN output)"
    err = (got.double() - want.double()).norm() / want.double().norm()
    assert err < tol, f"{name}: relative error {err:.2e} >= {tol:.0e}"


@pytest.mark.parametrize("hq, hkv, t", [(2, 2, 1), (6, 2, 1), (8, 2, 1), (4, 1, 3)])   # G in {1, 3, 4}; T > 1
@pytest.mark.parametrize("c", [37, 5])
@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("want_scores", [False, True])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_matches_float64_reference(hq, hkv, t, c, softcap, want_scores, num_splits, triton_device):
    q, k, v, lw = random_case(2, hq, hkv, t, c, 16, seed=hq * 1000 + c * 10 + t)
    scale = 1 / math.sqrt(16)
    want_o, want_s = decode_attention_reference(q.double(), k.double(), v.double(), lw, scale, softcap, want_scores)
    dev = torch.device(triton_device)
    got_o, got_s = decode_attention_triton(q.to(dev), k.to(dev), v.to(dev), lw.to(dev), scale, softcap,
                                           want_scores, num_splits=num_splits, block_n=16)
    _close(got_o.cpu(), want_o, 1e-5, "o")
    if want_scores:
        assert got_s.shape == (2, hkv, c)
        _close(got_s.cpu(), want_s, 1e-5, "scores")
    else:
        assert got_s.numel() == 0


@pytest.mark.parametrize(("elem", "d", "limit", "want"), [
    (2, 128, 227 << 10, (128, 3)),     # bf16 on an H100 / H200: the tuned launch, unchanged
    (4, 128, 227 << 10, (128, 2)),     # fp32 there: 2 x 128 KiB of K, V tiles would not fit; one in flight does
    (4, 128, 99 << 10, (64, 2)),       # fp32 on a 99 KiB GPU: half the tile too
    (2, 128, 99 << 10, (128, 2)),      # bf16 there
    (4, 64, 227 << 10, (128, 3)),
])
def test_fit_pipeline_keeps_what_fits_and_shrinks_what_does_not(elem, d, limit, want):
    block_n, stages = fit_pipeline(128, 3, 2 * d * elem, 16 * d * elem, limit)
    assert (block_n, stages) == want
    assert (stages - 1) * block_n * 2 * d * elem + 16 * d * elem + SHARED_MEMORY_MARGIN <= limit


def test_fit_pipeline_stops_at_its_floors():
    assert fit_pipeline(128, 3, 1 << 20, 0, 1 << 10) == (16, 2)      # nothing fits: the smallest it may try


@pytest.mark.parametrize(("props", "want"), [({"shared_memory_per_block_optin": 232448}, 232448),
                                              ({}, DEFAULT_SHARED_MEMORY)])
def test_shared_memory_limit_reads_the_device_once_and_falls_back(monkeypatch, props, want):
    import kvpass.kernels._triton as kt

    asked = []

    def properties(index):
        asked.append(index)
        return type("Props", (), props)()

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    monkeypatch.setattr(kt, "_SHARED_MEMORY", {})
    monkeypatch.setattr(kt, "triton", None)        # Triton's driver unreachable: the default
    assert kt.shared_memory_limit(torch.device("cuda", 1)) == want
    assert kt.shared_memory_limit(torch.device("cuda", 1)) == want and asked == [1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_default_launch_at_head_size_128_in_every_dtype_on_the_gpu(dtype):
    """fp32 at D = 128 asked 273 KiB of shared memory with the bf16-tuned launch (an H100 has 227): every policy
    on an fp32 model failed in its first decode step (fixed in 2a52477)."""
    q, k, v, lw = random_case(1, 32, 8, 1, 6570, 128, seed=3, dtype=dtype)
    want_o, want_s = decode_attention_reference(q.double(), k.double(), v.double(), lw, 128 ** -0.5, None, True)
    got_o, got_s = decode_attention_triton(q.cuda(), k.cuda(), v.cuda(), lw.cuda(), 128 ** -0.5, None, True)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    _close(got_o.float().cpu(), want_o, tol, "o")
    _close(got_s.cpu(), want_s, tol, "scores")


@pytest.mark.parametrize("want_scores", [False, True])
@pytest.mark.parametrize("hq, t", [(8, 1), (8, 5)])     # one 16-row query tile (128-slot tiles) and a 32-row one
def test_default_launch_matches_float64_reference(hq, t, want_scores, triton_device):
    """The launch the heuristics choose (no overrides): 128-slot tiles for one 16-row query tile, else 64; a
    cache of 300 slots spans partial tiles and several splits, with ragged empty tails."""
    q, k, v, lw = random_case(2, hq, 2, t, 300, 32, seed=hq * 7 + t)
    want_o, want_s = decode_attention_reference(q.double(), k.double(), v.double(), lw, 0.2, None, want_scores)
    dev = torch.device(triton_device)
    got_o, got_s = decode_attention_triton(q.to(dev), k.to(dev), v.to(dev), lw.to(dev), 0.2, None, want_scores,
                                           num_splits=3)
    _close(got_o.cpu(), want_o, 1e-5, "o")
    if want_scores:
        _close(got_s.cpu(), want_s, 1e-5, "scores")


def test_combine_of_more_splits_than_one_block(triton_device):
    """45 splits: the combine reads them in blocks of 32 (one full, one partial), with empty splits
    (all slots of a split empty) mixed in."""
    q, k, v, lw = random_case(1, 4, 2, 1, 45 * 16, 16, seed=11)
    lw[:, :, 16 * 3:16 * 9] = float("-inf")                              # splits 3-8 hold nothing
    want_o, want_s = decode_attention_reference(q.double(), k.double(), v.double(), lw, 0.25, None, True)
    dev = torch.device(triton_device)
    got_o, got_s = decode_attention_triton(q.to(dev), k.to(dev), v.to(dev), lw.to(dev), 0.25, None, True,
                                           num_splits=45, block_n=16)
    _close(got_o.cpu(), want_o, 1e-5, "o")
    _close(got_s.cpu(), want_s, 1e-5, "scores")


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 2e-2), (torch.float16, 5e-3)])
def test_triton_half_precision(dtype, tol, triton_device):
    q, k, v, lw = random_case(2, 8, 2, 1, 70, 32, seed=7, dtype=dtype)
    want_o, want_s = decode_attention_reference(q.double(), k.double(), v.double(), lw, 0.2, None, True)
    dev = torch.device(triton_device)
    got_o, got_s = decode_attention_triton(q.to(dev), k.to(dev), v.to(dev), lw.to(dev), 0.2, None, True,
                                           num_splits=2, block_n=16)
    assert got_o.dtype == dtype
    _close(got_o.cpu(), want_o, tol, "o")
    _close(got_s.cpu(), want_s, tol, "scores")


def test_triton_writes_every_output_and_reads_strided_q(triton_device):
    """Poisoned output memory must be overwritten; q as a transposed view (as the graph passes it)."""
    dev = torch.device(triton_device)
    q, k, v, lw = random_case(2, 6, 2, 1, 23, 16, seed=11)
    q_strided = q.transpose(1, 2).contiguous().transpose(1, 2)          # [B, Hq, T, D] with T-major layout
    want_o, _ = decode_attention_reference(q.double(), k.double(), v.double(), lw, 0.25)
    torch.manual_seed(0)
    real_empty = torch.empty_like
    try:
        torch.empty_like = lambda x, **kw: real_empty(x, **kw).fill_(float("nan"))   # poison
        got_o, _ = decode_attention_triton(q_strided.to(dev), k.to(dev), v.to(dev), lw.to(dev), 0.25,
                                           num_splits=2, block_n=16)
    finally:
        torch.empty_like = real_empty
    _close(got_o.cpu(), want_o, 1e-5, "o")


def test_bad_inputs_raise_value_error(triton_device):
    dev = torch.device(triton_device)
    q, k, v, lw = (x.to(dev) for x in random_case(1, 4, 2, 1, 8, 16, seed=3))
    with pytest.raises(ValueError, match="log_weight must be float32"):
        decode_attention_triton(q, k, v, lw.double(), 0.25)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        decode_attention_triton(q[:, :3], k, v, lw, 0.25)
    with pytest.raises(ValueError, match="log_weight must be"):
        decode_attention_triton(q, k, v, lw[:, :, :4], 0.25)
    with pytest.raises(ValueError, match="share a dtype"):
        decode_attention_triton(q, k.half(), v, lw, 0.25)
    with pytest.raises(ValueError, match="softcap"):
        decode_attention_triton(q, k, v, lw, 0.25, softcap=0.0)


def test_reference_matches_sdpa_with_float_mask():
    """The reference against an independent computation: SDPA with the bias as a float mask."""
    q, k, v, lw = random_case(2, 6, 2, 1, 19, 16, seed=5)
    q, k, v = q.double(), k.double(), v.double()
    got, scores = decode_attention_reference(q, k, v, lw, 0.3, None, True)
    group = 3
    mask = lw.double().repeat_interleave(group, dim=1)[:, :, None, :]          # [B, Hq, 1, C]
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                          attn_mask=mask, scale=0.3)
    torch.testing.assert_close(got, want)
    p = torch.softmax((q @ k.repeat_interleave(group, 1).transpose(-1, -2)) * 0.3 + mask, dim=-1)
    torch.testing.assert_close(scores, p[:, :, 0].reshape(2, 2, group, -1).mean(2))
    # and the check can fail: dropping the bias changes the output
    plain = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                           attn_mask=torch.where(mask.isinf(), mask, 0.0), scale=0.3)
    assert not torch.allclose(got, plain)


def test_kvpass_imports_without_triton():
    """CPU-only installs have no triton: kvpass and its ops must still import and run the reference."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['triton'] = None; sys.modules['triton.language'] = None\n"
            "import torch, kvpass, kvpass.kernels as K\n"
            "assert not K.decode_attention.__module__.startswith('triton')\n"
            "from kvpass.kernels._triton import HAS_TRITON; assert not HAS_TRITON\n"
            "q = torch.randn(1, 2, 1, 8); k = torch.randn(1, 1, 4, 8); lw = torch.zeros(1, 1, 4)\n"
            "o, _ = torch.ops.kvpass.decode_attention(q, k, k, lw, 0.3)\n"
            "assert o.shape == q.shape\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
