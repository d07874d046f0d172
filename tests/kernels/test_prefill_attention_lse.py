"""prefill_attention_lse: the attention equals prefill_attention's, the row log-sum-exps equal a float64
dense computation (pads, GQA, window, softcap; +inf on pad rows); the Triton row pass and the column
pass fed with these log-sum-exps equal the two-pass result; the export form equals the reference; the
prefill graph of a column-sum policy takes the log-sum-exps from the attention."""

from __future__ import annotations

import math

import pytest
import torch

from kvpass.kernels import prefill_attention_lse_reference, prefill_attention_reference, prefill_mask
from kvpass.kernels.attention_column_sums import (
    head_column_sums_rows,
    head_column_sums_triton,
    row_lse_triton,
)
from kvpass.kernels.prefill_attention_lse import row_lse_reference
from kvpass.rewrites.functional_graphs import prefill_attention_lse_explicit

CASES = [(4, 2, 23, None, None), (3, 1, 29, 7, None), (2, 2, 18, None, 30.0), (4, 1, 33, 5, 20.0)]


def dense_lse2(q, k, pad, scale, window, softcap):
    """float64 log2 sum_j exp(s_ij) over allowed keys, +inf on pad rows: [B, Hq, T]."""
    hq, hkv, t = q.shape[1], k.shape[1], q.shape[2]
    s = q.double() @ k.double().repeat_interleave(hq // hkv, dim=1).transpose(-1, -2) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    lse = torch.logsumexp(s.masked_fill(~prefill_mask(pad, t, window), float("-inf")), dim=-1) / math.log(2)
    pad_row = torch.arange(t)[None, :] < pad[:, None]
    return lse.masked_fill(pad_row[:, None, :], float("inf"))


def _inputs(hq, hkv, t, seed):
    torch.manual_seed(seed)
    return torch.randn(3, hq, t, 16), torch.randn(3, hkv, t, 16), torch.randn(3, hkv, t, 16), torch.tensor([0, 4, 11])


@pytest.mark.parametrize("hq, hkv, t, window, softcap", CASES)
def test_reference_equals_dense(hq, hkv, t, window, softcap):
    q, k, v, pad = _inputs(hq, hkv, t, t)
    o, lse = prefill_attention_lse_reference(q, k, v, pad, 0.3, window, softcap)
    assert torch.equal(o, prefill_attention_reference(q, k, v, pad, 0.3, window, softcap))
    want = dense_lse2(q, k, pad, 0.3, window, softcap)
    assert lse.dtype == torch.float32 and lse.shape == (3, hq, t)
    assert torch.isinf(lse[1, :, :4]).all() and (lse[1, :, :4] > 0).all()      # pad rows: +inf
    torch.testing.assert_close(lse.double(), want, rtol=1e-5, atol=1e-5)
    assert row_lse_reference(q.double(), k.double(), pad, 0.3, window, softcap, block=5).dtype == torch.float64


@pytest.mark.parametrize("hq, hkv, t, window, softcap", CASES)
def test_explicit_form_equals_reference(hq, hkv, t, window, softcap):
    q, k, v, pad = _inputs(hq, hkv, t, t + 1)
    got = prefill_attention_lse_explicit(q, k, v, pad, 0.3, window, softcap)
    want = prefill_attention_lse_reference(q, k, v, pad, 0.3, window, softcap)
    real = ~(torch.arange(t)[None, :] < pad[:, None])[:, None, :, None]        # pad rows' outputs are never read
    torch.testing.assert_close(torch.where(real, got[0], 0.0), torch.where(real, want[0], 0.0), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("hq, hkv, t, window, softcap", CASES)
def test_triton_row_pass_and_column_pass_with_given_lse(hq, hkv, t, window, softcap, triton_device):
    """row_lse_triton equals the reference; the column pass given those lse equals the float64 rows path."""
    q, k, _, pad = _inputs(hq, hkv, t, t + 2)
    dev = torch.device(triton_device)
    lse = row_lse_triton(q.to(dev), k.to(dev), pad.to(dev), 0.3, window, softcap, block_m=16, block_n=16)
    torch.testing.assert_close(lse.cpu().double(), dense_lse2(q, k, pad, 0.3, window, softcap), rtol=1e-4, atol=1e-4)
    given = row_lse_reference(q, k, pad, 0.3, window, softcap).to(dev)
    col = head_column_sums_triton(q.to(dev), k.to(dev), pad.to(dev), 0.3, window, softcap, lse=given,
                                  block_m=16, block_n=16)
    want = head_column_sums_rows(q.double(), k.double(), pad, 0.3, window, softcap, block=7)
    torch.testing.assert_close(col.cpu().double(), want, rtol=1e-4, atol=1e-4)
    halved = head_column_sums_triton(q.to(dev), k.to(dev), pad.to(dev), 0.3, window, softcap, lse=given + 1.0,
                                     block_m=16, block_n=16)                # the given lse is what normalises
    torch.testing.assert_close(halved, col / 2, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="lse must be"):
        head_column_sums_triton(q.to(dev), k.to(dev), pad.to(dev), 0.3, window, softcap, lse=given[:, :1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("pad, window, softcap", [((0, 0), None, None), ((0, 3), None, None),
                                                  ((0, 0), 5, None), ((0, 0), None, 20.0)])
def test_cpu_op_equals_reference(dtype, pad, window, softcap):
    """On CPU the op takes SDPA's flash kernel (with its log-sum-exp) for a prompt without pads, window or
    softcap: the same o as prefill_attention, bit for bit, and the reference's lse; otherwise the reference."""
    torch.manual_seed(len(pad) + (window or 0))
    q = torch.randn(2, 6, 37, 16, dtype=dtype).transpose(1, 2).contiguous().transpose(1, 2)
    k, v = torch.randn(2, 2, 37, 16, dtype=dtype), torch.randn(2, 2, 37, 16, dtype=dtype)
    pad = torch.tensor(pad)
    o, lse = torch.ops.kvpass.prefill_attention_lse(q, k, v, pad, 0.3, window, softcap)
    want_o, want_lse = prefill_attention_lse_reference(q, k, v, pad, 0.3, window, softcap)
    assert torch.equal(o, prefill_attention_reference(q, k, v, pad, 0.3, window, softcap))
    assert lse.dtype == want_lse.dtype and lse.shape == want_lse.shape and lse.is_contiguous()   # as the fake's
    tol = {torch.float64: 1e-12, torch.float32: 1e-5}.get(dtype, 1e-3)             # bf16: its kernel rounds q k
    torch.testing.assert_close(lse, want_lse, rtol=tol, atol=tol)


def test_prefill_graph_takes_lse_from_the_attention():
    """D2O (column sums + head variance) and H2O get prefill_attention_lse with the stats fed its lse;
    StreamingLLM (no statistics) keeps the plain prefill attention."""
    import transformers

    import kvpass

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ops = torch.ops.kvpass
    for name, want_lse in (("d2o", True), ("h2o", True), ("streamingllm", False)):
        gm = kvpass.apply(model, name, 0.5).graphs.prefill
        targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        assert (ops.prefill_attention_lse.default in targets) == want_lse
        assert (ops.prefill_attention.default in targets) == (not want_lse)
        stat_nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in (
            ops.attention_column_sums.default, ops.attention_column_sums_and_head_variance.default)]
        assert len(stat_nodes) == (2 if want_lse else 0)
        assert all(n.kwargs.get("lse") is not None for n in stat_nodes)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("pads", [False, True])
def test_cuda_op_equals_reference_at_real_shapes(pads: bool):
    """The CUDA op (cuDNN attention with its log-sum-exp; with pads: SDPA + the Triton row pass) against
    the reference, Llama-3.1-8B heads, bf16, T = 4096."""
    torch.manual_seed(0)
    t = 4096
    q = torch.randn(2, 32, t, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 8, t, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(2, 8, t, 128, device="cuda", dtype=torch.bfloat16)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)                        # the model's [B, T, H, D] layout
    pad = torch.tensor([0, 100 if pads else 0], device="cuda")
    o, lse = torch.ops.kvpass.prefill_attention_lse(q, k, v, pad, 128 ** -0.5)
    assert o.stride() == q.stride()
    want_o = prefill_attention_reference(q, k, v, pad, 128 ** -0.5)
    want_lse = row_lse_reference(q, k, pad, 128 ** -0.5, block=512)
    real = lse.isfinite()
    assert bool((real == want_lse.isfinite()).all())
    torch.testing.assert_close(lse[real], want_lse[real], rtol=0, atol=2e-3)
    torch.testing.assert_close(o[:, :, 100:], want_o[:, :, 100:], rtol=2e-2, atol=2e-2)
