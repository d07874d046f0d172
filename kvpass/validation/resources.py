"""Checks of device memory before a prefill, and the refusal of a second generating thread."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvpass.errors import ModelInUse
from kvpass.validation.rules import MEMORY_ADVICE, refuse


def free_device_bytes(device: torch.device) -> int | None:
    """Bytes the caching allocator can still hand out on ``device`` (free + reserved unused); None off CUDA.
    Tests replace it to exercise the estimate on the CPU."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def estimate_prefill_bytes(config, batch: int, tokens: int, total: int, cache_slots: int, dtype: torch.dtype,
                           kv_width: int) -> int:
    """A lower estimate of the device memory a prefill needs: every layer's K, V of the prompt (the prefill
    returns them all; ``kv_width`` = sum over layers of KV heads x head dim), the compressed caches' buffers
    (``cache_slots`` per layer), one layer's activations (hidden, MLP, q) and the last logits. Real use is
    higher (allocator slack, the compression's temporaries)."""
    elem = torch.finfo(dtype).bits // 8 if dtype.is_floating_point else 4
    hidden = getattr(config, "hidden_size", None) or kv_width
    mlp = getattr(config, "intermediate_size", None) or 4 * hidden
    kv_prompt = 2 * batch * tokens * kv_width * elem
    cache = 2 * batch * min(cache_slots, total) * kv_width * elem
    activations = batch * tokens * (3 * hidden + 2 * mlp) * elem
    logits = batch * (getattr(config, "vocab_size", 0) or 0) * 4
    return kv_prompt + cache + activations + logits


def check_memory(need: int, device: torch.device, batch: int, tokens: int,
                 free: Callable[[torch.device], int | None] | None = None) -> None:
    """Refuse before the prefill when ``need`` bytes exceed what is free on ``device`` (CUDA only)."""
    got = (free or free_device_bytes)(device)
    if got is not None and need > got:
        raise refuse("memory.estimate", batch=batch, tokens=tokens, need_mib=need >> 20, free_mib=got >> 20,
                     advice=MEMORY_ADVICE)


def in_use() -> ModelInUse:
    return refuse("generate.in_use")
