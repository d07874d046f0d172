"""Row-block column sums equal the dense computation (docs/policies.md §8.8), with left pads, GQA,
a sliding window and softcap."""

from __future__ import annotations

import pytest
import torch

from kvpass.kernels import attention_column_sums_reference, prefill_mask


def dense_column_sums(q, k, pad, scale, window, softcap):
    """The whole T x T attention in float64, then sums over real query rows, mean over the group."""
    b, hq, t, _ = q.shape
    hkv = k.shape[1]
    kk = k.double().repeat_interleave(hq // hkv, dim=1)
    s = q.double() @ kk.transpose(-1, -2) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    p = torch.softmax(s.masked_fill(~prefill_mask(pad, t, window), float("-inf")), dim=-1)   # [B, Hq, T, T]
    real = (torch.arange(t)[None, :] >= pad[:, None]).double()                               # [B, T]
    per_head = (p * real[:, None, :, None]).sum(dim=2)                                       # [B, Hq, T]
    return per_head.reshape(b, hkv, hq // hkv, t).mean(dim=2)


@pytest.mark.parametrize("hq, hkv, window, softcap", [(4, 2, None, None), (3, 1, 5, None), (2, 2, None, 30.0)])
def test_blocked_column_sums_equal_dense(hq, hkv, window, softcap):
    torch.manual_seed(hq * 10 + hkv)
    q, k = torch.randn(2, hq, 13, 8), torch.randn(2, hkv, 13, 8)
    pad = torch.tensor([0, 4])
    got = attention_column_sums_reference(q, k, pad, 0.35, window, softcap, block=4)   # 4 row blocks
    want = dense_column_sums(q, k, pad, 0.35, window, softcap)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert (got[1, :, :4] == 0).all()                       # pad keys get no attention
    real_rows = torch.tensor([13.0, 9.0])
    torch.testing.assert_close(got.sum(-1), real_rows[:, None].expand(2, hkv), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_m, block_n", [(16, 16), (32, 16), (16, 32)])
@pytest.mark.parametrize("hq, hkv, t, window, softcap", [(4, 2, 37, None, None), (3, 1, 29, 7, None),
                                                        (2, 2, 40, None, 30.0), (2, 1, 16, 3, 20.0),
                                                        (2, 1, 75, 21, None)])
def test_triton_head_column_sums_equal_dense(hq, hkv, t, window, softcap, block_m, block_n, triton_device):
    """The two-pass Triton kernels (blocks of 16 and 32: odd T, pads and windows cross tile edges, and
    the tiles inside the band skip the mask) against the float64 dense attention, per query head."""
    from kvpass.kernels.attention_column_sums import head_column_sums_triton

    torch.manual_seed(t * 7 + hq)
    q, k = torch.randn(3, hq, t, 24), torch.randn(3, hkv, t, 24)
    pad = torch.tensor([0, 5, 18])
    dev = torch.device(triton_device)
    got = head_column_sums_triton(q.to(dev), k.to(dev), pad.to(dev), 0.3, window, softcap, block_m=block_m,
                                 block_n=block_n)
    want = dense_column_sums(q, k, pad, 0.3, window, softcap) if hq == hkv else None
    per_head = torch.stack([dense_column_sums(q[:, h:h + 1], k[:, h // (hq // hkv):h // (hq // hkv) + 1], pad, 0.3,
                                              window, softcap)[:, 0] for h in range(hq)], dim=1)
    torch.testing.assert_close(got.cpu().double(), per_head, rtol=1e-4, atol=1e-4)
    if want is not None:
        torch.testing.assert_close(got.cpu().double(), want, rtol=1e-4, atol=1e-4)
    assert (got[2, :, :18] == 0).all()                        # pad keys get no attention


def test_fused_column_sums_and_head_variance_equal_the_separate_ops():
    """One pass gives exactly what the two ops give on their own (same arithmetic), with pads and GQA."""
    torch.manual_seed(5)
    q, k, pad = torch.randn(2, 4, 21, 8), torch.randn(2, 2, 21, 8), torch.tensor([0, 6])
    ops = torch.ops.kvpass
    col, var = ops.attention_column_sums_and_head_variance(q, k, pad, 0.3, 9, None)
    assert torch.equal(col, ops.attention_column_sums(q, k, pad, 0.3, 9, None))
    assert torch.equal(var, ops.attention_head_variance(q, k, pad, 0.3, 9, None))
