"""What a prefill takes of a ``KVPassModel`` before it runs, shared by the model and the chunked prefill
(kvpass/runtime/chunked_prefill.py, which so needs nothing of the model's module): the inputs checked and laid out
(``prepare_inputs``), and the device memory the prefill will need checked against what is free
(``check_prefill_memory``)."""

from __future__ import annotations

from typing import Protocol

from torch import Tensor, nn

from kvpass.budget import budget_tokens
from kvpass.errors import OutOfDeviceMemory
from kvpass.runtime.decode_buffers import DecodeBuffers
from kvpass.runtime.layers import RuntimeModel
from kvpass.validation import as_input_ids, check_memory, estimate_prefill_bytes, left_pads, refuse


class PrefillingModel(RuntimeModel, Protocol):
    """What ``prepare_inputs`` and ``check_prefill_memory`` read of a ``KVPassModel``."""

    captured: object
    config: object
    free_bytes: object
    decode_buffers: DecodeBuffers

    @property
    def model(self) -> nn.Module: ...

    @property
    def vocab_size(self) -> int | None: ...

    def release_decode_buffers(self) -> None: ...


def prepare_inputs(model: PrefillingModel, input_ids, attention_mask, max_new_tokens: int
                   ) -> tuple[Tensor, Tensor, Tensor]:
    """ids [B, T], left pads [B], positions [B, T] after every input check (``kvpass.validation``)."""
    ids = as_input_ids(input_ids, model.device, model.vocab_size)
    mask, pad = left_pads(attention_mask, ids)
    longest = int(ids.shape[1] - pad.min())
    ctx = model.captured.context_length
    if longest > ctx:
        raise refuse("input_ids.context", got=longest, context=ctx)
    if longest + max_new_tokens > ctx:
        raise refuse("max_new_tokens.context", prompt=longest, got=max_new_tokens, context=ctx)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, pad, pos


def check_prefill_memory(model: PrefillingModel, batch: int, tokens: int, total: int) -> None:
    """Refuse before the prefill when its estimated memory (``validation.estimate_prefill_bytes``) exceeds what is
    free on the device (CUDA; ``validation.free_device_bytes``), after freeing the buffers ``generate`` kept
    (``release_decode_buffers``) if they are what is in the way."""
    if model.device.type != "cuda" and model.free_bytes is None:
        return
    kv_width = sum(s.n_kv_heads * s.head_dim for s in model.graphs.sites)
    slots = total if not model.policy.compresses else budget_tokens(model.budget, total) + getattr(
        model.policy, "interval", 1)
    need = estimate_prefill_bytes(model.config, batch, tokens, total, slots, next(model.model.parameters()).dtype,
                                  kv_width)
    try:
        check_memory(need, model.device, batch, tokens, model.free_bytes)
    except OutOfDeviceMemory:
        if not model.decode_buffers.held:
            raise
        model.release_decode_buffers()
        check_memory(need, model.device, batch, tokens, model.free_bytes)
