from __future__ import annotations

import pytest
import torch

from kvpass.kernels.merge_weighted import merge_weighted, merge_weighted_reference, merge_weighted_triton

# the interpreter evaluates both sides of tl.where: log2(0) / 0-division warnings in masked lanes
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def random_merge_case(b: int, hkv: int, c: int, d: int, seed: int, dtype=torch.float32):
    """Random K/V/weights; about half the slots merge into a random kept slot; some slots empty (w = 0)."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(b, hkv, c, d, generator=gen).to(dtype)
    v = torch.randn(b, hkv, c, d, generator=gen).to(dtype)
    w = torch.rand(b, hkv, c, generator=gen) * 3 + 0.5
    w = w.masked_fill(torch.rand(b, hkv, c, generator=gen) < 0.1, 0.0)
    keep = torch.rand(b, hkv, c, generator=gen) < 0.5
    keep[..., 0] = True
    target = torch.full((b, hkv, c), -1, dtype=torch.int32)
    for i in range(b):
        for g in range(hkv):
            kept = keep[i, g].nonzero().flatten()
            src = (~keep[i, g]).nonzero().flatten()
            pick = kept[torch.randint(0, len(kept), (len(src),), generator=gen)]
            target[i, g, src] = pick.int()
    return k, v, w, target


def test_reference_on_a_hand_case():
    k = torch.tensor([[[[1.0], [3.0], [10.0], [5.0]]]])
    v = k * 2
    w = torch.tensor([[[1.0, 3.0, 2.0, 1.0]]])
    target = torch.tensor([[[-1, 0, -1, 2]]])
    ko, vo, lw = merge_weighted_reference(k, v, w, target)
    assert ko.flatten().tolist() == pytest.approx([(1 + 9) / 4, 3.0, (20 + 5) / 3, 5.0])
    torch.testing.assert_close(vo, ko * 2)
    assert lw.flatten().tolist() == pytest.approx([torch.log(torch.tensor(4.0)).item(), float("-inf"),
                                                   torch.log(torch.tensor(3.0)).item(), float("-inf")])


@pytest.mark.parametrize("hkv, c", [(1, 5), (2, 37), (3, 64)])     # odd C exercises the masks
@pytest.mark.parametrize("d", [16, 24])
def test_merge_weighted_matches_reference(hkv, c, d, triton_device):
    k, v, w, target = random_merge_case(2, hkv, c, d, seed=c * 7 + d)
    want = merge_weighted_reference(k.double(), v.double(), w, target)
    dev = torch.device(triton_device)
    got = merge_weighted_triton(k.to(dev), v.to(dev), w.to(dev), target.to(dev), block_j=16)
    for name, g, r in zip(("k", "v", "log_weight"), got, want, strict=True):
        torch.testing.assert_close(g.cpu().double(), r.double(), rtol=1e-5, atol=1e-5, msg=name)


def test_merge_weighted_bf16_and_one_big_segment(triton_device):
    """Every source into one target (the longest segment) in bf16."""
    k, v, w, _ = random_merge_case(1, 2, 33, 16, seed=1, dtype=torch.bfloat16)
    target = torch.full((1, 2, 33), 5, dtype=torch.int64)
    target[..., 5] = -1
    target[..., 20] = -1
    want = merge_weighted_reference(k.double(), v.double(), w, target)
    dev = torch.device(triton_device)
    got = merge_weighted_triton(k.to(dev), v.to(dev), w.to(dev), target.to(dev))
    for name, g, r in zip(("k", "v", "log_weight"), got, want, strict=True):
        torch.testing.assert_close(g.cpu().double(), r.double(), rtol=2e-2, atol=2e-2, msg=name)


def test_op_dispatches_and_validates(triton_device):
    k, v, w, target = random_merge_case(1, 1, 6, 16, seed=2)
    out = merge_weighted(k, v, w, target)
    torch.testing.assert_close(out[0], merge_weighted_reference(k, v, w, target)[0])
    with pytest.raises(ValueError, match="w must be float32"):
        merge_weighted_triton(k, v, w.double(), target)
    with pytest.raises(ValueError, match="target must be"):
        merge_weighted_triton(k, v, w, target.float())


def test_place_writes_each_row_where_it_says(triton_device):
    """With ``place`` (a random permutation of every row) each output row j lands at place[j]: the same
    rows as without it, permuted, from the reference and from the kernel."""
    k, v, w, target = random_merge_case(2, 3, 37, 16, seed=5)
    gen = torch.Generator().manual_seed(6)
    place = torch.stack([torch.stack([torch.randperm(37, generator=gen) for _ in range(3)]) for _ in range(2)])
    plain = merge_weighted_reference(k.double(), v.double(), w, target)
    placed = merge_weighted_reference(k.double(), v.double(), w, target, place)
    inverse = torch.argsort(place, dim=-1)                          # output row i holds input row inverse[i]
    for want, got in zip(plain, placed, strict=True):
        rows = inverse if want.dim() == 3 else inverse[..., None].expand_as(want)
        assert torch.equal(got, torch.gather(want, 2, rows))
    dev = torch.device(triton_device)
    got = merge_weighted_triton(k.to(dev), v.to(dev), w.to(dev), target.to(dev), place.to(dev), block_j=16)
    for name, g, r in zip(("k", "v", "log_weight"), got, placed, strict=True):
        torch.testing.assert_close(g.cpu().double(), r.double(), rtol=1e-5, atol=1e-5, msg=name)
    with pytest.raises(ValueError, match="place must be"):
        merge_weighted_triton(k, v, w, target, place.int())
