"""Shared fixtures: tiny random-config models of every architecture kvpass is tested on, and the
real models shipped in PyPI packages (loaded once per session).

Triton decides at ``@triton.jit`` time (when kvpass is imported) whether to interpret kernels, so
TRITON_INTERPRET is set here, before any test module imports kvpass: without a GPU, Triton kernels
run on the CPU through the interpreter.

The session keeps some 4M objects alive (the cached tiny models and their traces, the real models), so each of
Python's full collections takes 1.5-2.5 s on 2 cores: a run made 68 of them (105 s of 20 minutes).
They are made rare here (the third generation's threshold 10 -> 1000); a test that needs garbage gone calls
``gc.collect()`` itself."""

from __future__ import annotations

import functools
import gc
import os

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
gc.set_threshold(gc.get_threshold()[0], gc.get_threshold()[1], 1000)
if os.environ.get("PYTEST_XDIST_WORKER"):   # pytest -n N: the cores shared among the workers, not each taking all
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))


@pytest.fixture(autouse=True)
def _torch_threads_kept():
    """Every test starts with the worker's torch thread count: code under test may set it (``kvpass.eval.common.
    set_threads``, the CLI's cores split), and a later test of the same worker then ran with 2 threads, where a
    float32 matmul's sums follow the memory layout (tests/test_bench_tp.py's views against their copies)."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


_COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1)

# name -> config. initializer_range 0.1 spreads the logits so greedy decoding has no near-ties.
TINY_CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**_COMMON),
    "mistral": lambda: transformers.MistralConfig(**_COMMON, sliding_window=8),
    "qwen2": lambda: transformers.Qwen2Config(**_COMMON),
    "qwen3": lambda: transformers.Qwen3Config(**_COMMON, head_dim=16),
    "gemma3": lambda: transformers.Gemma3TextConfig(**{**_COMMON, "num_key_value_heads": 1}, head_dim=16,
                                                   sliding_window=8,
                                                   layer_types=["sliding_attention", "full_attention"]),
    "phi3": lambda: transformers.Phi3Config(**_COMMON, pad_token_id=0),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                                            initializer_range=0.1),
    "gemma2": lambda: transformers.Gemma2Config(**_COMMON, head_dim=16, sliding_window=8),   # eager + softcap
}
ARCHITECTURES = list(TINY_CONFIGS)


@functools.cache
def tiny_model(name: str) -> torch.nn.Module:
    """A tiny random model of architecture ``name`` (seeded, cached per test session)."""
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(TINY_CONFIGS[name]()).eval()


def padded_batch(lengths: list[int], vocab: int = 128, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random prompts of the given lengths, left-padded with token 0: (input_ids, attention_mask) [B, T]."""
    g = torch.Generator().manual_seed(seed)
    t = max(lengths)
    ids = torch.zeros(len(lengths), t, dtype=torch.long)
    mask = torch.zeros(len(lengths), t, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, t - n:] = torch.randint(1, vocab, (n,), generator=g)
        mask[row, t - n:] = 1
    return ids, mask


@pytest.fixture(scope="session")
def smollm2():
    from kvpass.models import load_model
    try:
        return load_model("smollm2")
    except FileNotFoundError as err:
        pytest.skip(str(err))


@pytest.fixture(scope="session")
def gemma3_270m():
    from kvpass.models import load_model
    try:
        return load_model("gemma3-270m")
    except FileNotFoundError as err:
        pytest.skip(str(err))


@pytest.fixture(scope="session")
def capture_once():
    """``capture(model)``: ``kvpass.rewrites.capture_model(model)`` once per model object for the session (a trace
    of SmolLM2 takes 8 s on 2 cores, of Gemma-3-270M 17 s), for the real-model tests to share through
    ``kvpass.apply(model, ..., captured=capture(model))`` (what ``apply`` traces itself otherwise)."""
    from kvpass.rewrites import capture_model

    return functools.cache(capture_model)          # keyed by the model object (modules hash by identity)
