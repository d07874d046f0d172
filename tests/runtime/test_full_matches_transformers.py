"""`full` must reproduce plain transformers: same greedy tokens, logits within 1e-4 (float32)."""

from __future__ import annotations

import pytest
import torch

import kvpass
from tests.conftest import ARCHITECTURES, padded_batch, tiny_model

GEN = dict(max_new_tokens=64, do_sample=False, pad_token_id=0, eos_token_id=None,
           output_logits=True, return_dict_in_generate=True)


def assert_same_generation(model, kv_model, ids, mask) -> None:
    want = model.generate(ids, attention_mask=mask, **GEN)
    got = kv_model.generate(ids, attention_mask=mask, **GEN)
    assert torch.equal(got.sequences, want.sequences)
    assert len(got.logits) == len(want.logits) == GEN["max_new_tokens"]
    err = max((a.float() - b.float()).abs().max().item() for a, b in zip(got.logits, want.logits, strict=True))
    assert err < 1e-4, f"max logit difference {err}"


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("lengths", [[21], [21, 14, 9]], ids=["batch1", "batch3-left-padded"])
def test_full_matches_transformers(arch, lengths):
    model = tiny_model(arch)
    kv_model = kvpass.apply(model, policy="full")
    ids, mask = padded_batch(lengths)
    assert_same_generation(model, kv_model, ids, mask)


def test_full_differs_when_the_cache_is_wrong():
    """The equivalence check above can fail: corrupting one cached key changes the logits."""
    model = tiny_model("llama")
    kv_model = kvpass.apply(model, policy="full")
    ids, _ = padded_batch([21])
    clean = kv_model.start(ids, max_new_tokens=4)
    clean_logits = clean.step(torch.tensor([5]))
    broken = kv_model.start(ids, max_new_tokens=4)
    broken.layers[0].cache.k[:, :, 3] += 1.0
    assert (broken.step(torch.tensor([5])) - clean_logits).abs().max() > 1e-3


def test_positions_are_absolute_after_compression():
    """After streamingllm drops the middle, new tokens still get their absolute position: the
    decode logits equal a no-cache forward whose attention sees exactly the kept tokens."""
    model = tiny_model("llama")
    kv_model = kvpass.apply(model, policy="streamingllm", budget=12, sinks=4, interval=1)
    ids, _ = padded_batch([30])
    session = kv_model.start(ids, max_new_tokens=1)
    kept = session.layers[0].cache.position[0, 0, : int(session.layers[0].cache.length[0, 0])]
    assert kept.tolist() == [0, 1, 2, 3] + list(range(22, 30))
    # reference: the same tokens at their original positions, with attention limited to the kept ones
    tok = torch.tensor([7])
    got = session.step(tok)
    seq = torch.cat([ids, tok[None]], dim=1)
    pos = torch.arange(31)[None]
    keep = torch.zeros(31, 31, dtype=torch.bool)
    keep[:, :] = torch.ones(31, 31).tril().bool()
    keep[30] = False
    keep[30, kept] = True
    keep[30, 30] = True
    bias = torch.zeros(1, 1, 31, 31).masked_fill(~keep, float("-inf"))
    want = model(seq, position_ids=pos, attention_mask=bias, use_cache=False).logits[0, -1]
    assert torch.allclose(got[0], want, atol=1e-4)
