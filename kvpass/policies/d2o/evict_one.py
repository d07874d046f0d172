"""``kvpass::d2o_evict_one``: D2O's one-in-one-out decode step in the layer's own buffers (docs/policies.md §5.8).

Each (b, g) row holding more than its batch row's keep entries evicts one (the newest entry, slot length - 1, takes
the evicted slot); the others are left as they are. ``split`` [5, B] int64 holds each batch row's (keep, due, sinks,
recent, target_from) (``split_tensor``: one tensor per budget tuple, or the rows' own budgets), read by the kernels
on the device: no compilation per budget, no host sync, the CUDA graph captures it. The CPU kernel is the plain-torch
step (``in_place.evict_in_place`` with m = 1); on CUDA three Triton kernels (``evict_one_kernels.py``). Both must
hold what ``reference.compress_reference`` gives each row at capacity keep + 1 (tests/policies/d2o/).

``nearest`` ([] or the layer's six tensors of ``nearest.NEAREST_INPUTS``): the step also names the M entries of
lowest score the next step may evict, which the decode attention (``kvpass::decode_attention_nearest``) searches
from its own read of K; the Triton step takes e's nearest key from there where e was named (batch >= 4), scans
otherwise, and keeps each key's inverse norm for that search. The CPU kernel scans and names none (so the search
finds nothing to do: on the CPU D2O runs ``evict_in_place`` itself, never this op).
Tensor parallelism (``heads``): the threshold's per-head statistics of every layer due at one step are gathered
in one all-gather (``run_layers``), so each rank decides as one process does.
"""

from __future__ import annotations

import functools
from collections.abc import Generator

import torch
from torch import Tensor

from kvpass.head_group import SINGLE_PROCESS, HeadGroup
from kvpass.kernels import add_references
from kvpass.kernels._triton import HAS_TRITON, check_device, next_pow2, require_triton, tl, triton
from kvpass.kernels.decode_attention_nearest import check_nearest_inputs, fuses_at
from kvpass.policies.d2o.evict_one_kernels import _candidate_kernel, _merge_move_kernel, _nearest_key_kernel
from kvpass.policies.d2o.in_place import StepTensors, evict_in_place
from kvpass.policies.d2o.merge import NO_FLOOR, StepOptions, every_head

Gathered = tuple[Tensor, Tensor] | None          # every rank's (u, ev) [B, H_ALL] of one layer; None in one process


def split_tensor(b: int, device: torch.device, keep: int | Tensor, due: int | Tensor, sinks: int | Tensor,
                 recent: int | Tensor, target_from: int | Tensor) -> Tensor:
    """[5, B] int64 on ``device``: each batch row's (keep, due, sinks, recent, target_from), from ints (one kept
    tensor per distinct tuple: a CUDA graph replays its address) or [B] tensors."""
    values = (keep, due, sinks, recent, target_from)
    if all(isinstance(x, int) for x in values):
        return _constant_split(b, str(device), values)
    return torch.stack([x.to(device=device, dtype=torch.long) if isinstance(x, Tensor)
                        else torch.full((b,), x, dtype=torch.long, device=device) for x in values])


@functools.lru_cache(maxsize=256)
def _constant_split(b: int, device: str, values: tuple[int, ...]) -> Tensor:
    # filled on the device (no copy from the host, which a CUDA graph's capture would refuse)
    return torch.stack([torch.full((b,), x, dtype=torch.long, device=device) for x in values])


def check_layer(t: StepTensors, variant: str, split: Tensor) -> None:
    """ValueError naming the tensor whose dtype, shape, layout or device is not what the steps take."""
    if t.k.dim() != 4 or t.v.shape != t.k.shape or t.v.dtype != t.k.dtype or not t.k.dtype.is_floating_point:
        raise ValueError(f"k, v must be one float [B, Hkv, C, D] shape, got {t.k.dtype} {tuple(t.k.shape)}, "
                         f"{t.v.dtype} {tuple(t.v.shape)}")
    if variant not in ("paper", "code"):
        raise ValueError(f"variant must be 'paper' or 'code', got {variant!r}")
    b, h, c, _ = t.k.shape
    for name, x, dtype, shape in (("score", t.score, torch.float32, (b, h, c)),
                                  ("position", t.position, torch.int64, (b, h, c)),
                                  ("log_weight", t.log_weight, torch.float32, (b, h, c)),
                                  ("length", t.length, torch.int64, (b, h)), ("tau", t.tau, torch.float32, (b,)),
                                  ("tau_set", t.tau_set, torch.bool, (b,)), ("split", split, torch.int64, (5, b))):
        if x.dtype != dtype or tuple(x.shape) != shape or not x.is_contiguous():
            raise ValueError(f"{name} must be contiguous {dtype} {shape}, got {x.dtype} {tuple(x.shape)}")
    for name, x in (("score", t.score), ("position", t.position), ("log_weight", t.log_weight),
                    ("length", t.length), ("tau", t.tau), ("tau_set", t.tau_set), ("v", t.v), ("split", split)):
        check_device(name, x, t.k.device)        # devices after shapes: the same errors anywhere
    for x in t.others:
        check_device("others", x, t.k.device)
        if tuple(x.shape[:3]) != (b, h, c):
            raise ValueError(f"other slot metadata must be [B, Hkv, C, ...] = {(b, h, c)}, got {tuple(x.shape)}")


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def default_splits(rows: int, c: int, device: torch.device) -> int:
    """Splits per row: up to eight programs per SM, at least 128 slots per split (the sweep's best at B = 1 and 4:
    many short programs, as each program's scan is a chain of dependent loads)."""
    if device.type != "cuda":
        return 1
    return max(1, min(triton.cdiv(8 * _sm_count(device.index or 0), rows), triton.cdiv(c, 128)))


def run_layers(steps: list[Generator[Gathered, Gathered, None]], heads: HeadGroup) -> None:
    """Several layers' ``evict_one_steps``: kernels A and B of every layer, then, under tensor parallelism, one
    all-gather of every layer's per-head (u, ev) (layers of one shape stacked), then every layer's kernel C. Each
    layer ends as it does alone; the collectives keep one order as long as every rank passes one order."""
    wanted = [next(step) for step in steps]
    got: list[Gathered] = [None] * len(steps)
    if heads.world > 1:
        by_shape: dict[tuple, list[int]] = {}
        for i, (u, _) in enumerate(wanted):
            by_shape.setdefault(tuple(u.shape), []).append(i)
        for members in by_shape.values():
            u_all, ev_all = every_head(heads, torch.stack([wanted[i][0] for i in members]),
                                       torch.stack([wanted[i][1] for i in members]), dim=2)     # [L, B, H_ALL]
            for j, i in enumerate(members):
                got[i] = (u_all[j].contiguous(), ev_all[j].contiguous().view(torch.uint8))
    for step, gathered in zip(steps, got, strict=True):
        try:
            step.send(gathered)
        except StopIteration:
            continue
        raise RuntimeError("evict_one_steps yielded twice")


# The step is latency-bound (a layer's row is a few thousand slots): short, wide programs. Kernel A reads up to
# BLOCK_SCAN slots an iteration, kernel B 32 keys (H200, C = 6555: 23.6 us a layer at B = 1 and 54 at B = 4, from
# 26.8 and 85.5 with 64-key blocks and 2 programs an SM; docs/speed.md).
def evict_one_steps(t: StepTensors, nearest: list[Tensor], split: Tensor, opts: StepOptions,
                    heads: HeadGroup = SINGLE_PROCESS, *, splits: int | None = None, block_c: int = 32,
                    block_scan: int = 1024, num_warps: int = 8) -> Generator[Gathered, Gathered, None]:
    """The Triton step as one layer of ``run_layers``: checks the inputs, launches kernels A and B, yields this
    rank's (u [B, Hkv] fp32, ev [B, Hkv] bool) under tensor parallelism (None in one process), takes back every
    rank's [B, H_ALL], launches kernel C and moves the other slot metadata. Below ``FUSE_FROM_BATCH`` rows the
    ``nearest`` state is left alone (the attention searched nothing there)."""
    require_triton()
    check_layer(t, opts.variant, split)
    if nearest:
        check_nearest_inputs(t.k, *nearest, op="d2o_evict_one")
    k, length = t.k, t.length
    b, h, c, d = k.shape
    splits = splits or default_splits(b * h, c, k.device)
    chunk = triton.cdiv(c, splits)
    acc = torch.float64 if k.dtype == torch.float64 else torch.float32
    e = torch.empty(b * h, dtype=torch.int64, device=k.device)
    low = torch.empty(b * h * splits, dtype=torch.float32, device=k.device)
    arg = torch.empty(b * h * splits, dtype=torch.int64, device=k.device)
    best = torch.empty(b * h * splits, dtype=acc, device=k.device)
    nearest_slot = torch.empty(b * h * splits, dtype=torch.int64, device=k.device)
    evict = length > split[0][:, None]                      # before kernel C shortens rows
    last = torch.where(evict, length - 1, c - 1)
    block_d = max(16, next_pow2(d))
    tl_acc = tl.float64 if acc == torch.float64 else tl.float32
    near = nearest if nearest and fuses_at(b) else None     # below: name nothing, keep no norms
    m = near[0].shape[-1] if near else 0
    block_k = next_pow2(m + 1) if m else 1
    nx_val = torch.empty(b * h * splits * block_k if m else 1, dtype=torch.float32, device=k.device)
    nx_slot = torch.empty(nx_val.numel(), dtype=torch.int64, device=k.device)
    nxt, c_from, inv_norm, n_cand, n_best, n_slot = near if near else (e, e, low, e, low, e)      # unread
    _candidate_kernel[(b * h, splits)](
        t.score, t.position, length, low, arg, nx_val, nx_slot, split, c, chunk, splits, h, b,
        BLOCK_SCAN=min(block_scan, next_pow2(chunk)), NPICK=m + 1 if m else 0, BLOCK_K=block_k, num_warps=4)
    _nearest_key_kernel[(b * h, splits)](
        k, length, low, arg, e, best, nearest_slot, nx_val, nx_slot, nxt, c_from, n_cand, n_best, n_slot, inv_norm,
        split, *k.stride(), h, c, chunk, splits, b, HEAD_DIM=d, BLOCK_C=block_c, BLOCK_D=block_d,
        BLOCK_SPLITS=next_pow2(splits), ACC=tl_acc, F64=acc == torch.float64, M=m, BLOCK_K=block_k,
        num_warps=num_warps)
    mine: Gathered = None
    if heads.world > 1:                                     # what kernel C computes per head, for every rank's
        mine = (torch.where(evict, best.view(b, h, splits).amax(-1).float(), 0.0), evict)
    every = yield mine
    u_all, ev_all = every if every is not None else (best, e)        # not read unless sharded
    _merge_move_kernel[(b,)](
        k, t.v, t.score, t.position, t.log_weight, length, t.tau, t.tau_set.view(torch.uint8), e, best, nearest_slot,
        u_all, ev_all, inv_norm, split, *k.stride(), *t.v.stride(), h, c, splits, float(opts.beta),
        1.0 - float(opts.beta), opts.w_self, float(opts.min_cos), h * heads.world, HEAD_DIM=d, BLOCK_H=next_pow2(h),
        BLOCK_D=min(block_d, 128), BLOCK_SPLITS=next_pow2(splits), ACC=tl_acc, PAPER=opts.variant == "paper",
        BIAS=bool(opts.bias), SHARDED=heads.world > 1, BLOCK_H_ALL=next_pow2(h * heads.world), NORMS=m > 0,
        num_warps=4, enable_fp_fusion=False)
    row0 = torch.arange(b * h, device=k.device) * c         # a row that evicts nothing: e = last = C - 1, no move
    flat_e, flat_last = e + row0, row0 + last.view(-1)
    for x in t.others:
        rows = x.view(b * h * c, *x.shape[3:])
        rows.index_copy_(0, flat_e, rows.index_select(0, flat_last))
        gone = evict.view(b * h, *([1] * (x.dim() - 3)))
        rows.index_copy_(0, flat_last, torch.where(gone, 0, rows.index_select(0, flat_last)))


def evict_one_triton(t: StepTensors, nearest: list[Tensor], split: Tensor, opts: StepOptions,
                     heads: HeadGroup = SINGLE_PROCESS, **launch) -> None:
    """The Triton step of one layer (``evict_one_steps`` alone)."""
    run_layers([evict_one_steps(t, nearest, split, opts, heads, **launch)], heads)


@torch.library.custom_op("kvpass::d2o_evict_one", mutates_args=(
    "k", "v", "score", "position", "log_weight", "length", "tau", "tau_set", "others", "nearest"))
def d2o_evict_one(k: Tensor, v: Tensor, score: Tensor, position: Tensor, log_weight: Tensor, length: Tensor,
                  tau: Tensor, tau_set: Tensor, others: list[Tensor], nearest: list[Tensor], split: Tensor, beta: float,
                  variant: str, min_cos: float = NO_FLOOR, bias: bool = False) -> None:
    d2o_evict_one_reference(k, v, score, position, log_weight, length, tau, tau_set, others, nearest, split, beta,
                            variant, min_cos, bias)


def d2o_evict_one_reference(k: Tensor, v: Tensor, score: Tensor, position: Tensor, log_weight: Tensor,
                            length: Tensor, tau: Tensor, tau_set: Tensor, others: list[Tensor], nearest: list[Tensor],
                            split: Tensor, beta: float, variant: str, min_cos: float = NO_FLOOR,
                            bias: bool = False) -> None:
    """The op's plain-torch definition (``evict_in_place``, one eviction; no candidates named), which export
    substitutes for it."""
    keep, _, sinks, recent, target_from = split.unbind(0)
    evict_in_place(StepTensors(k, v, score, position, log_weight, length, tau, tau_set, others), keep, keep + 1, 1,
                   sinks, recent, target_from, StepOptions(beta=beta, variant=variant, min_cos=min_cos, bias=bias))


@d2o_evict_one.register_fake
def _(k, v, score, position, log_weight, length, tau, tau_set, others, nearest, split, beta, variant,
      min_cos=NO_FLOOR, bias=False):
    return None


if HAS_TRITON:
    @d2o_evict_one.register_kernel("cuda")
    def _(k, v, score, position, log_weight, length, tau, tau_set, others, nearest, split, beta, variant,
          min_cos=NO_FLOOR, bias=False):
        evict_one_triton(StepTensors(k, v, score, position, log_weight, length, tau, tau_set, others), nearest,
                         split, StepOptions(beta=beta, variant=variant, min_cos=min_cos, bias=bias))

add_references({"d2o_evict_one": d2o_evict_one_reference})
