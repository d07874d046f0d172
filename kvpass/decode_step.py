"""The decode step under a CUDA graph: fixed buffers, one graph replay per token.

A decode step launches hundreds of small kernels (per layer: norms, projections, RoPE, write_kv,
decode attention, MLP); at batch 1 their launch overhead, not memory traffic, bounds plain eager
decoding (architecture.md, "Performance model"). ``StaticDecodeStep`` captures one call of the
decode graph in a CUDA graph and replays it every step.

Inputs of the decode graph fall in two kinds (insert_compressed_cache.py, ``decode``):

* step inputs, new tensors every step: ``input_ids`` [B, 1], ``position_ids`` [B, 1] and each
  layer's ``slot`` [B, Hkv]. They are copied into static buffers owned by the step before replay.
* persistent inputs: each layer's cache buffers (``k_cache``, ``v_cache``, ``log_weight``, which
  the graph writes in place) and the policy's ``decode_inputs``. The graph reads them at the
  addresses it was captured with, so they must stay the same tensors: compression writes into them
  with ``cache.load_into`` (it does). When one of them is a different tensor (a new ``generate``
  call, a policy that replaced a buffer) or a step input changes shape, the step re-captures.

The outputs are static tensors too: the next replay overwrites them. The logits are returned as a
copy (callers keep them, e.g. ``output_logits``); the scores are returned as the static tensors,
which the runtime adds into its column sums right away.

On CPU, or with ``KVPASS_CUDA_GRAPH=0``, or if capture fails (an op that synchronises, say), the
step runs the graph eagerly: same inputs, same outputs.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

log = logging.getLogger(__name__)

Key = tuple


def step_input_indices(n_inputs: int, per_layer: int) -> frozenset[int]:
    """Indices of the step inputs in the decode graph's flat inputs: ids, positions, and the slot
    (4th input) of every layer group of ``per_layer`` inputs."""
    if (n_inputs - 2) % per_layer:
        raise ValueError(f"{n_inputs} decode inputs do not split into 2 + layers x {per_layer}")
    return frozenset([0, 1, *(2 + i * per_layer + 3 for i in range((n_inputs - 2) // per_layer))])


def capture_key(args: Sequence[Tensor], step_idx: frozenset[int]) -> Key:
    """What a captured graph depends on: shapes and dtypes of step inputs, and the identity (address,
    shape, strides, dtype) of persistent inputs. A different key means the graph must be re-captured."""
    parts = []
    for i, x in enumerate(args):
        if i in step_idx:
            parts.append((i, tuple(x.shape), x.dtype, x.device))
        else:
            parts.append((i, x.data_ptr(), tuple(x.shape), x.stride(), x.dtype, x.device))
    return tuple(parts)


def graphs_enabled(device: torch.device) -> bool:
    return device.type == "cuda" and os.environ.get("KVPASS_CUDA_GRAPH", "1") != "0"


class StaticDecodeStep:
    """``step(ids, pos, *flat)`` = ``decode(ids, pos, *flat)``, replayed from a CUDA graph on CUDA.

    decode: the decode GraphModule; per_layer: inputs per layer (4 + len(policy.decode_inputs)).
    ``captures`` counts captures (tests and benchmarks read it); ``enabled`` turns graphs off."""

    def __init__(self, decode: Callable[..., Sequence[Tensor]], per_layer: int, enabled: bool = True,
                 warmup: int = 1) -> None:
        self.decode, self.per_layer, self.enabled, self.warmup = decode, per_layer, enabled, warmup
        self.captures = 0
        self._key: Key | None = None
        self._graph = None
        self._static: list[Tensor] = []
        self._outs: Sequence[Tensor] = ()
        self._step_idx: frozenset[int] = frozenset()

    def reset(self) -> None:
        """Drop the captured graph (and its memory pool)."""
        self._key, self._graph, self._static, self._outs = None, None, [], ()

    def __call__(self, *args: Tensor) -> Sequence[Tensor]:
        if not (self.enabled and graphs_enabled(args[0].device)):
            return self.decode(*args)
        step_idx = step_input_indices(len(args), self.per_layer)
        key = capture_key(args, step_idx)
        if key != self._key:
            try:
                self._capture(args, step_idx, key)
            except Exception as exc:    # noqa: BLE001  (any capture failure: stay correct, run eagerly)
                log.warning("CUDA graph capture of the decode step failed (%s); decoding eagerly", exc)
                self.reset()
                self.enabled = False
                return self.decode(*args)
        for i in self._step_idx:
            self._static[i].copy_(args[i])
        self._graph.replay()
        return (self._outs[0].clone(), *self._outs[1:])

    def _capture(self, args: Sequence[Tensor], step_idx: frozenset[int], key: Key) -> None:
        self.reset()
        static = [x.clone(memory_format=torch.contiguous_format) if i in step_idx else x
                  for i, x in enumerate(args)]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):         # warm-up: compiles Triton kernels, sets up handles; a decode
            for _ in range(self.warmup):      # step is idempotent (it writes this step's K, V at `slot`)
                self.decode(*static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = self.decode(*static)
        self._graph, self._static, self._outs = graph, static, tuple(outs)
        self._step_idx, self._key = step_idx, key
        self.captures += 1
