"""has_pads: the prefill attention ops read ``pad.any()`` on the host once per pad tensor, not once a layer (on CUDA
each read waits for the device), and a pad tensor changed in place or a new one is read again."""

from __future__ import annotations

import importlib

import pytest
import torch

pa = importlib.import_module("kvpass.kernels.prefill_attention")


def _counting_any(monkeypatch) -> list[int]:
    calls: list[int] = []
    plain_any = torch.Tensor.any

    def counted(self, *args, **kwargs):
        calls.append(1)
        return plain_any(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "any", counted)
    return calls


def test_one_read_per_pad_tensor_and_version(monkeypatch):
    calls = _counting_any(monkeypatch)
    pad = torch.zeros(3, dtype=torch.int64)
    assert [pa.plain_causal(pad, None, None) for _ in range(32)] == [True] * 32     # 32 layers, one read
    assert len(calls) == 1
    pad[1] = 4                                                                     # in place: read again
    assert not pa.plain_causal(pad, None, None) and not pa.plain_causal(pad, None, None)
    assert len(calls) == 2
    other = torch.tensor([0, 2, 0])                                                # another forward's pads
    assert pa.has_pads(other) and len(calls) == 3
    assert not pa.plain_causal(torch.zeros(2, dtype=torch.int64), 16, None)        # a window: no read needed
    assert len(calls) == 3


def test_attention_over_layers_reads_pads_once_and_matches(monkeypatch):
    """Two layers' prefill attention with the same pad tensor: the same outputs as the masked definition, one read."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 24, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    k, v = k[:, :2], v[:, :2]
    calls = _counting_any(monkeypatch)
    for pad in (torch.zeros(2, dtype=torch.int64), torch.tensor([0, 5])):
        calls.clear()
        for _ in range(2):
            got = pa.prefill_attention_reference(q, k, v, pad, 0.25)
        assert len(calls) == 1
        mask = pa.prefill_mask(pad, 24, None)
        s = (q @ k.repeat_interleave(2, dim=1).transpose(-1, -2) * 0.25).masked_fill(~mask, float("-inf"))
        want = torch.softmax(s, dim=-1) @ v.repeat_interleave(2, dim=1)
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("window", [None, 5])
def test_prefill_mask_of_the_last_rows_is_those_rows_of_the_whole_mask(window):
    """``rows=w`` (an observation window's mask, ``attention_window_scores``) forms only the last w rows of the T x T
    mask, the same booleans, with pads longer than the window, shorter, and none."""
    pad = torch.tensor([0, 3, 20])
    whole = pa.prefill_mask(pad, 24, window)
    for w in (1, 7, 24):
        assert torch.equal(pa.prefill_mask(pad, 24, window, rows=w), whole[:, :, -w:])
