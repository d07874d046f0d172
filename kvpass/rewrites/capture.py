"""Capture: a Hugging Face causal LM -> an aten graph of its no-cache forward.

The graph computes ``(input_ids [B, T], position_ids [B, T]) -> logits [B, T, V]`` with a
dynamic batch and sequence length, and reads the model's parameters in place (no copy), so the
rewritten graphs share the model's weights. The model is left as it was found: its attention
implementation is switched to SDPA only while tracing, where the model allows it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.export import Dim
from torch.fx import GraphModule
from torch.fx.graph import CodeGen

from kvpass.rewrites.attention_sites import AttentionSite
from kvpass.rewrites.shard_tensor_parallel import Shard

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CapturedModel:
    """The traced no-cache forward of a causal LM.

    gm: ``forward(input_ids [B, T] int64, position_ids [B, T] int64) -> (logits [B, T, V],)``;
    its parameters are the model's own tensors. sites: its attention sites, one per layer, once matched
    (``kvpass.rewrites.capture_model``; empty straight from ``capture_causal_lm``).
    shard: set once ``gm`` is sharded for one tensor-parallel rank (``kvpass.rewrites.pipeline.shard_captured``):
    ``sites`` are then the rank's, ``model_sites`` the model's and ``vocab`` the logits' width before sharding.
    """

    gm: GraphModule
    model_type: str
    attn_implementation: str
    context_length: int
    sites: tuple[AttentionSite, ...] = ()
    shard: Shard | None = None
    model_sites: tuple[AttentionSite, ...] = ()
    vocab: int | None = None


class _LogitsOnly(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits


def context_length(config) -> int:
    """The longest sequence the model's positions allow."""
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 131072


@contextlib.contextmanager
def _traceable(model: nn.Module, prefer_sdpa: bool) -> Iterator[str]:
    """Eval mode and SDPA attention (where the model supports it) for the duration; restored after."""
    was_training = model.training
    before = getattr(model.config, "_attn_implementation", None) or "unknown"
    chosen = before
    if prefer_sdpa and before != "sdpa" and hasattr(model, "set_attn_implementation"):
        try:
            model.set_attn_implementation("sdpa")
            chosen = "sdpa"
        except (ValueError, ImportError) as err:   # e.g. Gemma2: softcapping has no SDPA path
            log.info("%s keeps %s attention: %s", type(model).__name__, before, err)
    model.eval()
    try:
        yield chosen
    finally:
        model.train(was_training)
        if chosen != before:
            model.set_attn_implementation(before)


def _plain_positional(gm: GraphModule) -> GraphModule:
    """Drop export's input guards and pytree calling convention: forward(*tensors) -> tuple."""
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":
            gm.graph.erase_node(node)
    gm.graph._codegen = CodeGen()
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def capture_causal_lm(model: nn.Module, example_length: int = 16, prefer_sdpa: bool = True) -> CapturedModel:
    """Trace ``model`` (a transformers ``*ForCausalLM``) with torch.export, non-strict.

    The example batch is 2 x ``example_length`` tokens; batch and sequence length stay symbolic.
    ``prefer_sdpa``: switch the model to SDPA attention while tracing where it supports it (the
    model's own setting is restored); False traces the attention the model is set to.
    """
    config = model.config
    ctx = context_length(config)
    device = next(model.parameters()).device
    example_length = min(example_length, ctx - 1)
    ids = torch.zeros(2, example_length, dtype=torch.long, device=device)
    pos = torch.arange(example_length, device=device).expand(2, -1)
    batch, seq = Dim("batch", min=1, max=4096), Dim("seq", min=1, max=ctx)
    with _traceable(model, prefer_sdpa) as impl, torch.no_grad():
        # Deferred runtime asserts: torch 2.11 on CUDA emits guards such as min(128*T, 512*T) == 128*T
        # that its solver cannot prove for the whole range and would otherwise reject.
        program = torch.export.export(
            _LogitsOnly(model), (ids, pos), strict=False,
            dynamic_shapes={"input_ids": {0: batch, 1: seq}, "position_ids": {0: batch, 1: seq}},
            prefer_deferred_runtime_asserts_over_guards=True,
        )
    gm = _plain_positional(program.module())
    log.info("captured %s (%s attention): %d graph nodes", config.model_type, impl, len(gm.graph.nodes))
    return CapturedModel(gm=gm, model_type=config.model_type, attn_implementation=impl, context_length=ctx)
