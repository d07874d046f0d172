"""chunk_attention, chunk_column_sums, chunk_window_scores (chunked prefill): over a cache holding a prompt's
uncompressed prefix they give the prefill's own rows, columns and window scores of the whole prompt (pads, GQA,
window, softcap; float64); over a compressed cache (a merged entry's log-weight, an evicted entry, empty slots)
they equal an element-by-element float64 loop; with an empty cache they are the prefill ops; the CUDA paths
(Triton cache passes merged by log-sum-exp) equal the references under the interpreter."""

from __future__ import annotations

import math

import pytest
import torch

from kvpass.cache import entries_from_prompt, with_capacity
from kvpass.kernels import (
    attention_column_sums_reference,
    attention_window_scores_reference,
    chunk_attention_reference,
    chunk_column_sums_reference,
    chunk_window_scores_reference,
    prefill_attention_lse_reference,
)
from kvpass.kernels.chunk_attention import cache_attention_triton, chunk_attention_cuda
from kvpass.kernels.chunk_column_sums import cache_column_sums_triton, chunk_column_sums_cuda
from kvpass.kernels.prefill_attention import prefill_mask

# the interpreter evaluates both sides of tl.where: log2(0) / 0-division warnings in masked lanes
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

SCALE = 0.3
CASES = [(4, 2, None, None), (3, 1, 6, None), (2, 2, None, 20.0), (4, 1, 4, 10.0)]   # Hq, Hkv, window, softcap


def _prompt(hq: int, hkv: int, n: int, seed: int, dtype=torch.float64):
    """q, k, v [3, H, n, 16] and left pads [0, 5, 15]."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(3, h, n, 16, generator=gen, dtype=torch.float64).to(dtype) for h in (hq, hkv, hkv))
    return q, k, v, torch.tensor([0, 5, 15])


def _split(q, k, v, pad, prefix: int, spare: int = 3):
    """The chunk after ``prefix`` columns and the cache of the prefix's real tokens (``spare`` empty slots)."""
    n = q.shape[2]
    pos = (torch.arange(n)[None, :] - pad[:, None]).clamp(min=0)
    cache = with_capacity(entries_from_prompt(k[:, :, :prefix], v[:, :, :prefix], pad.clamp(max=prefix), {}),
                          prefix + spare)
    chunk_pad = (pad - prefix).clamp(min=0, max=n - prefix)
    return (q[:, :, prefix:], k[:, :, prefix:], v[:, :, prefix:], chunk_pad), cache, pos[:, prefix:]


def _cache_columns(got: torch.Tensor, whole: torch.Tensor, pad: torch.Tensor, prefix: int, capacity: int):
    """Pairs (got, want) of ``got`` [B, Hkv, capacity + T] (cache slots, then the chunk) against ``whole``
    [B, Hkv, n] laid out as the padded prompt: a row's cache slot s is prompt column pad + s."""
    for b in range(got.shape[0]):
        live = max(prefix - int(pad[b]), 0)
        yield got[b, :, :live], whole[b, :, int(pad[b]):prefix]
        yield got[b, :, live:capacity], torch.zeros_like(got[b, :, live:capacity])
        yield got[b, :, capacity:], whole[b, :, prefix:]


@pytest.mark.parametrize("hq, hkv, window, softcap", CASES)
def test_over_an_uncompressed_prefix_it_is_the_prompts_prefill(hq, hkv, window, softcap):
    q, k, v, pad = _prompt(hq, hkv, 22, seed=hq + hkv)
    prefix = 13
    (qc, kc, vc, cpad), cache, pos = _split(q, k, v, pad, prefix)
    args = (qc, kc, cpad, cache.k, cache.log_weight, cache.position, pos, SCALE, window, softcap)
    o, lse = chunk_attention_reference(qc, kc, vc, cpad, cache.k, cache.v, cache.log_weight, cache.position, pos,
                                       SCALE, window, softcap)
    o_all, lse_all = prefill_attention_lse_reference(q, k, v, pad, SCALE, window, softcap)
    real = (torch.arange(9)[None, :] >= cpad[:, None])[:, None, :]
    assert cache.length[2].sum() == 0 and real[2].sum() == 7 and real[1].all()   # row 2: no cache, 2 pad rows
    torch.testing.assert_close(o * real[..., None], o_all[:, :, prefix:] * real[..., None], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse, lse_all[:, :, prefix:].float(), rtol=1e-6, atol=1e-5)
    assert torch.isinf(lse[2, :, :2]).all() and (lse[2, :, :2] > 0).all()      # pad rows: +inf, as the prefill's
    # the columns of the chunk's rows of the prompt's attention (float64, every real row of the chunk)
    group = hq // hkv
    s = q @ k.repeat_interleave(group, 1).transpose(-1, -2) * SCALE
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    p = torch.softmax(s.masked_fill(~prefill_mask(pad, 22, window), float("-inf")), -1)
    p = p * (torch.arange(22)[None, :] >= pad[:, None])[:, None, :, None]
    columns = p[:, :, prefix:].sum(2).reshape(3, hkv, group, 22).mean(2)
    got = chunk_column_sums_reference(*args)
    for g, w in _cache_columns(got, columns, pad, prefix, cache.capacity):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-12)
    # the chunk's last 4 rows are the prompt's last 4: SnapKV's window scores of the whole prompt
    scores = chunk_window_scores_reference(*args, obs_window=4, kernel=3, pool="avg")
    whole = attention_window_scores_reference(q, k, pad, SCALE, window, softcap, obs_window=4, kernel=3)
    for g, w in _cache_columns(scores, whole, pad, prefix, cache.capacity):
        torch.testing.assert_close(g, w.to(g.dtype), rtol=1e-6, atol=1e-7)


def _loop_reference(q, k, v, pad, kc, vc, lw, position, pos, i_rows, window):
    """o [B, Hq, D] and column sums [B, Hkv, C + T] of the query rows ``i_rows``, element by element in float64."""
    b_n, hq, t, d = q.shape
    hkv, c = kc.shape[1], kc.shape[2]
    group = hq // hkv
    o = torch.zeros(b_n, hq, len(i_rows), d, dtype=torch.float64)
    col = torch.zeros(b_n, hkv, c + t, dtype=torch.float64)
    for b in range(b_n):
        for h in range(hq):
            g = h // group
            for r, i in enumerate(i_rows):
                if i < pad[b]:
                    continue
                logits, values, cols = [], [], []
                for s in range(c):
                    if lw[b, g, s] > -math.inf and (window is None or pos[b, i] - position[b, g, s] < window):
                        logits.append(SCALE * float(q[b, h, i] @ kc[b, g, s]) + float(lw[b, g, s]))
                        values.append(vc[b, g, s])
                        cols.append(s)
                for j in range(t):
                    if pad[b] <= j <= i and (window is None or i - j < window):
                        logits.append(SCALE * float(q[b, h, i] @ k[b, g, j]))
                        values.append(v[b, g, j])
                        cols.append(c + j)
                p = torch.softmax(torch.tensor(logits, dtype=torch.float64), 0)
                o[b, h, r] = sum(pj * vj for pj, vj in zip(p, values, strict=True))
                for pj, j in zip(p, cols, strict=True):
                    col[b, g, j] += pj / group
    return o, col


@pytest.mark.parametrize("window", [None, 3])
def test_over_a_compressed_cache_it_is_the_elementwise_definition(window):
    gen = torch.Generator().manual_seed(7)
    b, hq, hkv, t, c, d = 2, 4, 2, 5, 6, 8
    q, k, v = (torch.randn(b, h, t, d, generator=gen, dtype=torch.float64) for h in (hq, hkv, hkv))
    kc, vc = (torch.randn(b, hkv, c, d, generator=gen, dtype=torch.float64) for _ in range(2))
    # live slots [0, length) in sequence order with a gap (an evicted position), one merged entry, empty tails
    length = torch.tensor([[4, 2], [5, 0]])
    position = torch.tensor([0, 1, 3, 4, 6, 7])[None, None].repeat(b, hkv, 1)
    live = torch.arange(c)[None, None] < length[..., None]
    lw = torch.where(live, 0.0, -math.inf)
    lw[0, 0, 1] = math.log(3.0)                                       # stands for 3 merged tokens
    position = torch.where(live, position, -1)
    pad = torch.tensor([0, 2])
    pos = torch.tensor([[8, 9, 10, 11, 12], [0, 0, 8, 9, 10]])
    o, _ = chunk_attention_reference(q, k, v, pad, kc, vc, lw, position, pos, SCALE, window)
    want_o, want_col = _loop_reference(q, k, v, pad, kc, vc, lw, position, pos, range(t), window)
    real = (torch.arange(t)[None, :] >= pad[:, None])[:, None, :, None]
    torch.testing.assert_close(o * real, want_o * real, rtol=1e-10, atol=1e-12)
    col = chunk_column_sums_reference(q, k, pad, kc, lw, position, pos, SCALE, window)
    torch.testing.assert_close(col, want_col, rtol=1e-10, atol=1e-12)
    assert (col[1, 1, :c] == 0).all() and (col[0, 1, 2:c] == 0).all()       # empty slots get nothing
    # the window of the last two rows, unpooled: their attention on every key before them
    scores = chunk_window_scores_reference(q, k, pad, kc, lw, position, pos, SCALE, window, obs_window=2, kernel=1)
    _, last = _loop_reference(q, k, v, pad, kc, vc, lw, position, pos, range(t - 2, t), window)
    key_pos = torch.cat([position, pos[:, None].expand(b, hkv, t)], -1)
    before = (pos[:, -1, None, None] - key_pos) >= 2
    torch.testing.assert_close(scores, last * before, rtol=1e-10, atol=1e-12)


def test_with_an_empty_cache_it_is_the_prefill_ops():
    q, k, v, pad = _prompt(4, 2, 11, seed=3)
    none = torch.zeros(3, 2, 0, 16, dtype=torch.float64)
    empty = (none, none, torch.zeros(3, 2, 0), torch.zeros(3, 2, 0, dtype=torch.long))
    pos = (torch.arange(11)[None, :] - pad[:, None]).clamp(min=0)
    pad = pad.clamp(max=11)
    o, lse = chunk_attention_reference(q, k, v, pad, *empty, pos, SCALE)
    o_p, lse_p = prefill_attention_lse_reference(q, k, v, pad, SCALE)
    real = (torch.arange(11)[None, :] >= pad[:, None])[:, None, :, None]
    torch.testing.assert_close(o * real, o_p * real, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, lse_p.float())
    cols = chunk_column_sums_reference(q, k, pad, empty[0], empty[2], empty[3], pos, SCALE)
    torch.testing.assert_close(cols, attention_column_sums_reference(q, k, pad, SCALE), rtol=1e-10, atol=1e-12)
    scores = chunk_window_scores_reference(q, k, pad, empty[0], empty[2], empty[3], pos, SCALE, obs_window=3,
                                           kernel=5, pool="max")
    want = attention_window_scores_reference(q, k, pad, SCALE, obs_window=3, kernel=5, pool="max")
    torch.testing.assert_close(scores, want.to(scores.dtype), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("hq, hkv", [(4, 2), (3, 1)])
def test_cuda_paths_equal_the_references(dtype, tol, hq, hkv, triton_device):
    q, k, v, pad = _prompt(hq, hkv, 40, seed=11, dtype=dtype)
    pad = torch.tensor([0, 5, 25])
    (qc, kc, vc, cpad), cache, pos = _split(q, k, v, pad, 21, spare=5)
    cache.log_weight[0, 0, 2] = 0.7                                   # a merged entry's bias
    on = lambda *xs: [x.to(triton_device) for x in xs]                # noqa: E731
    args = on(qc, kc, vc, cpad, cache.k, cache.v, cache.log_weight, cache.position, pos)
    want_o, want_lse = chunk_attention_reference(*args, SCALE)
    got_o, got_lse = chunk_attention_cuda(*args, SCALE)
    real = (torch.arange(19)[None, :] >= cpad[:, None])[:, None, :, None].to(triton_device)
    err = ((got_o.double() - want_o.double()) * real).norm() / (want_o.double() * real).norm()
    assert err < tol, f"o: relative error {err:.2e}"
    torch.testing.assert_close(got_lse, want_lse, rtol=1e-4, atol=1e-4)
    col_args = on(qc, kc, cpad, cache.k, cache.log_weight, cache.position, pos)
    want = chunk_column_sums_reference(*col_args, SCALE)
    torch.testing.assert_close(chunk_column_sums_cuda(*col_args, SCALE, lse=got_lse), want, rtol=tol, atol=tol)
    # the cache part alone: a row of a KV head without a live slot gets o = 0 and lse = -inf
    lw = cache.log_weight.clone()
    lw[1, 0] = float("-inf")
    o_cache, lse_cache = cache_attention_triton(*on(qc, cache.k, cache.v, lw), SCALE)
    assert torch.isneginf(lse_cache[1, :hq // hkv]).all() and (o_cache[1, :hq // hkv] == 0).all()
    cols = cache_column_sums_triton(*on(qc, cache.k, lw, want_lse), SCALE)
    assert (cols[1, 0] == 0).all() and cols.shape == (3, hkv, cache.capacity)
