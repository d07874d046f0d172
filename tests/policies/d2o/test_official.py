"""D2O against its released code (AIoT-MLSys-Lab/D2O, LLM_merge_new/LMEval_kv_token_merge/
modeling_llama3_7b_13b_d2o.py: ``D2O_LayerKVCache`` and ``LlamaAttention3_D2O.forward``), as read and
restated below in our own words (float64, plain torch; no code of theirs). docs/d2o.md lists
every difference and which side kvpass takes.

What the released code does to one layer (batch 1, K and V repeated to the Hq query heads):

* prefill: the full prompt is cached, nothing is evicted; the per-head column sums of the prompt's
  softmax attention are kept as the scores;
* first decode step: the step attends over the whole prompt and its own entry; its attention row is
  added to the prompt's column sums (the new entry's score is its own row value), and only then is the
  layer compressed, to hh + recent entries;
* every later step: the row is added to the kept entries' scores and one entry is evicted;
* a compression: the first 4 positions get score +inf (so they stay, inside the hh heavy hitters), the
  hh largest scores among all but the ``recent`` newest entries are kept with those newest; each evicted
  key finds its most cosine-similar kept key (max over the kept, per head); the threshold is the mean of
  those best similarities over heads and evicted entries (first time), then alpha * old + beta * mean;
  the i-th evicted entry of every head merges iff the mean over heads of the i-th best similarities
  reaches the threshold; a kept entry j receiving n merged entries becomes
  (k_j + sum_i u_i k_i) / (1 + n) (a ``scatter_reduce`` mean including itself of the similarity-weighted
  sources: merged keys shrink), values alike with the keys' weights and targets; scores are not merged.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

import kvpass
from kvpass.cache import LayerCache, with_capacity
from kvpass.policies.d2o import D2O, TAU
from kvpass.rewrites import capture_model
from tests.policies.policy_helpers import by_position, random_cache

BETA = 0.7          # the current step's weight (the code's belta; alpha = 1 - beta)
SINKS = 4           # the code's fixed first positions


@dataclass
class OfficialLayer:
    """One layer's state as the released code holds it (batch 1, sequence order): k, v [H, S, D], score
    [H, S] float64, threshold (None before the first compression), and the sizes hh (incl. sinks), recent."""

    k: torch.Tensor
    v: torch.Tensor
    score: torch.Tensor
    hh: int
    recent: int
    threshold: float | None = None
    positions: torch.Tensor | None = None    # [H, S] the tokens each head holds
    merges: int = 0                          # evicted ranks merged so far
    evictions: int = 0                       # evicted ranks so far

    def append(self, k_new: torch.Tensor, v_new: torch.Tensor, row: torch.Tensor, position: int) -> None:
        """A decode step: its entry [H, D] is cached, its attention row [H, S + 1] added to the scores."""
        self.k = torch.cat([self.k, k_new[:, None]], 1)
        self.v = torch.cat([self.v, v_new[:, None]], 1)
        self.score = torch.cat([self.score, torch.zeros_like(self.score[:, :1])], 1) + row
        self.positions = torch.cat([self.positions, torch.full_like(self.positions[:, :1], position)], 1)

    def compress(self) -> None:
        """The code's compression of the layer (a no-op while it holds at most hh + recent entries)."""
        h, s, _ = self.k.shape
        if s <= self.hh + self.recent:
            return
        self.score[:, :SINKS] = float("inf")                  # the sinks, for good (the code writes into its scores)
        older = self.score[:, : s - self.recent]
        heavy = older.argsort(-1, descending=True)[:, : self.hh].sort(-1).values
        newest = torch.arange(s - self.recent, s).expand(h, -1)
        keep = torch.zeros(h, s, dtype=torch.bool).scatter(1, torch.cat([heavy, newest], 1), True)
        kept_k, kept_v = self.k[keep].view(h, -1, self.k.shape[-1]), self.v[keep].view(h, -1, self.v.shape[-1])
        gone_k, gone_v = self.k[~keep].view(h, -1, self.k.shape[-1]), self.v[~keep].view(h, -1, self.v.shape[-1])
        unit = lambda x: x / x.norm(dim=-1, keepdim=True)        # noqa: E731
        best, target = (unit(gone_k) @ unit(kept_k).transpose(1, 2)).max(-1)          # [H, E]
        mean = float(best.mean())
        self.threshold = mean if self.threshold is None else (1 - BETA) * self.threshold + BETA * mean
        merges = best.mean(0) >= self.threshold                                       # [E]: one decision per rank
        self.merges += int(merges.sum())
        self.evictions += merges.numel()
        new_k, new_v = kept_k.clone(), kept_v.clone()
        for head in range(h):
            count = torch.ones(kept_k.shape[1], dtype=torch.float64)
            for i in torch.nonzero(merges).flatten().tolist():
                j = int(target[head, i])
                new_k[head, j] += best[head, i] * gone_k[head, i]
                new_v[head, j] += best[head, i] * gone_v[head, i]
                count[j] += 1
            new_k[head] /= count[:, None]
            new_v[head] /= count[:, None]
        self.k, self.v = new_k, new_v
        self.score = self.score[keep].view(h, -1)
        self.positions = self.positions[keep].view(h, -1)


def _assert_same_layer(got: LayerCache, want: OfficialLayer, what: str) -> None:
    """Our cache (row 0, any slot order) holds the official layer's tokens with its K and V."""
    ours = by_position(got)
    n = want.k.shape[1]
    assert bool((got.length[0] == n).all()), f"{what}: lengths {got.length[0].tolist()} != {n}"
    assert torch.equal(ours["position"][0, :, :n], want.positions), f"{what}: kept positions differ"
    torch.testing.assert_close(ours["k"][0, :, :n].double(), want.k, rtol=1e-5, atol=1e-6, msg=what)
    torch.testing.assert_close(ours["v"][0, :, :n].double(), want.v, rtol=1e-5, atol=1e-6, msg=what)
    assert abs(float(got.state[TAU][0]) - want.threshold) < 1e-5, what


def _code_policy(**kwargs) -> D2O:
    return D2O(d2o_variant="code", beta=BETA, sinks=SINKS, expand_kv_heads=True, interval=1, **kwargs)   # one in, one out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_compression_and_decode_steps_equal_the_released_code(seed: int) -> None:
    """Fresh random layer: the first compression (general path) and then one-in-one-out decode steps (the
    in-place op's reference) keep the same tokens, merge into the same K, V and carry the same threshold."""
    keep, heads, d, start = 16, 4, 8, 29
    policy = _code_policy()
    sinks, important, recent = policy.split(keep)
    gen = torch.Generator().manual_seed(seed)
    cache = random_cache([[start] * heads], start, d=d, seed=seed, extra_meta=("col_sum",))
    cache.slot_meta["col_sum"] *= 30                                   # prompt column sums are large
    want = OfficialLayer(cache.k[0].clone(), cache.v[0].clone(), cache.slot_meta["col_sum"][0].double(),
                         hh=important, recent=recent, positions=cache.position[0].clone())
    ours = with_capacity(policy.compress(cache, keep), keep + 1)
    want.compress()
    _assert_same_layer(ours, want, "first compression")
    for step in range(12):
        k_new = torch.randn(heads, d, generator=gen, dtype=torch.float64)
        v_new = torch.randn(heads, d, generator=gen, dtype=torch.float64)
        if step % 3 == 0:                                             # a near-copy of a kept key: merges happen
            k_new = want.k[:, 5] + 0.05 * k_new
        logits = torch.randn(heads, keep + 1, generator=gen, dtype=torch.float64) * 2
        row = torch.softmax(logits, -1)                                # over (kept in sequence order, new)
        position = start + step
        # ours: the decode graph writes the entry at slot `length` and adds the row to col_sum by slot
        slot = int(ours.length[0, 0])
        order = by_position(ours)["position"][0]                       # positions in sequence order, per head
        row_by_slot = torch.zeros(heads, keep + 1, dtype=torch.float32)
        for hd in range(heads):
            for rank, p in enumerate(order[hd, :keep].tolist()):
                row_by_slot[hd, int((ours.position[0, hd] == p).nonzero())] = float(row[hd, rank])
            row_by_slot[hd, slot] = float(row[hd, keep])
        ours.k[0, :, slot], ours.v[0, :, slot] = k_new, v_new
        ours.position[0, :, slot], ours.log_weight[0, :, slot] = position, 0.0
        ours.length += 1
        ours.slot_meta["col_sum"] += row_by_slot[None]
        want.append(k_new, v_new, row.float().double(), position)
        policy.compress_into(ours, keep)
        want.compress()
        _assert_same_layer(ours, want, f"decode step {step}")
    assert 0 < want.merges < want.evictions, (want.merges, want.evictions)      # both outcomes were checked


# ---------------------------------------------------------------------- a tiny Llama, end to end

def _tiny_llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      initializer_range=0.1, attn_implementation="eager")
    model = AutoModelForCausalLM.from_config(config).eval()
    captured = capture_model(model)
    return model, captured, list(captured.sites)


def test_first_decode_step_compression_equals_the_released_code_on_a_tiny_llama() -> None:
    """kvpass with first_compression="decode" on a tiny Llama (GQA, K and V expanded to the query heads):
    its K, V and scores after the first decode step are transformers' (prompt column sums + that step's
    row, per query head), and the compression that follows gives the released code's tokens, K, V and
    threshold in every layer."""
    model, captured, _ = _tiny_llama()
    keep, prompt = 12, 40
    policy = _code_policy(first_compression="decode", allocation="uniform")
    kv_model = kvpass.apply(model, policy, keep, captured=captured)
    ids = torch.randint(0, 128, (1, prompt), generator=torch.Generator().manual_seed(3))
    token = torch.tensor([7])
    session = kv_model.start(ids, max_new_tokens=4)
    assert all(lay.cache.capacity == prompt + 1 and int(lay.host_len) == prompt for lay in session.layers)
    session.step(token)                                     # attends over the whole prompt, nothing evicted yet
    with torch.no_grad():
        out = model(ids, use_cache=True, output_attentions=True)
        step = model(token[None], past_key_values=out.past_key_values, use_cache=True, output_attentions=True)
    groups = model.config.num_attention_heads // model.config.num_key_value_heads
    _, important, recent = policy.split(keep)
    for layer, lay in enumerate(session.layers):
        k_hf, v_hf = step.past_key_values.layers[layer].keys, step.past_key_values.layers[layer].values
        k_hf, v_hf = k_hf.repeat_interleave(groups, 1), v_hf.repeat_interleave(groups, 1)       # [1, Hq, T + 1, D]
        scores = out.attentions[layer][0].double().sum(1)                                   # [Hq, T]
        scores = torch.cat([scores, torch.zeros_like(scores[:, :1])], 1) + step.attentions[layer][0, :, 0].double()
        cache = lay.cache
        torch.testing.assert_close(cache.k[0].double(), k_hf[0].double(), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(cache.v[0].double(), v_hf[0].double(), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(cache.slot_meta["col_sum"][0].double(), scores, rtol=1e-4, atol=1e-5)
        # the compression itself, from the very same tensors (so the kept tokens compare exactly)
        want = OfficialLayer(cache.k[0].double(), cache.v[0].double(), cache.slot_meta["col_sum"][0].double(),
                             hh=important, recent=recent, positions=cache.position[0].clone())
        want.compress()
        lay.want = want
    session._deferred_prompt_compression()
    for layer, lay in enumerate(session.layers):
        assert lay.cache.capacity == keep + policy.interval
        _assert_same_layer(lay.cache, lay.want, f"layer {layer}")
        assert lay.want.merges > 0
    session.step(token)                                     # one-in-one-out from here, within the budget
    assert all(int(lay.cache.length.max()) <= keep + 1 for lay in session.layers)
