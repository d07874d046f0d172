"""Chelsea / CentroidKV (Hu et al. 2025): KV cache clustering by Chunked Soft Matching (docs/policies.md §1)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor

import kvpass.kernels  # noqa: F401  (registers torch.ops.kvpass)
from kvpass.cache import EMPTY, LayerCache, keep_slots, load_into, with_capacity
from kvpass.policies.base import Policy, require
from kvpass.policies.calibration import Calibration, load_calibration
from kvpass.policies.capabilities import InPlace
from kvpass.policies.selection import slot_places

if TYPE_CHECKING:
    from kvpass.rewrites.attention_sites import AttentionSite

STEP = "chelsea_step"   # LayerCache.state: [B, Hkv] int64 clustering steps done (the i of the r schedule)


@dataclass(frozen=True)
class CSMPlan:
    """One Chunked Soft Matching step of every (b, g) row (§1.5).

    sim: [B, Hkv, E] fp32 best cosine of each A-set entry (-inf where it has no edge); src, dst:
    [B, Hkv, E] int64 slot of the A-set entry and of its B-set partner; n_rm: [B, Hkv] int64 edges
    kept; target: [B, Hkv, C] int64 slot each entry merges into, -1 where it is not merged (the
    ``kvpass::merge_weighted`` convention)."""

    sim: Tensor
    src: Tensor
    dst: Tensor
    n_rm: Tensor
    target: Tensor


@dataclass(frozen=True)
class Chelsea(Policy, InPlace):
    """Chunked Soft Matching (docs/policies.md §1, Llama-2-7B-32K schedule of §1.2).

    While a row holds more than ``keep`` entries: split the middle region [sinks, s - recent) into
    chunks of ``chunk`` entries, A-set = even local indices, B-set = odd ones (§1.5 step 2); each
    A-set entry draws an edge to its most cosine-similar B-set entry of its chunk; the n_rm = min(
    floor(r M), s - keep, edges) globally best edges are kept and every such A-set entry merges into
    its partner by the degree-weighted mean (§1.6, ``kvpass::merge_weighted``), the merged entry
    taking the partner's place. The degree N lives in the cache's log-weight (log N), which the dense
    decode op adds to the logits (§1.8). r follows r_i = max(r_init - alpha * min(m, i), r_min) with
    i a per-row step counter shared by prefill and decode (§1.7, [OURS] global). Clustering re-runs
    once a layer has grown ``interval`` = g entries past its budget (§1.4).

    Parameters
    ----------
    sinks, recent: n1 = 16 and n2 = 64 entries never merged. chunk: c = 256.
    r_init, alpha, m, r_min: the r schedule (Llama-2: 0.45, 0.05, 3; r_min = 0.05 [OURS]).
    interval: g = 64 [OURS].
    calibration: outlier heads (§1.10): a file written by ``kvpass calibrate``, the name of one shipped
        in kvpass/calibrations (``"smollm2"``) or a ``Calibration``; None (default): every KV head is
        compressed. Its heads keep every token in their own dense buffers (split-group layout, §0.6 b)
        and the other heads get the reallocated budget R' = (R H - O) / (H - O) (``full_kv_heads``).

    The NIAH setting of the paper (Appendix D.1, §1.2) is a constant r = 0.25 with no outlier heads at
    a 25% budget: ``r_init=0.25, alpha=0`` (``--set r_init=0.25 --set alpha=0 --budget 0.25``).
    """

    name: ClassVar[str] = "chelsea"
    section: ClassVar[str] = "§1"
    summary: ClassVar[str] = "chunked soft matching: merge similar keys into degree-weighted centroids"
    rows_independent: ClassVar[bool] = True     # each (b, g) row merges within itself; the step counter is per row
    sinks: int = 16
    recent: int = 64
    chunk: int = 256
    r_init: float = 0.45
    alpha: float = 0.05
    m: int = 3
    r_min: float = 0.05
    interval: int = 64
    calibration: Calibration | str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.calibration is not None:        # a path or shipped name -> the validated file content
            object.__setattr__(self, "calibration", load_calibration(self.calibration))
        for name in ("sinks", "recent", "m"):
            value = getattr(self, name)
            require(isinstance(value, int) and value >= 0, f"chelsea: {name} must be an int >= 0, got {value!r}")
        require(isinstance(self.chunk, int) and self.chunk >= 2, f"chelsea: chunk must be an int >= 2, got {self.chunk!r}")
        require(0.0 < self.r_min <= 0.5, f"chelsea: r_min must lie in (0, 0.5], got {self.r_min!r}")
        require(0.0 < self.r_init <= 0.5, f"chelsea: r_init must lie in (0, 0.5], got {self.r_init!r}")
        require(self.alpha >= 0.0, f"chelsea: alpha must be >= 0, got {self.alpha!r}")

    def min_budget(self) -> int:
        return self.sinks + self.recent + 1

    def full_kv_heads(self, sites: Sequence[AttentionSite]) -> dict[int, tuple[int, ...]]:
        """The calibration's outlier heads by layer (§1.10); ValueError if it is for another model."""
        return {} if self.calibration is None else self.calibration.heads_by_layer(sites)

    def ratio(self, step: Tensor) -> Tensor:
        """r of the schedule (§1.7) for step counters ``step`` (any shape, int64) -> float64."""
        r = self.r_init - self.alpha * step.clamp(max=self.m).double()
        return r.clamp(min=self.r_min, max=0.5)

    def plan(self, cache: LayerCache, keep: int, step: Tensor) -> CSMPlan:
        """The merges of one CSM step (§1.5, §1.7) for every row holding more than ``keep`` entries."""
        b, hkv, c_slots, _ = cache.k.shape
        n1, n2, c = self.sinks, self.recent, self.chunk
        s = cache.length                                                      # [B, Hkv]
        device = cache.k.device
        n_chunks = max(-(-(c_slots - n1) // c), 1)
        slot = (n1 + torch.arange(n_chunks * c, device=device)).view(n_chunks, c)
        a_slot, b_slot = slot[:, 0::2].reshape(-1), slot[:, 1::2].reshape(-1)  # even / odd local indices
        a_mid, b_mid = (sl < (s - n2)[..., None] for sl in (a_slot, b_slot))    # [B, Hkv, E]: in the middle
        a_k, b_k = (cache.k.index_select(2, sl.clamp(max=c_slots - 1)) for sl in (a_slot, b_slot))
        # each A-set entry's most cosine-similar middle B-set entry of its chunk (ties: lowest index)
        arg, sim = torch.ops.kvpass.cosine_match(a_k, b_k, b_mid, (c + 1) // 2, c // 2)
        sim = sim.masked_fill(~a_mid, EMPTY)                                  # [B, Hkv, E]
        src = a_slot.expand_as(sim)
        dst = b_slot[arg.clamp(min=0)]
        n_avail = torch.isfinite(sim).sum(-1)
        mid_len = (s - n1 - n2).clamp(min=0)
        n_rm = torch.minimum(torch.floor(self.ratio(step) * mid_len).long(), (s - keep).clamp(min=0))
        n_rm = torch.minimum(n_rm.clamp(min=1), n_avail).masked_fill(s <= keep, 0)
        chosen = best_edges(sim, n_rm, c_slots - keep)                       # n_rm <= s - keep <= C - keep
        target = torch.full((b, hkv, max(c_slots, n1 + n_chunks * c)), -1, dtype=torch.long, device=device)
        target = target.scatter(2, src, torch.where(chosen, dst, -1))[..., :c_slots]   # src are distinct
        return CSMPlan(sim=sim, src=src, dst=dst, n_rm=n_rm, target=target)

    def step(self, cache: LayerCache, keep: int, step: Tensor) -> tuple[LayerCache, Tensor]:
        """One CSM step: merge the planned edges and drop the merged A-set entries. Returns the new
        cache (same capacity) and the rows that stepped [B, Hkv] bool."""
        plan = self.plan(cache, keep, step)
        live = cache.live & (plan.target < 0)                                 # what stays: live, not merged away
        place = slot_places(live)                                             # live first, in sequence order
        # degree-weighted means (w = N = exp(log_weight)), log_weight' = log of the summed degrees, every
        # slot's row written at its place in the same pass
        merged = torch.ops.kvpass.merge_weighted(cache.k, cache.v, cache.log_weight.exp(), plan.target, place)
        j = torch.arange(cache.capacity, device=place.device).expand_as(place)
        idx = torch.empty_like(place).scatter(-1, place, j)                   # slot i holds the entry of idx[i]
        return keep_slots(cache, idx, gathered=merged), plan.n_rm > 0

    def compress(self, cache: LayerCache, keep: int) -> LayerCache:
        """cache: [B, Hkv, C, ...] -> rows of at most ``keep`` entries (capacity max(keep, ...)),
        by repeated CSM steps (§1.7); ``state['chelsea_step']`` [B, Hkv] counts the steps."""
        b, hkv = cache.length.shape
        step = cache.state.get(STEP, torch.zeros(b, hkv, dtype=torch.long, device=cache.k.device))
        require(keep >= self.min_budget(), f"chelsea: keep={keep} is below sinks + recent + 1 = {self.min_budget()}")
        # one read of the lengths and step counters, then no sync: the steps the loop takes are known
        lengths, counters = torch.stack([cache.length, step]).flatten(1).tolist()
        n_steps = max((self.steps_to_budget(n, i, keep) for n, i in zip(lengths, counters, strict=True)), default=0)
        for _ in range(n_steps):
            cache, stepped = self.step(cache, keep, step)
            step = step + stepped.long()
        cache.state = {**cache.state, STEP: step}
        return with_capacity(cache, keep, check=False)                       # every row holds <= keep now

    def steps_to_budget(self, length: int, step: int, keep: int) -> int:
        """CSM steps a row of ``length`` entries at step counter ``step`` takes to hold at most ``keep``: ``plan``'s
        n_rm = min(max(floor(r mid), 1), s - keep, n_avail) replayed on the host, in the same float64 arithmetic,
        with n_avail = the middle's A-set entries that have a B-set entry in their chunk (every A-set entry has
        a finite cosine to each of those). keep >= sinks + recent + 1, so a row over budget always removes one."""
        n = 0
        while length > keep:
            mid = length - self.sinks - self.recent
            r = min(max(self.r_init - self.alpha * float(min(step, self.m)), self.r_min), 0.5)
            full, rest = divmod(mid, self.chunk)
            avail = full * ((self.chunk + 1) // 2) + ((rest + 1) // 2 if rest >= 2 else 0)
            length -= min(max(math.floor(r * mid), 1), length - keep, avail)
            step, n = step + 1, n + 1
        return n

    def one_step_suffices(self, capacity: int, keep: int) -> bool:
        """Whether one CSM step brings every row of a ``capacity``-slot cache down to ``keep`` entries (a
        static fact, so the decode step can run it without asking the device). A row of s > keep entries
        removes n_rm = min(max(floor(r mid), 1), s - keep, n_avail) with mid = s - sinks - recent, r >= r_min
        and n_avail >= floor(mid / 2) (the middle's A-set entries that have a B-set partner); s - keep grows
        faster with s than the other two, so s = capacity is the worst row (one spare for float rounding)."""
        mid = capacity - self.sinks - self.recent
        need = capacity - keep
        return need <= 0 or (self.r_min * mid >= need + 1 and mid // 2 >= need)

    def compress_into(self, cache: LayerCache, keep: int) -> None:
        """The decode step's compression (capacity = keep + interval): one CSM step, with no host sync so
        a CUDA graph can hold it, where ``one_step_suffices`` (the loop of ``compress`` would stop after
        that step too: same entries in the same slots); otherwise ``compress`` and a copy back."""
        if not self.one_step_suffices(cache.capacity, keep):
            super().compress_into(cache, keep)
            return
        b, hkv = cache.length.shape
        if STEP not in cache.state:
            cache.state[STEP] = torch.zeros(b, hkv, dtype=torch.long, device=cache.k.device)
        step = cache.state[STEP]
        out, stepped = self.step(cache, keep, step)
        out.state = {**cache.state, STEP: step + stepped.long()}
        load_into(cache, out)


def best_edges(sim: Tensor, n_rm: Tensor, bound: int) -> Tensor:
    """Each row's ``n_rm`` highest finite similarities (ties: the lowest index), as a stable descending
    sort would pick them. sim: [B, Hkv, E] fp32 (-inf: no edge); n_rm: [B, Hkv] int64, at most ``bound``.
    Returns chosen [B, Hkv, E] bool.

    One top-k of ``min(bound, E)`` over a key unique per entry (the float's order-preserving integer in
    the high 32 bits, the reversed index in the low 32): a decode step, whose bound is the interval,
    selects a few dozen of thousands of edges without sorting them all."""
    e = sim.shape[-1]
    bits = (sim + 0.0).view(torch.int32)                                      # + 0.0: -0 becomes +0
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()          # negative floats: reversed order
    key = (ordered << 32) + (2**32 - 1 - torch.arange(e, device=sim.device))
    top = key.topk(max(min(bound, e), 0), dim=-1).indices                    # descending
    in_rank = torch.arange(top.shape[-1], device=sim.device) < n_rm[..., None]
    return torch.zeros_like(sim, dtype=torch.bool).scatter(-1, top, in_rank) & torch.isfinite(sim)
