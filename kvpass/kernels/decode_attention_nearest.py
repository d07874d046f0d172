"""Decode attention that also finds the nearest key of a few candidate slots, from the same read of K.

D2O's one-in-one-out step (kvpass/policies/d2o/evict_one.py, docs/policies.md §5.5-5.6) evicts the live entry e of
lowest accumulated score outside the sinks and the recent window, and merges it into its most cosine-similar other
live key: a second read of every kept key, each step and layer. Which entry the next step evicts is known a step
early, up to this step's scores: the step's eviction kernel names the M lowest-score entries that the next step may
evict (``candidates``), and this op, which reads every key anyway, finds each candidate's nearest key beside the
attention. The next eviction uses that result where its e is among the candidates, and scans the keys as before
otherwise (nothing is approximated: the same slots, the same cosine up to fp32 rounding).

For batch b, KV head g and candidate r < M with slot c = candidates[b, g, r] (-1: none), over the live slots j
(log_weight > -inf), j != c, j >= target_from[b, g]:

    near_best[b, g, r] = max_j cos(k_c, k_j),  cos(x, y) = x . y / (max(|x|, eps) max(|y|, eps)), eps = 1e-12
    near_slot[b, g, r] = the first j of that maximum   (-inf and 0 where c = -1 or no j qualifies)
    near_cand[b, g, r] = c                             (the candidates these results belong to)

and (o, scores) exactly as ``decode_attention`` (o is the same tensor bit for bit on CUDA: the candidates take
the query tile's spare rows, which no output reads).

The Triton kernel reads |k_j| from ``inv_norm`` [B, Hkv, C] fp32 (1 / max(|k_j|, eps), kept by the eviction op:
computed where it scans a row, updated where it merges or moves), not from K: a slot whose entry is NaN there
(the newest entry, written by this step) is left out, and the eviction compares e with the newest entry itself.
Computing the norms from each K tile instead cost 2.2x the attention at batch 1 (an earlier form, reverted;
benchmarks/results/d2o-nearest-in-attention-nvidia-h200/nearest-in-attention-timing-5858a05.json). The reference computes every norm from K (and so does not leave the newest
out: the eviction's comparison gives the same answer). Below a batch of ``FUSE_FROM_BATCH`` the search costs the
step more than the scan it saves (the attention is on the step's path, the scan beside it): there the op is the
plain attention and the eviction never names candidates (``fuses_at``).

Shapes: q [B, Hq, T, D]; k, v [B, Hkv, C, D]; log_weight [B, Hkv, C] fp32; candidates, near_cand, near_slot
[B, Hkv, M] int64; target_from [B, Hkv] int64; inv_norm [B, Hkv, C] fp32; near_best [B, Hkv, M] fp32. The three
near_* are written in place. The layer's six tensors live in its cache state (``NEAREST_INPUTS``;
``add_nearest_state``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvpass.kernels._triton import HAS_TRITON, check_device
from kvpass.kernels.decode_attention import decode_attention_reference, decode_attention_triton

# The op's inputs after log_weight, as a layer's cache state names them (kvpass/policies/d2o/nearest.py makes them):
# the next step's candidates and first target slot and the keys' inverse norms (written by the eviction), then this
# op's results.
NEAREST_INPUTS = ("nearest_next", "nearest_from", "nearest_inv_norm", "nearest_cand", "nearest_best",
                  "nearest_slot")
# The smallest batch whose Triton step searches in the attention: on an H200 at 32k, one layer (attention + eviction,
# scanning -> fused) 42.8 -> 46.3 us at batch 1, 93.7 -> 77.8 at 4, 448.8 -> 328.6 at 32
# (benchmarks/results/d2o-nearest-in-attention-nvidia-h200/nearest-in-attention-timing-5858a05.json).
FUSE_FROM_BATCH = 4
_EPS = 1e-12


def fuses_at(batch: int) -> bool:
    """Whether the Triton attention and eviction search the candidates' nearest keys at this batch size."""
    return batch >= FUSE_FROM_BATCH


def nearest_of_candidates_reference(k: Tensor, log_weight: Tensor, candidates: Tensor, target_from: Tensor
                                    ) -> tuple[Tensor, Tensor]:
    """(best [B, Hkv, M] fp32, slot [B, Hkv, M] int64) of the module docstring, in fp32 (fp64 keys: fp64)."""
    acc = torch.float64 if k.dtype == torch.float64 else torch.float32
    j = torch.arange(k.shape[2], device=k.device)
    has = candidates >= 0
    kc = k.to(acc).gather(2, candidates.clamp(min=0)[..., None].expand(-1, -1, -1, k.shape[3]))
    x = torch.nn.functional.normalize(kc, dim=-1, eps=_EPS)
    y = torch.nn.functional.normalize(k.to(acc), dim=-1, eps=_EPS)
    sim = x @ y.transpose(-1, -2)                                                  # [B, Hkv, M, C]
    ok = (has[..., None] & (log_weight > float("-inf"))[:, :, None, :] & (j != candidates[..., None])
          & (j >= target_from[..., None, None]))
    best, slot = sim.masked_fill(~ok, float("-inf")).max(dim=-1)                   # the first maximum
    return best.float(), torch.where(best > float("-inf"), slot, 0)


def decode_attention_nearest_reference(q: Tensor, k: Tensor, v: Tensor, log_weight: Tensor, candidates: Tensor,
                                       target_from: Tensor, inv_norm: Tensor, near_cand: Tensor, near_best: Tensor,
                                       near_slot: Tensor, scale: float, softcap: float | None = None,
                                       want_scores: bool = False) -> tuple[Tensor, Tensor]:
    """The op's definition: every norm from K (``inv_norm`` is not read). Without candidates (the CPU's steps,
    which name none) the search is skipped: its results are then -inf and 0 anyway."""
    near_cand.copy_(candidates)
    if bool((candidates >= 0).any()):
        best, slot = nearest_of_candidates_reference(k, log_weight, candidates, target_from)
        near_best.copy_(best)
        near_slot.copy_(slot)
    else:
        near_best.fill_(float("-inf"))
        near_slot.zero_()
    return decode_attention_reference(q, k, v, log_weight, scale, softcap, want_scores)


def check_nearest_inputs(k: Tensor, candidates: Tensor, target_from: Tensor, inv_norm: Tensor, near_cand: Tensor,
                         near_best: Tensor, near_slot: Tensor, op: str = "decode_attention_nearest") -> None:
    """ValueError naming the tensor, unless the six (``NEAREST_INPUTS``' order) fit k [B, Hkv, C, D] on its device
    with M a power of 2; ``op`` names the caller in the message."""
    b, h, c = k.shape[:3]
    m = candidates.shape[-1] if candidates.dim() == 3 else 0
    want = {"candidates": ((b, h, m), torch.long), "target_from": ((b, h), torch.long),
            "inv_norm": ((b, h, c), torch.float32),
            "near_cand": ((b, h, m), torch.long), "near_best": ((b, h, m), torch.float32),
            "near_slot": ((b, h, m), torch.long)}
    given = (("candidates", candidates), ("target_from", target_from), ("inv_norm", inv_norm), ("near_cand", near_cand),
             ("near_best", near_best), ("near_slot", near_slot))
    for name, t in given:
        shape, dtype = want[name]
        if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous():
            raise ValueError(f"{op}: {name} must be contiguous {dtype} {list(shape)} "
                             f"(k [B, Hkv, C, D] = {list(k.shape)}, M = {m}), got {t.dtype} {list(t.shape)}")
    if m < 1 or m & (m - 1):
        raise ValueError(f"{op}: M (candidates per row) must be a power of 2, got {m}")
    for name, t in given:                                      # devices after shapes: the same errors anywhere
        check_device(name, t, k.device)


def decode_attention_nearest_triton(q: Tensor, k: Tensor, v: Tensor, log_weight: Tensor, candidates: Tensor,
                                    target_from: Tensor, inv_norm: Tensor, near_cand: Tensor, near_best: Tensor,
                                    near_slot: Tensor, scale: float, softcap: float | None = None,
                                    want_scores: bool = False, **launch) -> tuple[Tensor, Tensor]:
    """``decode_attention_triton`` with the candidates in its query tile (same contract as the reference, the
    norms from ``inv_norm``); below ``FUSE_FROM_BATCH`` the plain attention (the near_* are left as they are:
    the eviction named no candidates)."""
    check_nearest_inputs(k, candidates, target_from, inv_norm, near_cand, near_best, near_slot)
    if not fuses_at(q.shape[0]):
        return decode_attention_triton(q, k, v, log_weight, scale, softcap, want_scores, **launch)
    return decode_attention_triton(q, k, v, log_weight, scale, softcap, want_scores,
                                   nearest=(candidates, target_from, inv_norm, near_cand, near_best, near_slot),
                                   **launch)


@torch.library.custom_op("kvpass::decode_attention_nearest", mutates_args=("near_cand", "near_best", "near_slot"))
def decode_attention_nearest(q: Tensor, k: Tensor, v: Tensor, log_weight: Tensor, candidates: Tensor,
                             target_from: Tensor, inv_norm: Tensor, near_cand: Tensor, near_best: Tensor,
                             near_slot: Tensor, scale: float, softcap: float | None = None, want_scores: bool = False
                             ) -> tuple[Tensor, Tensor]:
    return decode_attention_nearest_reference(q, k, v, log_weight, candidates, target_from, inv_norm, near_cand,
                                              near_best, near_slot, scale, softcap, want_scores)


@decode_attention_nearest.register_fake
def _(q, k, v, log_weight, candidates, target_from, inv_norm, near_cand, near_best, near_slot, scale, softcap=None,
      want_scores=False):
    scores = log_weight.new_empty(log_weight.shape if want_scores else (0,), dtype=torch.float32)
    return torch.empty_like(q), scores


if HAS_TRITON:
    @decode_attention_nearest.register_kernel("cuda")
    def _(q, k, v, log_weight, candidates, target_from, inv_norm, near_cand, near_best, near_slot, scale,
          softcap=None, want_scores=False):
        return decode_attention_nearest_triton(q, k, v, log_weight, candidates, target_from, inv_norm, near_cand,
                                               near_best, near_slot, scale, softcap, want_scores)
