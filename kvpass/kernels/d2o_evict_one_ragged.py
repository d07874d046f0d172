"""D2O's one-in-one-out decode step with a budget per batch row, in place (docs/policies.md §5.5-5.6).

``d2o_evict_one`` (kvpass/kernels/d2o_evict_one.py, whose docstring defines the step) for a layer whose
batch rows have budgets of their own (D2O's per-row layer budgets: each row's own attention variance and
prompt length): keep, sinks, recent and target_from are [B] int64 tensors, row b's split of its own budget.
The layer's capacity C is the rows' largest budget + 1 (any C >= that works). Row b evicts where it holds
more than keep[b] entries (then keep[b] + 1: the decode step wrote its newest entry at slot length - 1,
which is the slot that moves into the evicted one and is emptied) and is left unchanged otherwise, whatever
its length. So each row gets what ``d2o_evict_one`` gives it alone, in a layer of its own capacity
keep[b] + 1 (tests/kernels/test_d2o_evict_ragged.py), and the runtime compresses such a layer in one call in
its own buffers, inside the CUDA-graphed step, instead of one budget at a time in copies (eager, a host sync).

Why tensors and not ints: the budgets are per row and change with every prompt; the Triton kernels read
them per program (no compilation per budget, no ``tl.constexpr``), and the CUDA graph captures their
addresses. Their values are the caller's contract (0 <= sinks, 0 <= recent, sinks + recent <= keep and
0 <= target_from < keep in a row that can evict; D2O's split guarantees it), not checked: that would
synchronise with the device. Same three kernels as ``d2o_evict_one`` (their RAGGED form), same cost; with
``nearest``, as there, the decode attention's nearest keys of the candidates each row named a step ahead.

D2O's merge_protect and merge_weighting="score" have no kernel: for them D2O runs the shared plain-torch step
``evict_one_in_place`` with ``protect`` / ``score_weights`` and these same [B] tensors (on CUDA too: batched,
no host sync, captured by the CUDA graph like the op).
"""

from __future__ import annotations

from collections.abc import Generator

import torch
from torch import Tensor

from kvpass.head_group import SINGLE_PROCESS, HeadGroup
from kvpass.kernels._triton import HAS_TRITON, check_device, require_triton
from kvpass.kernels.d2o_evict_one import (
    NO_FLOOR,
    Gathered,
    check_layer_metadata,
    check_layer_tensors,
    check_nearest_state,
    evict_one_in_place,
    evict_one_steps,
    run_layers,
)


def d2o_evict_one_ragged_reference(k: Tensor, v: Tensor, col_sum: Tensor, position: Tensor, log_weight: Tensor,
                                   length: Tensor, tau: Tensor, tau_set: Tensor, others: list[Tensor], keep: Tensor,
                                   sinks: Tensor, recent: Tensor, target_from: Tensor, beta: float, variant: str,
                                   min_cos: float = NO_FLOOR, bias: bool = False) -> None:
    """The step in plain torch (the op's definition; CPU and export): ``d2o_evict_one_reference``'s, with
    keep, sinks, recent, target_from [B] int64 per batch row (the shared ``evict_one_in_place``)."""
    evict_one_in_place(k, v, col_sum, position, log_weight, length, tau, tau_set, others, keep, sinks, recent,
                       target_from, beta, variant, min_cos, bias)


def check_evict_one_ragged_inputs(k: Tensor, v: Tensor, col_sum: Tensor, position: Tensor, log_weight: Tensor,
                                  length: Tensor, tau: Tensor, tau_set: Tensor, others: list[Tensor], keep: Tensor,
                                  sinks: Tensor, recent: Tensor, target_from: Tensor, variant: str) -> None:
    """``check_evict_one_inputs`` for per-row budgets: keep, sinks, recent, target_from must be contiguous
    [B] int64 on k's device (their values are not read: that would synchronise with the device)."""
    check_layer_tensors(k, v)
    b = k.shape[0]
    for name, t in (("keep", keep), ("sinks", sinks), ("recent", recent), ("target_from", target_from)):
        if not isinstance(t, Tensor) or t.dtype != torch.int64 or tuple(t.shape) != (b,) or not t.is_contiguous():
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, Tensor) else repr(t)
            raise ValueError(f"{name} must be a contiguous torch.int64 ({b},) tensor (one value per batch row), "
                             f"got {got}")
        check_device(name, t, k.device)
    check_layer_metadata(k, v, col_sum, position, log_weight, length, tau, tau_set, others, variant)


def d2o_evict_one_ragged_triton(k: Tensor, v: Tensor, col_sum: Tensor, position: Tensor, log_weight: Tensor,
                                length: Tensor, tau: Tensor, tau_set: Tensor, others: list[Tensor], keep: Tensor,
                                sinks: Tensor, recent: Tensor, target_from: Tensor, beta: float, variant: str,
                                min_cos: float = NO_FLOOR, bias: bool = False, nearest: list[Tensor] | None = None,
                                *, splits: int | None = None, block_c: int = 32, block_scan: int = 1024,
                                num_warps: int = 8, heads: HeadGroup = SINGLE_PROCESS) -> None:
    """``d2o_evict_one``'s three Triton kernels in their RAGGED form: they load row b's keep, sinks, recent
    and target_from from the [B] tensors and take the newest entry from slot length - 1. A row within its
    own budget scans nothing."""
    run_layers([d2o_evict_one_ragged_steps(k, v, col_sum, position, log_weight, length, tau, tau_set, others, keep,
                                           sinks, recent, target_from, beta, variant, min_cos, bias, nearest,
                                           splits=splits, block_c=block_c, block_scan=block_scan,
                                           num_warps=num_warps, heads=heads)], heads)


def d2o_evict_one_ragged_steps(k: Tensor, v: Tensor, col_sum: Tensor, position: Tensor, log_weight: Tensor,
                               length: Tensor, tau: Tensor, tau_set: Tensor, others: list[Tensor], keep: Tensor,
                               sinks: Tensor, recent: Tensor, target_from: Tensor, beta: float, variant: str,
                               min_cos: float = NO_FLOOR, bias: bool = False, nearest: list[Tensor] | None = None,
                               *, splits: int | None = None, block_c: int = 32, block_scan: int = 1024,
                               num_warps: int = 8, heads: HeadGroup = SINGLE_PROCESS
                               ) -> Generator[Gathered, Gathered, None]:
    """``d2o_evict_one_ragged_triton``'s checked inputs as ``evict_one_steps`` (one layer of ``run_layers``)."""
    require_triton()
    check_evict_one_ragged_inputs(k, v, col_sum, position, log_weight, length, tau, tau_set, others, keep, sinks,
                                  recent, target_from, variant)
    check_nearest_state(k, nearest or [])
    return evict_one_steps(k, v, col_sum, position, log_weight, length, tau, tau_set, others, (0, 0, 0, 0),
                           (keep, sinks, recent, target_from), beta, variant, min_cos, bias, splits, block_c,
                           block_scan, num_warps, heads, nearest)


@torch.library.custom_op("kvpass::d2o_evict_one_ragged", mutates_args=(
    "k", "v", "col_sum", "position", "log_weight", "length", "tau", "tau_set", "others", "nearest"))
def d2o_evict_one_ragged(k: Tensor, v: Tensor, col_sum: Tensor, position: Tensor, log_weight: Tensor,
                         length: Tensor, tau: Tensor, tau_set: Tensor, others: list[Tensor], nearest: list[Tensor],
                         keep: Tensor, sinks: Tensor, recent: Tensor, target_from: Tensor, beta: float, variant: str,
                         min_cos: float = NO_FLOOR, bias: bool = False) -> None:
    """``nearest``: [] or the layer's six tensors of ``NEAREST_INPUTS``; the plain-torch step scans and names no
    candidates (here, unlike ``d2o_evict_one``'s reference: the rows' candidates would need their own splits),
    so on CPU the fused search finds nothing to search for."""
    d2o_evict_one_ragged_reference(k, v, col_sum, position, log_weight, length, tau, tau_set, others, keep, sinks,
                                   recent, target_from, beta, variant, min_cos, bias)


@d2o_evict_one_ragged.register_fake
def _(k, v, col_sum, position, log_weight, length, tau, tau_set, others, nearest, keep, sinks, recent, target_from,
      beta, variant, min_cos=NO_FLOOR, bias=False):
    return None


if HAS_TRITON:
    @d2o_evict_one_ragged.register_kernel("cuda")
    def _(k, v, col_sum, position, log_weight, length, tau, tau_set, others, nearest, keep, sinks, recent,
          target_from, beta, variant, min_cos=NO_FLOOR, bias=False):
        d2o_evict_one_ragged_triton(k, v, col_sum, position, log_weight, length, tau, tau_set, others, keep, sinks,
                                    recent, target_from, beta, variant, min_cos, bias, nearest)
