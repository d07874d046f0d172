"""Decode linears -> ``kvpass::gemv``: every ``aten.linear`` of the decode graph calls the one-row GEMV op.

At batch 1 each projection of a decode step reads one activation row against its whole weight. cuBLAS
runs the N = 4096 ones (o_proj, down_proj) as split-K GEMVs with a second, reduction launch; the op's
Triton kernel (kernels/gemv.py) streams the weight once in one launch. On an H100, 32 Llama-3.1-8B-shaped
blocks of fused q/k/v, o, fused gate/up and down (with the activation and a norm between) took 5.83 ms
through cuBLAS and 5.26 ms through the kernel, against a 4.65 ms floor for their weights; lm_head took
373 us and 340 us (benchmarks/results/gemv-sweep-nvidia-h100-80gb-hbm3.json). In the compiled D2O step at
32k the step went from 7.05 to 6.38 ms, with write_kv also recording positions
(speed-nvidia-h100-80gb-hbm3-32k-gemv-decode.md).

The op is ``F.linear`` wherever the kernel does not apply (more than one row, another device or dtype),
so the graph computes the same function; only the fp32 accumulation order of the one-row case differs.
Run by KVPassModel on the decode graph of a CUDA model (after ``fuse_sibling_linears``); the prefill
keeps its GEMMs.
"""

from __future__ import annotations

import kvpass.kernels  # noqa: F401  (registers torch.ops.kvpass)
import torch
from torch.fx import GraphModule

LINEAR = torch.ops.aten.linear.default


def linears_to_gemv(gm: GraphModule) -> int:
    """Retarget every ``aten.linear`` call of ``gm`` to ``kvpass::gemv`` (same arguments). Returns how many."""
    count = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is LINEAR:
            node.target = torch.ops.kvpass.gemv.default
            count += 1
    if count:
        gm.recompile()
    return count
