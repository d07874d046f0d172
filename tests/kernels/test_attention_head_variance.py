"""kvpass::attention_head_variance (D2O §5.4 step 1) against a dense float64 computation."""

from __future__ import annotations

import torch

from kvpass.kernels import attention_head_variance
from kvpass.kernels.attention_head_variance import head_column_sums


def test_matches_dense_per_head_variance() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 300, 8, generator=gen), torch.randn(2, 2, 300, 8, generator=gen)
    pad = torch.tensor([0, 7])
    got = attention_head_variance(q, k, pad, 0.3)
    for b in range(2):
        p0 = int(pad[b])
        for h in range(4):
            qq, kk = q[b, h, p0:].double(), k[b, h // 2, p0:].double()
            s = (qq @ kk.T) * 0.3
            s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
            col = torch.softmax(s, -1).sum(0)
            torch.testing.assert_close(got[b, h].double(), col.var(), rtol=1e-4, atol=1e-6)
    sums = head_column_sums(q, k, pad, 0.3)                                # blocks of 256 rows: 2 blocks
    torch.testing.assert_close(sums.sum(-1)[0], torch.full((4,), 300.0), rtol=1e-5, atol=1e-3)  # each row sums to 1
