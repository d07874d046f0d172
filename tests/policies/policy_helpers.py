"""Helpers of the policy tests: random layer caches and tiny random-config models of every
architecture of the foundation issue (captured once per session: tracing dominates the run time)."""

from __future__ import annotations

import functools

import torch
import transformers
from transformers import AutoModelForCausalLM

import kvpass
from kvpass.cache import LayerCache
from kvpass.rewrites import capture_model
from kvpass.runtime import KVPassModel

_SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=256, initializer_range=0.1)

CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**_SMALL, num_key_value_heads=2),
    "mistral": lambda: transformers.MistralConfig(**_SMALL, num_key_value_heads=2, sliding_window=16),
    "qwen2": lambda: transformers.Qwen2Config(**_SMALL, num_key_value_heads=2),
    "qwen3": lambda: transformers.Qwen3Config(**_SMALL, num_key_value_heads=2, head_dim=16),
    "gemma3": lambda: transformers.Gemma3TextConfig(**_SMALL, num_key_value_heads=1, head_dim=16, sliding_window=16,
                                                    layer_types=["sliding_attention", "full_attention"]),
    "phi3": lambda: transformers.Phi3Config(**_SMALL, num_key_value_heads=2, pad_token_id=0),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                                            initializer_range=0.1),
    "gemma2": lambda: transformers.Gemma2Config(**_SMALL, num_key_value_heads=2, head_dim=16, sliding_window=16,
                                                attn_implementation="eager"),
}
ARCHS = tuple(CONFIGS)


@functools.cache
def captured_model(arch: str):
    """(model, captured, sites) of a tiny random ``arch`` model, built and traced once per session."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[arch]()).eval()
    captured = capture_model(model)
    return model, captured, list(captured.sites)


def apply_cached(arch: str, policy, budget: float | int, **kwargs) -> KVPassModel:
    """``kvpass.apply(model, policy, budget, **kwargs)`` of the tiny ``arch`` model, reusing the session's trace."""
    model, captured, _ = captured_model(arch)
    return kvpass.apply(model, policy, budget, captured=captured, **kwargs)


def random_cache(lengths: list[list[int]], c: int, d: int = 8, seed: int = 0, dtype=torch.float64,
                 extra_meta: tuple[str, ...] = ("col_sum", "window_scores")) -> LayerCache:
    """A LayerCache [B, Hkv, C, D] whose row (b, g) holds lengths[b][g] live entries at positions
    0, 1, ...; random keys/values and positive random per-slot scores (no ties)."""
    gen = torch.Generator().manual_seed(seed)
    b, hkv = len(lengths), len(lengths[0])
    length = torch.tensor(lengths, dtype=torch.long)
    live = torch.arange(c)[None, None, :] < length[..., None]
    k = torch.randn(b, hkv, c, d, generator=gen, dtype=torch.float64).to(dtype)
    v = torch.randn(b, hkv, c, d, generator=gen, dtype=torch.float64).to(dtype)
    meta = {name: torch.rand(b, hkv, c, generator=gen, dtype=torch.float64).float() * live for name in extra_meta}
    return LayerCache(k=k * live[..., None], v=v * live[..., None],
                      log_weight=torch.where(live, 0.0, float("-inf")).float(), length=length,
                      position=torch.where(live, torch.arange(c), -1), slot_meta=meta)


def live_positions(cache: LayerCache, b: int, g: int) -> list[int]:
    return cache.position[b, g, : int(cache.length[b, g])].tolist()


def by_position(cache: LayerCache) -> dict[str, torch.Tensor]:
    """Every slot tensor of ``cache`` with each row's slots sorted by position (empty slots last)."""
    order = torch.where(cache.position < 0, torch.iinfo(torch.long).max, cache.position).argsort(-1)
    take = lambda t: torch.take_along_dim(t, order.reshape(*order.shape, *([1] * (t.dim() - 3))), dim=2)  # noqa: E731
    out = {name: take(getattr(cache, name)) for name in ("k", "v", "log_weight", "position")}
    out.update({name: take(t) for name, t in cache.slot_meta.items()})
    live = out["position"] >= 0
    for name in ("k", "v"):                                   # an empty slot's K, V are never read
        out[name] = out[name] * live[..., None]
    return out


def check_budget_8_generation(policy: str, prompt_ids: torch.Tensor, slack: int, **kwargs) -> None:
    """``policy`` at a budget of 8 entries on the tiny Llama (two layers) generates 6 finite tokens per
    row, compresses, keeps every layer within 8 + ``slack`` entries and changes the logits; at budget 1.0
    it gives the full cache's logits (§8.1)."""
    def run(name: str, budget: float | int, **kw):
        out = apply_cached("llama", name, budget, **kw).generate(prompt_ids, max_new_tokens=6,
                                                                 return_dict_in_generate=True, output_logits=True)
        return out, torch.stack(out.logits, 1)

    _, full = run("full", 1.0)
    out, logits = run(policy, 8, **kwargs)
    assert out.sequences.shape == (2, prompt_ids.shape[1] + 6)
    assert torch.isfinite(logits).all()
    report = out.report
    assert report.compressions > 0 and report.layer_budgets == {0: 8, 1: 8}
    assert all(n <= 8 + slack for n in report.entries.values())
    assert not torch.allclose(logits, full, atol=1e-4)
    torch.testing.assert_close(run(policy, 1.0)[1], full)


def check_rows_compress_as_alone(policy, keeps: list[int], lengths: list[list[int]], due: list[bool], meta: str,
                                 seed: int) -> None:
    """``policy.compress_rows_into`` with a budget per row (``keeps``) on a random cache whose rows hold
    ``lengths`` entries at positions out of slot order: each ``due`` row ends slot for slot as ``compress_into``
    leaves it alone in a layer of capacity keep + interval, every other row bit for bit as it was."""
    interval = policy.interval
    c = max(keeps) + interval
    cache = random_cache(lengths, c=c, seed=seed, extra_meta=(meta,))
    gen = torch.Generator().manual_seed(seed)
    for b, row in enumerate(lengths):                        # positions out of slot order
        for g, n in enumerate(row):
            cache.position[b, g, :n] = torch.randperm(n, generator=gen)
    before = {f: getattr(cache, f).clone() for f in ("k", "v", "log_weight", "length", "position")}
    alone = []
    for b, keep in enumerate(keeps):
        cap = keep + interval
        row = LayerCache(**{f: getattr(cache, f)[b:b + 1, :, :cap].clone() for f in ("k", "v", "log_weight", "position")},
                         length=cache.length[b:b + 1].clone(),
                         slot_meta={n: t[b:b + 1, :, :cap].clone() for n, t in cache.slot_meta.items()})
        if due[b]:
            policy.compress_into(row, keep)
        alone.append(row)
    policy.compress_rows_into(cache, torch.tensor(keeps))
    for b, keep in enumerate(keeps):
        cap = keep + interval
        if not due[b]:
            for f, t in before.items():
                assert torch.equal(getattr(cache, f)[b], t[b]), (b, f)
            continue
        for f in ("k", "v", "log_weight", "position"):
            torch.testing.assert_close(getattr(cache, f)[b:b + 1, :, :cap], getattr(alone[b], f), rtol=0, atol=0,
                                       msg=f"row {b}: {f}")
        torch.testing.assert_close(cache.slot_meta[meta][b:b + 1, :, :cap], alone[b].slot_meta[meta])
        assert torch.equal(cache.length[b], alone[b].length[0])
        assert (cache.position[b, :, cap:] == -1).all()
