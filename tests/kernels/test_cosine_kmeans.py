"""kvpass::cosine_kmeans_assign and kvpass::cosine_kmeans_update (ClusterKV's K-means, docs/policies.md §2.4):
Triton against the float64 references on fresh random inputs (CPU through TRITON_INTERPRET, small
shapes; CUDA at real shapes in bf16), ties, empty clusters and ragged rows, and the references against
loops over the spec."""

from __future__ import annotations

import pytest
import torch

from kvpass.kernels.cosine_kmeans_assign import (
    cosine_kmeans_assign,
    cosine_kmeans_assign_reference,
    cosine_kmeans_assign_triton,
)
from kvpass.kernels.cosine_kmeans_update import (
    cosine_kmeans_update,
    cosine_kmeans_update_reference,
    cosine_kmeans_update_triton,
)

# the interpreter evaluates both sides of tl.where: 0-division warnings in masked lanes
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _case(b, hkv, n, k, d, seed, dtype=torch.float32):
    """Keys, centroids, ragged valid rows (sinks and a per-row length) and a few unusable centroids."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, hkv, n, d, generator=gen).to(dtype)
    mu = torch.randn(b, hkv, k, d, generator=gen)
    length = torch.randint(n // 2, n + 1, (b, hkv), generator=gen)
    valid = (torch.arange(n) >= 2) & (torch.arange(n) < length[..., None])
    usable = torch.rand(b, hkv, k, generator=gen) < 0.8
    usable[..., 0] = True
    return x, mu, valid, usable


def _cos(x, mu):
    xn = torch.nn.functional.normalize(x.double(), dim=-1, eps=1e-6)
    return xn @ torch.nn.functional.normalize(mu.double(), dim=-1, eps=1e-6).transpose(-1, -2)


def _check_assign(got, want, x, mu, usable, tol):
    """Same -1 pattern; where an index differs (a near tie) the picked centroid's exact cosine is within tol."""
    got = got.to(want.device)
    assert torch.equal(got == -1, want == -1)
    cos = _cos(x, mu).masked_fill(~usable[:, :, None], float("-inf"))
    has = want >= 0
    best = torch.gather(cos, -1, want.clamp(min=0)[..., None])[..., 0]
    picked = torch.gather(cos, -1, got.clamp(min=0)[..., None])[..., 0]
    assert ((best - picked)[has] <= tol).all()
    assert (got == want)[has].float().mean() > 0.95


@pytest.mark.parametrize("n, k", [(7, 3), (37, 5), (70, 40)])
@pytest.mark.parametrize("d", [16, 24])
def test_assign_matches_reference(n, k, d, triton_device):
    x, mu, valid, usable = _case(2, 2, n, k, d, seed=n * 13 + k + d)
    want = cosine_kmeans_assign_reference(x.double(), mu.double(), valid, usable)
    dev = torch.device(triton_device)
    got = cosine_kmeans_assign_triton(x.to(dev), mu.to(dev), valid.to(dev), usable.to(dev), block_n=16, block_k=16)
    _check_assign(got, want, x, mu, usable, 1e-6)
    assert (want == -1).any() and (want >= 0).any()


def test_assign_ties_empty_rows_and_defaults(triton_device):
    """Duplicate centroids (lowest index wins across tiles), a row with no usable centroid (label 0, as
    torch.argmax), a head with no valid key (all -1), a zero key, and valid/usable left out."""
    x, mu, valid, usable = _case(1, 3, 40, 36, 16, seed=7)
    mu[0, 0, 20] = mu[0, 0, 3]                                     # same centroid in two 16-wide tiles
    mu[0, 0, 5] = mu[0, 0, 3]                                      # and twice in the first tile
    x[0, 0, 10:14] = mu[0, 0, 3] * 2.0                             # keys that pick exactly that centroid
    usable[0, 0, [3, 5, 20]] = True
    x[0, 0, 15] = 0.0                                              # cos 0 with every centroid: lowest usable
    usable[0, 1] = False                                           # no usable centroid
    valid[0, 2] = False                                            # no valid key
    valid[0, 0, 10:16] = True
    dev = torch.device(triton_device)
    want = cosine_kmeans_assign_reference(x.double(), mu.double(), valid, usable)
    got = cosine_kmeans_assign_triton(x.to(dev), mu.to(dev), valid.to(dev), usable.to(dev),
                                      block_n=16, block_k=16).cpu()
    assert got[0, 0, 10:14].tolist() == [3] * 4
    assert int(got[0, 0, 15]) == int(usable[0, 0].nonzero()[0])
    assert set(got[0, 1].unique().tolist()) <= {-1, 0}
    assert (got[0, 2] == -1).all()
    assert torch.equal(got, want)
    plain = cosine_kmeans_assign_triton(x.to(dev), mu.to(dev), block_n=16, block_k=16).cpu()
    assert torch.equal(plain, cosine_kmeans_assign_reference(x.double(), mu.double()))
    assert (plain >= 0).all()


def test_assign_bf16(triton_device):
    x, mu, valid, usable = _case(1, 2, 50, 9, 16, seed=3, dtype=torch.bfloat16)
    want = cosine_kmeans_assign_reference(x.double(), mu.double(), valid, usable)
    dev = torch.device(triton_device)
    got = cosine_kmeans_assign_triton(x.to(dev), mu.to(dev), valid.to(dev), usable.to(dev), block_n=16, block_k=16)
    _check_assign(got, want, x, mu, usable, 5e-3)


def test_assign_reference_is_the_spec():
    """label_i = argmax over usable c of cos(x_i, mu_c), ties to the lowest c, -1 where not valid (loops)."""
    x, mu, valid, usable = _case(1, 2, 30, 6, 8, seed=11, dtype=torch.float64)
    mu = mu.double()
    got = cosine_kmeans_assign(x, mu, valid, usable)
    for h in range(2):
        for i in range(30):
            if not valid[0, h, i]:
                assert int(got[0, h, i]) == -1
                continue
            cands = [c for c in range(6) if usable[0, h, c]]
            a = x[0, h, i]
            best = max(cands, key=lambda c, a=a: (float(a @ mu[0, h, c]) / float(a.norm() * mu[0, h, c].norm()), -c))
            assert int(got[0, h, i]) == best


def _labels(b, hkv, n, k, seed, empty=(1,)):
    """Random labels in [-1, K), never using the clusters in ``empty``."""
    gen = torch.Generator().manual_seed(seed)
    lab = torch.randint(-1, k, (b, hkv, n), generator=gen)
    for c in empty:
        lab = torch.where(lab == c, -1, lab)
    return lab


@pytest.mark.parametrize("n, k", [(9, 3), (37, 5), (64, 20)])
@pytest.mark.parametrize("d", [16, 24])
def test_update_matches_reference(n, k, d, triton_device):
    x, mu, _, _ = _case(2, 2, n, k, d, seed=n * 7 + k + d)
    labels = _labels(2, 2, n, k, seed=n + k)
    labels[1, 1] = -1                                              # a head with no member at all
    want_mu, want_size = cosine_kmeans_update_reference(x.double(), labels, mu.double())
    dev = torch.device(triton_device)
    got_mu, got_size = cosine_kmeans_update_triton(x.to(dev), labels.to(dev), mu.to(dev), block_m=8)
    assert got_mu.dtype == torch.float32 and got_size.dtype == torch.int64
    assert torch.equal(got_size.cpu(), want_size)
    torch.testing.assert_close(got_mu.cpu().double(), want_mu, rtol=1e-5, atol=1e-5)
    empty = want_size == 0
    assert empty[:, :, 1].all() and empty[1, 1].all()
    assert torch.equal(got_mu.cpu()[empty], mu[empty])             # empty clusters keep their centroid
    assert not torch.allclose(got_mu.cpu()[~empty], mu[~empty])    # the others moved


def test_update_one_big_cluster_bf16(triton_device):
    """Every valid key in one cluster (the longest segment, several BLOCK_M blocks), bf16 keys."""
    x, mu, _, _ = _case(1, 2, 45, 4, 16, seed=5, dtype=torch.bfloat16)
    labels = torch.full((1, 2, 45), 2)
    labels[..., :3] = -1
    want_mu, want_size = cosine_kmeans_update_reference(x.double(), labels, mu.double())
    dev = torch.device(triton_device)
    got_mu, got_size = cosine_kmeans_update_triton(x.to(dev), labels.to(dev), mu.to(dev), block_m=8)
    assert want_size[0, :, 2].tolist() == [42, 42]
    assert torch.equal(got_size.cpu(), want_size)
    torch.testing.assert_close(got_mu.cpu().double(), want_mu, rtol=1e-5, atol=1e-5)


def test_update_reference_is_the_spec():
    """mu'_c = mean of the raw (unnormalised) member keys; an empty cluster keeps mu_c (loops)."""
    x, mu, _, _ = _case(1, 2, 25, 4, 6, seed=9, dtype=torch.float64)
    mu = mu.double()
    labels = _labels(1, 2, 25, 4, seed=2, empty=(3,))
    new, size = cosine_kmeans_update(x, labels, mu)
    for h in range(2):
        for c in range(4):
            members = (labels[0, h] == c).nonzero().flatten()
            assert int(size[0, h, c]) == len(members)
            want = x[0, h, members].mean(0) if len(members) else mu[0, h, c]
            torch.testing.assert_close(new[0, h, c], want)


def test_ops_are_registered_with_fakes():
    x, mu, valid, usable = _case(1, 2, 12, 3, 8, seed=1)
    labels = cosine_kmeans_assign_reference(x, mu, valid, usable)
    torch.library.opcheck(torch.ops.kvpass.cosine_kmeans_assign.default, (x, mu, valid, usable),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.kvpass.cosine_kmeans_update.default, (x, labels, mu),
                          test_utils=("test_schema", "test_faketensor"))
    with pytest.raises(ValueError, match="centroids"):
        cosine_kmeans_assign_triton(x, mu[..., :4])
    with pytest.raises(ValueError, match="labels"):
        cosine_kmeans_update_triton(x, labels.float(), mu)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: real shapes in bf16")
def test_kmeans_ops_at_real_shapes_bf16():
    """Llama-3.1-8B heads (Hkv 8, D 128), 32k keys, C0 = 32768 / 80 = 410 clusters, bf16 keys, fp32
    centroids (as the policy); the dispatched (Triton) ops against the float64 references."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    b, hkv, n, k, d = 1, 8, 32768, 410, 128
    x = torch.randn(b, hkv, n, d, device=dev, generator=gen).to(torch.bfloat16)
    mu = x[:, :, torch.randperm(n, device=dev, generator=gen)[:k]].float()
    length = torch.randint(n // 2, n + 1, (b, hkv), device=dev, generator=gen)
    valid = (torch.arange(n, device=dev) >= 16) & (torch.arange(n, device=dev) < length[..., None])
    usable = torch.ones(b, hkv, k, dtype=torch.bool, device=dev)
    usable[..., -5:] = False
    got = torch.ops.kvpass.cosine_kmeans_assign(x, mu, valid, usable)
    want = cosine_kmeans_assign_reference(x.double(), mu.double(), valid, usable)
    _check_assign(got, want, x, mu, usable, 3e-3)                  # tf32 products: near ties may flip
    new, size = torch.ops.kvpass.cosine_kmeans_update(x, want, mu)
    want_new, want_size = cosine_kmeans_update_reference(x.double(), want, mu.double())
    assert new.dtype == torch.float32 and torch.equal(size, want_size)
    torch.testing.assert_close(new.double(), want_new, rtol=1e-4, atol=1e-4)
