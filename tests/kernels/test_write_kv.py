"""write_kv: the Triton kernel writes what the reference writes (every row at its own slot, strided new
K, V as the graph passes them, the step's position per batch row) and nothing else; the CUDA op uses it."""

from __future__ import annotations

import pytest
import torch

from kvpass.kernels.write_kv import write_kv_reference, write_kv_triton


def _inputs(b: int, h: int, c: int, d: int, cache_dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(b, h, c, d, generator=gen).to(cache_dtype)
    v_cache = torch.randn(b, h, c, d, generator=gen).to(cache_dtype)
    log_weight = torch.where(torch.rand(b, h, c, generator=gen) < 0.5, float("-inf"), -torch.rand(b, h, c, generator=gen))
    slot = torch.randint(0, c, (b, h), generator=gen)
    position = torch.randint(-1, 1000, (b, h, c), generator=gen)
    pos = torch.randint(1000, 2000, (b, 1), generator=gen)
    # the graph's new K, V: [B, T=1, Hkv, D] projections (the cache's dtype) transposed to [B, Hkv, 1, D]
    k_new = torch.randn(b, 1, h, d, generator=gen).to(cache_dtype).transpose(1, 2)
    v_new = torch.randn(b, 1, h, d, generator=gen).to(cache_dtype).transpose(1, 2)
    return k_cache, v_cache, log_weight, slot, position, pos, k_new, v_new


MUTATED = ("k_cache", "v_cache", "log_weight", None, "position")


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b, h, c, d", [(1, 1, 5, 16), (3, 2, 9, 24)])
def test_triton_writes_what_the_reference_writes(b, h, c, d, cache_dtype, triton_device):
    args = _inputs(b, h, c, d, cache_dtype, seed=b * 10 + d)
    want = [t.clone() for t in args]
    write_kv_reference(*want)
    got = [t.to(triton_device, copy=True) for t in args]
    write_kv_triton(*got)
    for name, g, w, before in zip(MUTATED, got, want, args, strict=False):
        assert torch.equal(g.cpu(), w), name
        if name is not None:
            assert not torch.equal(w, before), name                 # the step changed something
    rows = torch.arange(b)[:, None].expand(b, h)
    assert torch.equal(want[4][rows, torch.arange(h)[None, :].expand(b, h), args[3]], args[5].expand(b, h))


def test_triton_takes_a_strided_int32_position(triton_device):
    """pos as a column of a wider int32 tensor: converted to int64 (a copy), read with the copy's stride."""
    args = list(_inputs(3, 2, 7, 16, torch.float32, seed=4))
    args[5] = torch.cat([args[5], torch.zeros_like(args[5])], dim=1).int()[:, :1]     # [B, 1], stride (2, 1)
    want = [t.clone() for t in args]
    write_kv_reference(*want)
    got = [t.to(triton_device, copy=True) for t in args]
    got[5] = torch.cat([args[5], torch.zeros_like(args[5])], dim=1).to(triton_device)[:, :1]
    write_kv_triton(*got)
    assert torch.equal(got[4].cpu(), want[4])


def test_triton_checks_shapes(triton_device):
    k_cache, v_cache, log_weight, slot, position, pos, k_new, v_new = (
        t.to(triton_device) for t in _inputs(2, 2, 6, 16, torch.float32, 0))
    with pytest.raises(ValueError, match="slot"):
        write_kv_triton(k_cache, v_cache, log_weight, slot[:, :1], position, pos, k_new, v_new)
    with pytest.raises(ValueError, match="position"):
        write_kv_triton(k_cache, v_cache, log_weight, slot, position.int(), pos, k_new, v_new)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_op_takes_the_kernel_and_matches_at_real_shapes(monkeypatch):
    import importlib

    module = importlib.import_module("kvpass.kernels.write_kv")
    calls = []
    kernel = module.write_kv_triton
    monkeypatch.setattr(module, "write_kv_triton", lambda *a: calls.append(1) or kernel(*a))
    args = [t.cuda() for t in _inputs(4, 8, 6555, 128, torch.bfloat16, 1)]
    want = [t.clone() for t in args]
    write_kv_reference(*want)
    torch.ops.kvpass.write_kv(*args)
    assert calls == [1]
    for g, w in zip(args[:5], want[:5], strict=True):
        assert torch.equal(g, w)
