"""KVzip's context reconstruction (kvpass/runtime/reconstruction.py, docs/policies.md §6.13) and the ``kvzip`` policy:
the scores against the attention plain transformers computes on the prompt followed by its repetition, rows as if
alone, the span scope against the full one, and the layer budgets' global rule."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import kvpass
from kvpass.cache import LayerCache, entries_from_prompt
from kvpass.policies import Stat
from kvpass.runtime.reconstruction import ReconstructionPrompt, _repeat_inputs, reconstruction_scores
from tests.conftest import TINY_CONFIGS, tiny_model

PROMPT = ReconstructionPrompt(first=(5, 6, 7), later=(8, 9), suffix=(10, 11))


def _eager(name: str):
    """The tiny model with eager attention (which returns its attention probabilities), same weights."""
    model = AutoModelForCausalLM.from_config(TINY_CONFIGS[name](), attn_implementation="eager").eval()
    model.load_state_dict(tiny_model(name).state_dict())
    return model


def _reference(name: str, ids: list[int], chunk: int) -> dict[int, torch.Tensor]:
    """{layer: [Hkv, n]}: per chunk, plain transformers on prompt + repetition (one sequence, eager attention), the
    repetition rows' attention on the prompt's columns, max over the group's heads, rows and chunks."""
    model = _eager(name)
    n = len(ids)
    g = model.config.num_attention_heads // model.config.num_key_value_heads
    out: dict[int, torch.Tensor] = {}
    for a in range(0, n, chunk):
        (rep, _, _) = _repeat_inputs([ids], a, chunk, 8, PROMPT, torch.device("cpu"))
        seq = torch.tensor([ids]) if rep.shape[1] == 0 else torch.cat([torch.tensor([ids]), rep], dim=1)
        with torch.no_grad():
            att = model(seq, output_attentions=True).attentions              # per layer [1, Hq, S, S]
        for layer, p in enumerate(att):
            top = p[0, :, n:, :n].reshape(-1, g, seq.shape[1] - n, n).amax(dim=(1, 2))   # [Hkv, n]
            out[layer] = top if layer not in out else torch.maximum(out[layer], top)
    return out


def _scores(model, ids: torch.Tensor, pad: torch.Tensor, **kwargs) -> dict[int, torch.Tensor]:
    kv = kvpass.apply(model, policy="kvzip", budget=0.5)
    pos = (torch.arange(ids.shape[1])[None, :] - pad[:, None]).clamp(min=0)
    _, k_v, _ = kv.graphs.split_prefill(kv.graphs.prefill(ids, pos, pad))
    return reconstruction_scores(kv, ids, pad, k_v, PROMPT, **kwargs)


@pytest.mark.parametrize("name", ["llama", "qwen2"])
@pytest.mark.parametrize("chunk", [64, 13])
def test_full_scope_equals_transformers_attention(name, chunk):
    """One chunk (64 >= the prompt) and three (13): the reconstruction step's maxima are transformers' attention."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(12, 128, (1, 30), generator=g)
    got = _scores(tiny_model(name), ids, torch.tensor([0]), chunk=chunk, scope="full")
    want = _reference(name, ids[0].tolist(), chunk)
    assert set(got) == set(want)
    for layer in want:
        torch.testing.assert_close(got[layer][0], want[layer], rtol=1e-4, atol=1e-6, msg=f"layer {layer}")
    assert max(float(w.max()) for w in want.values()) > 0.05


def test_span_scope_is_the_full_one_when_a_chunk_holds_the_prompt_and_differs_otherwise():
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(12, 128, (1, 40), generator=g)
    pad = torch.tensor([0])
    full, span = _scores(model, ids, pad, chunk=64, scope="full"), _scores(model, ids, pad, chunk=64, scope="span")
    for layer in full:
        torch.testing.assert_close(span[layer], full[layer], rtol=1e-5, atol=1e-7)
    full, span = _scores(model, ids, pad, chunk=10, scope="full"), _scores(model, ids, pad, chunk=10, scope="span")
    assert any(not torch.allclose(span[la], full[la], atol=1e-6) for la in full)
    assert all(bool((span[la] > 0).all()) for la in span)         # every entry is in some chunk's span


@pytest.mark.parametrize("scope", ["span", "full"])
def test_rows_of_a_left_padded_batch_score_as_alone(scope):
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(3)
    a, b = torch.randint(12, 128, (1, 25), generator=g), torch.randint(12, 128, (1, 18), generator=g)
    ids = torch.cat([a, torch.cat([torch.zeros(1, 7, dtype=torch.long), b], dim=1)])
    both = _scores(model, ids, torch.tensor([0, 7]), chunk=9, scope=scope)
    alone_a = _scores(model, a, torch.tensor([0]), chunk=9, scope=scope)
    alone_b = _scores(model, b, torch.tensor([0]), chunk=9, scope=scope)
    for layer in both:
        torch.testing.assert_close(both[layer][0], alone_a[layer][0], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(both[layer][1, :, 7:], alone_b[layer][0], rtol=1e-4, atol=1e-6)
        assert bool((both[layer][1, :, :7] == 0).all())              # pad columns score 0


def _cache(scores: torch.Tensor) -> LayerCache:
    """One row's layer cache [1, Hkv, n] holding these reconstruction scores."""
    hkv, n = scores.shape
    k = torch.zeros(1, hkv, n, 4)
    return entries_from_prompt(k, k.clone(), torch.tensor([0]), {Stat.RECONSTRUCTION.value: scores[None].float()})


def test_global_layer_budgets_follow_each_layers_most_needing_head():
    """Layer 0: one head with 30 high scores; layer 1: both heads with 10 each; layer 2: nothing high. Budgets of
    the layers' most-needing heads above one threshold (KVzip's joint ranking, with buffers one size per layer)."""
    n = 100
    low = torch.rand(2, n, generator=torch.Generator().manual_seed(4)) * 0.01
    l0, l1, l2 = low.clone(), low.clone(), low.clone()
    l0[0, 40:70] = 1.0
    l1[:, 10:20] = 1.0
    policy = kvpass.get_policy("kvzip", sinks=0, recent=0)
    budgets = policy.layer_budgets(14, [_cache(x) for x in (l0, l1, l2)])
    assert sum(budgets) == 3 * 14
    assert budgets[0] > budgets[1] > budgets[2] >= 1
    assert budgets[0] >= 25 and budgets[1] >= 10
    mean = kvpass.get_policy("kvzip", sinks=0, recent=0, layers="global_mean").layer_budgets(
        14, [_cache(x) for x in (l0, l1, l2)])
    assert sum(mean) == 42 and mean[0] < budgets[0]                 # the mean over heads halves layer 0's share
    assert kvpass.get_policy("kvzip", layers="uniform").layer_budgets(14, [_cache(x) for x in (l0, l1, l2)]) == [14] * 3


def test_kvzip_keeps_the_top_scores_sinks_and_window():
    scores = torch.arange(20, dtype=torch.float32).flip(0)[None].expand(2, 20).clone()    # older scores higher
    scores[1, 12] = 100.0
    cache = _cache(scores)
    out = kvpass.get_policy("kvzip", sinks=2, recent=3).compress(cache, 8)
    kept = {int(p) for p in out.position[0, 1, : int(out.length[0, 1])]}
    assert kept == {0, 1, 17, 18, 19, 2, 3, 12}                     # sinks, window, the 3 best of the rest


def test_reconstruction_needs_no_tokenizer_and_refuses_chunked_prefill():
    model = tiny_model("llama")
    kv = kvpass.apply(model, policy="kvzip", budget=0.3)
    ids = torch.randint(12, 128, (1, 150), generator=torch.Generator().manual_seed(5))
    out = kv.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 154) and max(kv.last_report.entries.values()) < 154
    with pytest.raises(kvpass.errors.KVPassError, match="prefill_chunk"):
        kv.generate(ids, max_new_tokens=4, prefill_chunk=16)
