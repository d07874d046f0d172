"""kvpass::cluster_gather (ClusterKV's gather of the selected entries, docs/policies.md §2.6, §2.8): Triton
against the float64 reference on fresh random selections (CPU through TRITON_INTERPRET, small shapes;
CUDA at real shapes in bf16, device-resident and pinned host-resident K/V), ragged and empty rows,
truncation, and the reference against a loop over the spec."""

from __future__ import annotations

import pytest
import torch

from kvpass.kernels.cluster_gather import cluster_gather, cluster_gather_reference, cluster_gather_triton

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _case(b, hkv, group, c, d, seed, dtype=torch.float32, density=0.3):
    """K, V, log-weights (empty slots -inf) and a ragged selection: one row keeps nothing, one everything."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(b, hkv, c, d, generator=gen).to(dtype)
    v = torch.randn(b, hkv, c, d, generator=gen).to(dtype)
    lw = torch.randn(b, hkv, c, generator=gen)
    keep = torch.rand(b, hkv, group, c, generator=gen) < density
    keep[0, 0, 0] = False
    keep[-1, -1, -1] = True
    lw[0, -1, c // 2:] = float("-inf")
    keep[0, -1] &= lw[0, -1, None] > float("-inf")                   # a shorter (ragged) row: live slots only
    return k, v, lw, keep


def _spec(k, v, lw, keep, width):
    """Loop: the kept slots of each row in slot order, the first ``width``; zeros and -inf after."""
    b, hkv, group, c = keep.shape
    ks = torch.zeros(b, hkv, group, width, k.shape[-1], dtype=k.dtype)
    vs = torch.zeros_like(ks)
    ls = torch.full((b, hkv, group, width), float("-inf"))
    for i in range(b):
        for g in range(hkv):
            for j in range(group):
                slots = [s for s in range(c) if keep[i, g, j, s]][:width]
                for w, s in enumerate(slots):
                    ks[i, g, j, w], vs[i, g, j, w], ls[i, g, j, w] = k[i, g, s], v[i, g, s], lw[i, g, s]
    return ks, vs, ls


def _assert_equal(got, want):
    for name, g, w in zip(("k_sel", "v_sel", "lw_sel"), got, want, strict=True):
        assert g.shape == w.shape, name
        assert torch.equal(g.cpu().double(), w.cpu().double()), name


@pytest.mark.parametrize("c, group", [(5, 1), (37, 2), (70, 4)])
@pytest.mark.parametrize("d", [16, 24])
def test_gather_matches_reference(c, group, d, triton_device):
    k, v, lw, keep = _case(2, 2, group, c, d, seed=c * 5 + group + d)
    n = int(keep.sum(-1).max())
    dev = torch.device(triton_device)
    for width in (n, max(n // 2, 1)):                               # everything, and truncated rows
        want = cluster_gather_reference(k.double(), v.double(), lw, keep, width)
        got = cluster_gather_triton(k.to(dev), v.to(dev), lw.to(dev), keep.to(dev), width, block_w=8)
        _assert_equal(got, want)
        assert (want[2] == float("-inf")).any() and (want[2] > float("-inf")).any()


def test_gather_bf16_strided_and_empty(triton_device):
    """bf16 K/V viewed through a transpose (non-contiguous), and width 0."""
    k, v, lw, keep = _case(1, 3, 2, 40, 16, seed=4, dtype=torch.bfloat16)
    kt = k.transpose(1, 2).contiguous().transpose(1, 2)              # same values, strides of [B, C, Hkv, D]
    dev = torch.device(triton_device)
    n = int(keep.sum(-1).max())
    want = cluster_gather_reference(k.double(), v.double(), lw, keep, n)
    got = cluster_gather_triton(kt.to(dev), v.to(dev), lw.to(dev), keep.to(dev), n, block_w=16)
    assert got[0].dtype == torch.bfloat16
    _assert_equal(got, want)
    empty = cluster_gather_triton(k.to(dev), v.to(dev), lw.to(dev), keep.to(dev), 0)
    assert [tuple(t.shape) for t in empty] == [(1, 3, 2, 0, 16), (1, 3, 2, 0, 16), (1, 3, 2, 0)]


def test_reference_is_the_spec():
    k, v, lw, keep = _case(2, 2, 3, 23, 8, seed=8)
    n = int(keep.sum(-1).max())
    for width in (n, 3):
        _assert_equal(cluster_gather(k, v, lw, keep, width), _spec(k, v, lw, keep, width))


def test_op_is_registered_with_fake_and_checks_inputs():
    k, v, lw, keep = _case(1, 2, 2, 12, 8, seed=1)
    torch.library.opcheck(torch.ops.kvpass.cluster_gather.default, (k, v, lw, keep, 4),
                          test_utils=("test_schema", "test_faketensor"))
    with pytest.raises(ValueError, match="width"):
        cluster_gather_triton(k, v, lw, keep, 13)
    with pytest.raises(ValueError, match="keep"):
        cluster_gather_triton(k, v, lw, keep[:, :, :, :5], 2)
    with pytest.raises(ValueError, match="log_weight"):
        cluster_gather_triton(k, v, lw.double(), keep, 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: real shapes in bf16, pinned host memory")
@pytest.mark.parametrize("where", ["device", "pinned-host", "pageable-host"])
def test_gather_at_real_shapes_bf16(where):
    """Llama-3.1-8B heads (Hkv 8, G 4, D 128), 32k slots, ~1k selected per query head; K/V on the GPU,
    in pinned host memory (the Triton kernel reads them in place) or pageable (the reference path)."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    b, hkv, group, c, d = 1, 8, 4, 32768, 128
    k = torch.randn(b, hkv, c, d, device=dev, generator=gen).to(torch.bfloat16)
    v = torch.randn(b, hkv, c, d, device=dev, generator=gen).to(torch.bfloat16)
    lw = torch.zeros(b, hkv, c, device=dev)
    keep = torch.rand(b, hkv, group, c, device=dev, generator=gen) < 1100 / c
    keep[..., :16] = True                                          # sinks
    n = int(keep.sum(-1).max())
    want = cluster_gather_reference(k.double(), v.double(), lw, keep, n)
    if where != "device":
        k, v = k.cpu(), v.cpu()
        if where == "pinned-host":
            k, v = k.pin_memory(), v.pin_memory()
    got = torch.ops.kvpass.cluster_gather(k, v, lw, keep, n)
    assert all(t.device.type == "cuda" for t in got)
    _assert_equal(got, want)
