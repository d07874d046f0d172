from __future__ import annotations

import pytest
import torch
from kvpass.kernels.statistics_stream import statistics_side_stream


def _inputs(device: str, t: int):
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, 8, t, 64, device=device, generator=gen)
    k = torch.randn(1, 2, t, 64, device=device, generator=gen)
    return q, k, torch.zeros(1, dtype=torch.int64, device=device)


def test_block_is_a_no_op_off_cuda():
    q, k, pad = _inputs("cpu", 40)
    want = torch.ops.kvpass.attention_column_sums_and_head_variance(q, k, pad, 0.125)
    with statistics_side_stream(torch.device("cpu")):
        got = torch.ops.kvpass.attention_column_sums_and_head_variance(q, k, pad, 0.125)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_side_stream_results_equal_the_current_streams():
    """Inside the block the ops run on a side stream; after it their results are ready on the current
    stream and equal the results computed there, even when the inputs are freed and their memory reused
    at once (the allocator must wait for the side stream's reads)."""
    dev = torch.device("cuda")
    q, k, pad = _inputs("cuda", 4096)
    q, k = q.bfloat16(), k.bfloat16()
    want_c, want_v = torch.ops.kvpass.attention_column_sums_and_head_variance(q, k, pad, 0.125)
    want_c1 = torch.ops.kvpass.attention_column_sums(q, k, pad, 0.125)
    main = torch.cuda.current_stream(dev)
    with statistics_side_stream(dev):
        qq, kk = q.clone(), k.clone()
        got_c, got_v = torch.ops.kvpass.attention_column_sums_and_head_variance(qq, kk, pad, 0.125)
        got_c1 = torch.ops.kvpass.attention_column_sums(qq, kk, pad, 0.125)
        assert torch.cuda.current_stream(dev) == main
        del qq, kk
        junk = [torch.full_like(q, float("nan")) for _ in range(2)]     # may take the freed blocks
    del junk
    torch.testing.assert_close(got_c, want_c, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_v, want_v, rtol=1e-4, atol=1e-8)
    torch.testing.assert_close(got_c1, want_c1, rtol=1e-5, atol=1e-6)
