"""chunk_attention_max (KVzip's reconstruction score): against an element-by-element float64 loop over a compressed
cache (a merged entry's log-weight, empty slots, pads, GQA, window, softcap), and the Triton cache pass against the
reference under the interpreter (or on CUDA)."""

from __future__ import annotations

import math

import pytest
import torch

from kvpass.cache import EMPTY
from kvpass.kernels import chunk_attention_max_reference, chunk_attention_reference
from kvpass.kernels.chunk_attention_max import cache_attention_max_triton, chunk_attention_max_cuda

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
SCALE = 0.3


def _case(hq: int, hkv: int, c: int, t: int, seed: int, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    b, d = 3, 16
    q = torch.randn(b, hq, t, d, generator=gen, dtype=torch.float64).to(dtype)
    k, v = (torch.randn(b, hkv, t, d, generator=gen, dtype=torch.float64).to(dtype) for _ in range(2))
    kc, vc = (torch.randn(b, hkv, c, d, generator=gen, dtype=torch.float64).to(dtype) for _ in range(2))
    lw = torch.zeros(b, hkv, c, dtype=torch.float32)
    lw[:, :, 1] = math.log(3.0)                                     # a merged entry
    lw[0, :, c - 2:] = EMPTY                                        # empty slots
    position = torch.arange(c).expand(b, hkv, c).clone()
    position[0, :, c - 2:] = -1
    pad = torch.tensor([0, 2, t - 1])
    pos = c + (torch.arange(t)[None, :] - pad[:, None]).clamp(min=0)
    return q, k, pad, kc, lw, position, pos, v, vc


def _loop(q, k, pad, kc, lw, position, pos, window, softcap):
    """max over the group's heads and real rows of softmax(logits over cache + chunk) at each cache slot, float64."""
    b, hq, t, _ = q.shape
    hkv, c = kc.shape[1:3]
    out = torch.zeros(b, hkv, c, dtype=torch.float64)
    for bi in range(b):
        for h in range(hq):
            g = h // (hq // hkv)
            for i in range(int(pad[bi]), t):
                keys, allowed = [], []
                for s in range(c):
                    x = SCALE * float(q[bi, h, i] @ kc[bi, g, s])
                    x = softcap * math.tanh(x / softcap) if softcap else x
                    ok = lw[bi, g, s] > EMPTY and (window is None or pos[bi, i] - position[bi, g, s] < window)
                    keys.append(x + float(lw[bi, g, s]))
                    allowed.append(ok)
                for j in range(t):
                    x = SCALE * float(q[bi, h, i] @ k[bi, g, j])
                    x = softcap * math.tanh(x / softcap) if softcap else x
                    keys.append(x)
                    allowed.append(int(pad[bi]) <= j <= i and (window is None or i - j < window))
                m = max(x for x, ok in zip(keys, allowed, strict=True) if ok)
                z = sum(math.exp(x - m) for x, ok in zip(keys, allowed, strict=True) if ok)
                for s in range(c):
                    if allowed[s]:
                        out[bi, g, s] = max(out[bi, g, s], math.exp(keys[s] - m) / z)
    return out


@pytest.mark.parametrize("hq, hkv, window, softcap", [(4, 2, None, None), (2, 1, 5, None), (2, 2, None, 20.0)])
def test_reference_equals_the_loop(hq, hkv, window, softcap):
    args = _case(hq, hkv, 7, 5, seed=hq + hkv)
    got = chunk_attention_max_reference(*args[:7], SCALE, window, softcap)
    want = _loop(*args[:7], window, softcap)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert got[0, :, -2:].abs().max() == 0 and got.max() > 0.05


@pytest.mark.parametrize("hq, hkv, c, t", [(4, 2, 37, 5), (2, 1, 130, 9), (3, 3, 5, 70)])
def test_triton_cache_pass_equals_the_reference(hq, hkv, c, t, triton_device):
    q, k, pad, kc, lw, position, pos, v, vc = _case(hq, hkv, c, t, seed=c, dtype=torch.float32)
    _, lse = chunk_attention_reference(q, k, v, pad, kc, vc, lw, position, pos, SCALE)
    want = chunk_attention_max_reference(*(x.double() if x.is_floating_point() and x is not lw else x
                                           for x in (q, k, pad, kc, lw, position, pos)), SCALE)
    dev = [x.to(triton_device) for x in (q, kc, lw, lse)]
    got = cache_attention_max_triton(*dev, SCALE).cpu()
    torch.testing.assert_close(got.double(), want, rtol=2e-4, atol=1e-6)
    routed = chunk_attention_max_cuda(*(x.to(triton_device) for x in (q, k, pad, kc, lw, position, pos)), SCALE,
                                      lse=lse.to(triton_device)).cpu()
    torch.testing.assert_close(routed, got)
