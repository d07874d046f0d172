"""Keep one decode step's query in a layer's ring of recent queries, in place (deferred scores).

A policy that adds every decode step's attention row into ``col_sum`` but reads it only when it compresses
(``Policy.deferred_scores``: D2O with ``interval`` m > 1) keeps the steps' queries instead, and their rows are
computed once, at the compression (``recent_query_column_sums``). For every batch row b, with
i = pos[b, 0] mod m:

    recent_query[b, :, i] = q[b, :, 0]          recent_position[b, i] = pos[b, 0]

Consecutive positions of a row take consecutive ring slots, so m steps fill the ring without overwriting one
another; the runtime reads (and empties: position -1) the ring at least every m steps.

Shapes: recent_query: [B, Hq, m, D] (the cache's dtype); recent_position: [B, m] int64 (-1: empty);
pos: [B, 1] int64 (the step's position_ids); q: [B, Hq, 1, D] (the attention's post-RoPE query).
On CUDA one Triton launch writes both (the reference is two scatters).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvpass.kernels._triton import HAS_TRITON, check_device, next_pow2, require_triton, tl, triton


def write_query_reference(recent_query: Tensor, recent_position: Tensor, pos: Tensor, q: Tensor) -> None:
    b, hq, m, d = recent_query.shape
    at = pos.to(device=recent_position.device, dtype=torch.long) % m                 # [B, 1]
    recent_query.scatter_(2, at[:, None, :, None].expand(b, hq, 1, d), q.to(recent_query.dtype))
    recent_position.scatter_(1, at, pos.to(device=recent_position.device, dtype=recent_position.dtype))


# Program (b, h): i = pos[b] mod m; recent_query[b, h, i, :] = q[b, h, 0, :]; head 0 also writes the position.
@triton.jit
def _write_query_kernel(RQ, RP, POS, Q, HQ, M, spb, srqb, srqh, srqm, srqd, srpb, srpm, sqb, sqh, sqd,
                        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    b = (row // HQ).to(tl.int64)
    h = (row % HQ).to(tl.int64)
    p = tl.load(POS + b * spb)
    i = p % M
    d = tl.arange(0, BLOCK_D)
    ok = d < HEAD_DIM
    q = tl.load(Q + b * sqb + h * sqh + d * sqd, mask=ok)
    tl.store(RQ + b * srqb + h * srqh + i * srqm + d * srqd, q.to(RQ.dtype.element_ty), mask=ok)
    if h == 0:
        tl.store(RP + b * srpb + i * srpm, p)


def write_query_triton(recent_query: Tensor, recent_position: Tensor, pos: Tensor, q: Tensor) -> None:
    """The reference's writes in one launch (same contract; every tensor on one device)."""
    require_triton()
    b, hq, m, d = recent_query.shape
    for name, t in (("recent_position", recent_position), ("pos", pos), ("q", q)):
        check_device(name, t, recent_query.device)
    if (recent_position.shape != (b, m) or recent_position.dtype != torch.int64 or pos.shape != (b, 1)
            or q.shape != (b, hq, 1, d)):
        raise ValueError(f"write_query: recent_query [B, Hq, m, D] = {tuple(recent_query.shape)} needs recent_position "
                         f"int64 [B, m], pos [B, 1], q [B, Hq, 1, D]; got {tuple(recent_position.shape)} "
                         f"{recent_position.dtype}, {tuple(pos.shape)}, {tuple(q.shape)}")
    pos = pos.to(torch.int64)
    _write_query_kernel[(b * hq,)](
        recent_query, recent_position, pos, q, hq, m, pos.stride(0), *recent_query.stride(), *recent_position.stride(),
        q.stride(0), q.stride(1), q.stride(3), HEAD_DIM=d, BLOCK_D=max(16, next_pow2(d)), num_warps=1)


@torch.library.custom_op("kvpass::write_query", mutates_args=("recent_query", "recent_position"))
def write_query(recent_query: Tensor, recent_position: Tensor, pos: Tensor, q: Tensor) -> None:
    write_query_reference(recent_query, recent_position, pos, q)


@write_query.register_fake
def _(recent_query, recent_position, pos, q):
    return None


if HAS_TRITON:
    @write_query.register_kernel("cuda")
    def _(recent_query, recent_position, pos, q):
        write_query_triton(recent_query, recent_position, pos, q)
