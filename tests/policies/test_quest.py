"""Quest (docs/policies.md §6.6): page summaries, page selection against a float64 loop reference,
exactness at a budget covering the context, and generate on every tiny architecture."""

from __future__ import annotations

import pytest
import torch

import kvpass
from kvpass.kernels import decode_attention_reference, page_recall_attention_reference
from kvpass.kernels.page_recall_attention import page_summaries
from kvpass.policies.quest import Quest
from tests.policies.merging_support import ARCHS, full_output, prompt, tiny_model


def case(b=2, hkv=2, group=2, pages=5, page=4, d=8, lengths=(19, 13), seed=0):
    g = torch.Generator().manual_seed(seed)
    c = pages * page
    k = torch.randn(b, hkv, c, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, hkv, c, d, generator=g, dtype=torch.float64)
    q = torch.randn(b, hkv * group, 1, d, generator=g, dtype=torch.float64)
    length = torch.tensor(lengths)[:, None].expand(b, hkv)
    live = torch.arange(c)[None, None] < length[..., None]
    log_weight = torch.where(live, 0.0, float("-inf")).float()
    return q, k.masked_fill(~live[..., None], 0), v, log_weight, live


def reference_pages(q, k, live, budget, page):
    """Selected pages of every (b, query head), by loops over pages and channels (§6.6)."""
    b, hq, _, d = q.shape
    hkv, c = k.shape[1], k.shape[2]
    out = {}
    for bi in range(b):
        for h in range(hq):
            g = h // (hq // hkv)
            scores = []
            for p in range(c // page):
                slots = [j for j in range(p * page, (p + 1) * page) if live[bi, g, j]]
                if not slots:
                    continue
                mx = k[bi, g, slots].max(0).values
                mn = k[bi, g, slots].min(0).values
                u = sum(max(float(q[bi, h, 0, ch] * mx[ch]), float(q[bi, h, 0, ch] * mn[ch])) for ch in range(d))
                scores.append((-u, p))
            n_sel = max(3, budget // page)
            top = {p for _, p in sorted(scores)[:n_sel]}
            newest = int(live[bi, g].sum()) - 1
            out[bi, h] = top | {newest // page}
    return out


def test_page_summaries_and_selection_match_reference():
    q, k, v, log_weight, live = case()
    budget = torch.full((2, 2), 12)
    page_max, page_min = page_summaries(k, live, 5)
    # stale summaries of the newest page: the op must refresh them in place
    page_max[:, :, 4], page_min[:, :, 4] = 0, 0
    stale = page_max.clone()
    o, _ = page_recall_attention_reference(q, k, v, log_weight, page_max, page_min, budget,
                                           torch.ones(2, 2, dtype=torch.bool), 0.5)
    want_max, want_min = page_summaries(k, live, 5)
    torch.testing.assert_close(page_max, want_max)
    torch.testing.assert_close(page_min, want_min)
    assert not torch.equal(stale, want_max)
    pages = reference_pages(q, k, live, 12, 4)
    for (bi, h), sel in pages.items():
        g = h // 2
        keep = torch.tensor([j // 4 in sel for j in range(20)])
        lw = log_weight[bi, g].masked_fill(~keep, float("-inf"))
        want, _ = decode_attention_reference(q[bi:bi + 1, h:h + 1], k[bi:bi + 1, g:g + 1], v[bi:bi + 1, g:g + 1],
                                             lw[None, None], 0.5)
        torch.testing.assert_close(o[bi, h], want[0, 0])


def test_large_budget_is_full_attention_and_small_is_not():
    q, k, v, log_weight, live = case(lengths=(20, 17))
    full, _ = decode_attention_reference(q, k, v, log_weight, 0.5)
    args = (torch.ones(2, 2, dtype=torch.bool), 0.5)
    got, _ = page_recall_attention_reference(q, k, v, log_weight, *page_summaries(k, live, 5),
                                             torch.full((2, 2), 20), *args)
    torch.testing.assert_close(got, full)
    small, _ = page_recall_attention_reference(q, k, v, log_weight, *page_summaries(k, live, 5),
                                               torch.full((2, 2), 4), *args)
    assert not torch.allclose(small, full)


def test_bad_hyperparameters_raise():
    for kwargs in ({"page_size": 0}, {"full_layers": -1}):
        with pytest.raises(ValueError):
            Quest(**kwargs)


@pytest.mark.parametrize("arch", ARCHS)
def test_generate(arch):
    model = tiny_model(arch)
    ids = prompt(2, 80)
    km = kvpass.apply(model, policy="quest", budget=32, full_layers=1)
    out = km.generate(ids, max_new_tokens=8, eos_token_id=[])
    assert out.shape == (2, 88)
    assert km.last_report.host_bytes == 0                     # CPU model: everything is device-resident


def test_generate_exact_at_large_budget_and_changed_at_small():
    model = tiny_model("llama")
    ids = prompt(1, 80)
    full = full_output("llama", 1, 80, 16)
    big = kvpass.apply(model, policy="quest", budget=112, full_layers=0).generate(ids, max_new_tokens=16, eos_token_id=[])
    small = kvpass.apply(model, policy="quest", budget=16, full_layers=0).generate(ids, max_new_tokens=16, eos_token_id=[])
    assert torch.equal(big, full)
    assert not torch.equal(small, full)
