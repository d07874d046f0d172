"""rope_write_kv: the one-launch RoPE of q and k plus the cache write against its reference (transformers'
rotation op for op, then write_kv's scatters) on fresh random inputs, and the op off CUDA."""

from __future__ import annotations

import pytest
import torch

from kvpass.kernels.rope_write_kv import rope_write_kv_reference, rope_write_kv_triton, rotate


def _case(b: int, hkv: int, group: int, c: int, d: int, dtype: torch.dtype, seed: int, rotary: int | None = None):
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype)  # noqa: E731
    cache = dict(k_cache=rnd(b, hkv, c, d), v_cache=rnd(b, hkv, c, d),
                 log_weight=torch.full((b, hkv, c), float("-inf")), slot=torch.randint(0, c, (b, hkv), generator=gen),
                 position=torch.full((b, hkv, c), -1, dtype=torch.long))
    angle = torch.rand(b, 1, 1, (rotary or d) // 2, generator=gen, dtype=torch.float64) * 100
    angle = torch.cat([angle, angle], -1)
    new = dict(pos=torch.randint(0, 1000, (b, 1), generator=gen), q=rnd(b, hkv * group, 1, d), k_new=rnd(b, hkv, 1, d),
               v_new=rnd(b, hkv, 1, d), cos=angle.cos().to(dtype), sin=angle.sin().to(dtype))
    return cache, new


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("b, hkv, group, c, d, rotary", [(1, 2, 4, 9, 16, 16), (2, 3, 1, 5, 64, 64), (2, 1, 3, 4, 8, 8),
                                                         (1, 2, 2, 6, 16, 12), (2, 1, 2, 5, 24, 6)])
def test_triton_matches_the_reference(b, hkv, group, c, d, rotary, dtype, triton_device):
    """q_rot and every cache tensor equal the reference's (bit for bit: the same roundings), on the device; a
    partial rotation (R < D, also D not a power of two) passes the rest through."""
    cache, new = _case(b, hkv, group, c, d, dtype, seed=b * 100 + d, rotary=rotary)
    want_cache = {n: t.clone() for n, t in cache.items()}
    want_q = rope_write_kv_reference(*want_cache.values(), *new.values())
    got_cache = {n: t.to(triton_device) for n, t in cache.items()}
    got_q = rope_write_kv_triton(*got_cache.values(), *(t.to(triton_device) for t in new.values()))
    assert got_q.shape == (b, hkv * group, 1, d) and got_q.dtype == dtype
    torch.testing.assert_close(got_q.cpu(), want_q, rtol=0, atol=0)
    for name in ("k_cache", "v_cache", "log_weight", "position"):
        torch.testing.assert_close(got_cache[name].cpu(), want_cache[name], rtol=0, atol=0, msg=name)


def test_reference_is_transformers_rotation_and_write_kv():
    """The reference: transformers' ``apply_rotary_pos_emb`` on q and k, then write_kv (bf16, op for op)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cache, new = _case(2, 2, 3, 6, 16, torch.bfloat16, seed=5)
    want_q, want_k = apply_rotary_pos_emb(new["q"], new["k_new"], new["cos"][:, 0], new["sin"][:, 0])
    got_q = torch.ops.kvpass.rope_write_kv(*cache.values(), *new.values())
    assert torch.equal(got_q, want_q)
    slot = cache["slot"]
    for bb in range(2):
        for g in range(2):
            assert torch.equal(cache["k_cache"][bb, g, slot[bb, g]], want_k[bb, g, 0])
            assert torch.equal(cache["v_cache"][bb, g, slot[bb, g]], new["v_new"][bb, g, 0])
            assert int(cache["position"][bb, g, slot[bb, g]]) == int(new["pos"][bb, 0])
            assert float(cache["log_weight"][bb, g, slot[bb, g]]) == 0.0
    assert torch.equal(rotate(new["k_new"], new["cos"], new["sin"]), want_k)


def test_partial_reference_is_phi3s_rotation():
    """R < D: the reference is transformers' Phi-3 rotation (rotate the first R features, pass the rest), op for op."""
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    _, new = _case(2, 2, 2, 4, 16, torch.bfloat16, seed=6, rotary=12)
    want_q, want_k = apply_rotary_pos_emb(new["q"], new["k_new"], new["cos"][:, 0], new["sin"][:, 0])
    assert torch.equal(rotate(new["q"], new["cos"], new["sin"]), want_q)
    assert torch.equal(rotate(new["k_new"], new["cos"], new["sin"]), want_k)


def test_triton_refuses_odd_shapes(triton_device):
    cache, new = _case(1, 2, 2, 4, 8, torch.float32, seed=0)
    cache = {n: t.to(triton_device) for n, t in cache.items()}
    new = {n: t.to(triton_device) for n, t in new.items()}
    with pytest.raises(ValueError, match="cos, sin"):
        rope_write_kv_triton(*cache.values(), *{**new, "cos": new["cos"][..., :4]}.values())
    with pytest.raises(ValueError, match="q \\[B, G Hkv"):
        rope_write_kv_triton(*cache.values(), *{**new, "q": new["q"][:, :3]}.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_at_the_8b_shape():
    """bf16 at Llama-3.1-8B's decode shape (8 KV heads, groups of 4, D 128): the kernel rounds as eager."""
    cache, new = _case(1, 8, 4, 300, 128, torch.bfloat16, seed=3)
    want_cache = {n: t.clone() for n, t in cache.items()}
    want_q = rope_write_kv_reference(*want_cache.values(), *new.values())
    got_cache = {n: t.cuda() for n, t in cache.items()}
    got_q = torch.ops.kvpass.rope_write_kv(*got_cache.values(), *(t.cuda() for t in new.values()))
    torch.testing.assert_close(got_q.cpu(), want_q, rtol=0, atol=0)
    for name in want_cache:
        torch.testing.assert_close(got_cache[name].cpu(), want_cache[name], rtol=0, atol=0, msg=name)
