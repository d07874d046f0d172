"""Every registered policy over a quantized cache (``kvpass.apply(..., kv_dtype=...)``, docs/quantization.md):
80 greedy steps of 2 rows at budget 48 (several compressions), every step's logits finite, every compressed layer
within its budget + interval, every cache held as 8-bit codes with finite scales, and the output not that of the
model-dtype cache (the codes are what is read)."""

from __future__ import annotations

import pytest
import torch

import kvpass
from kvpass.policies import POLICIES
from kvpass.quantization import SCALES, dequantize_cache, is_quantized
from kvpass.quantization.formats import code_dtype
from tests.runtime.test_bounded import BUDGET, SMALL, _model

STEPS = 80
PLAIN_STEPS = 4


def _run(policy: str, kv_dtype: str | None, steps: int = STEPS) -> tuple[list[torch.Tensor], object]:
    model = _model(torch.float32, STEPS + 64)
    kv = kvpass.apply(model, policy, BUDGET, kv_dtype=kv_dtype, **SMALL.get(policy, {}))
    ids = torch.randint(1, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    session = kv.start(ids, max_new_tokens=steps)
    feed = torch.randint(1, 128, (2, steps), generator=torch.Generator().manual_seed(2))
    logits = [session.logits]
    interval = getattr(kv.policy, "interval", 1)
    for step in range(steps):
        logits.append(session.step(feed[:, step]))
        for lay in session.layers:
            if kv_dtype is not None:
                assert is_quantized(lay.cache) and lay.cache.k.dtype == code_dtype(kv_dtype), (policy, step)
                assert all(torch.isfinite(lay.cache.slot_meta[n]).all() for n in SCALES), (policy, step)
            if lay.compressible:
                extra = max(lay.row_extra or [0])
                assert int(lay.cache.length.amax()) <= lay.budget + extra + interval, (policy, step)
    return logits, session


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_decodes_over_quantized_entries(policy: str, kv_dtype: str) -> None:
    logits, session = _run(policy, kv_dtype)
    assert all(torch.isfinite(x).all() for x in logits), policy
    for lay in session.layers:
        plain = dequantize_cache(lay.cache)
        live = (plain.log_weight > float("-inf"))[..., None]
        assert torch.isfinite(torch.where(live, plain.k, 0)).all() and torch.isfinite(torch.where(live, plain.v, 0)).all()
    report = session.report()
    assert report.kv_dtype == kv_dtype
    if session.owner.policy.compresses:
        assert report.compressions > 0, policy
    plain_logits, _ = _run(policy, None, steps=PLAIN_STEPS)           # the first steps: the codes are what is read
    assert not torch.allclose(torch.stack(logits[:PLAIN_STEPS + 1]), torch.stack(plain_logits), atol=1e-6), policy
