"""lowest_slots (kvpass/kernels/lowest_slots.py): the Triton picks against the stable sort that defines them."""

from __future__ import annotations

import pytest
import torch

from kvpass.kernels.lowest_slots import lowest_slots_reference, lowest_slots_triton


@pytest.mark.parametrize("c", [1, 7, 37, 300])
@pytest.mark.parametrize("seed", range(3))
def test_triton_picks_the_stable_sort_order_with_ties(c: int, seed: int, triton_device) -> None:
    """fp32 keys drawn from few values (many ties, broken by the lower slot) with +inf among them, int64
    keys with the dtype's largest value (the kernel's masked-lane sentinel) among them, and int64 keys over the
    whole range (``priority_key``'s: fp32 bits in the high half, a position in the low one)."""
    gen = torch.Generator().manual_seed(seed)
    dev = torch.device(triton_device)
    f = torch.randint(0, 5, (2, 3, c), generator=gen).float()
    f[torch.rand(2, 3, c, generator=gen) < 0.2] = float("inf")
    i = torch.randint(-3, 4, (2, 3, c), generator=gen)
    i[torch.rand(2, 3, c, generator=gen) < 0.3] = torch.iinfo(torch.int64).max
    wide = torch.randint(-2 ** 31, 2 ** 31, (2, 3, c), generator=gen) * 2 ** 32 + torch.randint(0, 4, (2, 3, c), generator=gen)
    for key in (f, i, torch.randn(2, 3, c, generator=gen), wide):
        for k in sorted({0, 1, min(5, c), c}):
            got = lowest_slots_triton(key.to(dev), k).cpu()
            assert got.shape == (2, 3, k) and got.dtype == torch.long
            assert torch.equal(got, lowest_slots_reference(key, k)), f"{key.dtype}, C={c}, k={k}"


def test_the_op_and_bad_input(triton_device) -> None:
    """The registered op gives the reference's slots on the device; k > C and a float64 key raise."""
    dev = torch.device(triton_device)
    key = torch.tensor([[3.0, 1.0, 2.0, 1.0, 0.5]])
    assert torch.ops.kvpass.lowest_slots(key.to(dev), 3).cpu().tolist() == [[4, 1, 3]]
    with pytest.raises(ValueError, match="0 <= k <= C"):
        lowest_slots_triton(key.to(dev), 6)
    with pytest.raises(ValueError, match="float32 or int64"):
        lowest_slots_triton(key.double().to(dev), 2)
