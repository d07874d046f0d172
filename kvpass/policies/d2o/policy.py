"""D2O, Dynamic Discriminative Operations (Wan et al., ICLR 2025; docs/policies.md §5): the policy's data, its
layer budgets and which form of its compression runs where (``reference.py`` defines them all)."""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

import kvpass.kernels  # noqa: F401  (registers torch.ops.kvpass)
from kvpass.cache import LayerCache, load_into
from kvpass.policies.allocation import apportion
from kvpass.policies.base import Policy, Stat, require
from kvpass.policies.capabilities import FusedDecodeStatistics, GathersAcrossHeads, RaggedRows, compress_job
from kvpass.policies.d2o.evict_many import d2o_evict_many  # noqa: F401  (registers the op)
from kvpass.policies.d2o.evict_one import Gathered, evict_one_steps, run_layers, split_tensor
from kvpass.policies.d2o.in_place import StepTensors, evict_in_place
from kvpass.policies.d2o.merge import NO_FLOOR, NO_MERGE, StepOptions
from kvpass.policies.d2o.nearest import CANDIDATES, forget_candidates, layer_nearest, nearest_state
from kvpass.policies.d2o.reference import compress_reference

_CHOICES = {"d2o_variant": ("paper", "code"), "allocation": ("code", "paper", "uniform"),
            "scores": ("accumulated", "window"), "window_pool": ("avg", "max"),
            "merge_weighting": ("similarity", "score"), "first_compression": ("prefill", "decode"),
            "skip_memory": ("shared", "extra")}
_FLAGS = ("merge", "merge_into_sinks", "merge_bias", "merge_chains")


def _one_of(choices: tuple[str, ...]) -> str:
    quoted = [repr(c) for c in choices]
    return f"{', '.join(quoted[:-1])} or {quoted[-1]}"


@dataclass(frozen=True)
class D2O(Policy, RaggedRows, GathersAcrossHeads, FusedDecodeStatistics):
    """Layer budgets from attention variance (§5.4), H2O-style eviction with sinks and a recent window (§5.5) and
    merging of evicted tokens into their nearest kept key under an EMA threshold (§5.6). Decode attention is plain.

    Layer level: per query head the unbiased variance of the prefill column sums, min-max normalised in the layer,
    averaged -> sig_l (per batch row: each row's budgets are its own); rho = softmax(-sig); budget_l = L rho_l
    budget, clamped to [1, prompt] and re-split so the total is exactly L budget [OURS]. Token level: of a budget
    b, the recent window M = floor(b m / (n + m)) and N = b - M holding min(sinks, N) sinks and the top ``col_sum``
    (group mean, §0.5). Each evicted entry is matched to its most cosine-similar kept key (post-RoPE, fp32); the
    per-row EMA threshold tau is the mean best similarity at the first eviction, then beta mean + (1 - beta) tau.
    "paper": k_j <- (e k_j + sum exp(u) k_i) / (e + sum exp(u)) where u >= tau per (head, token); "code":
    k_j <- (k_j + sum u k_i) / (1 + |E_j|), decided per evicted slot on the mean over heads. Values alike.

    Parameters (docs/d2o-official.md says which options are the paper's, the code's or ours)
    ----------
    sinks: first tokens always kept, inside N (code: 4). n_m_ratio: N:M (paper: 3:1; a spec writes "7:1").
    beta: EMA weight of the current step (0.7). d2o_variant: "paper" or "code" (§5.6).
    allocation: "code" (normalised variance), "paper" (raw variance) or "uniform" (§5.4).
    skip_layers: compressed layers (negative from the end) kept whole; paid for by the others unless
        skip_memory="extra" (the code's: at extra memory, never compressed).
    interval: decode steps between compressions: 1 (the paper's one in, one out) or m > 1, each due row then
        evicting m entries at once in place (faster at long prompts; §5.2 has what it cost in answers).
    scores: "accumulated" (the paper) or "window": the first compression ranks by SnapKV-style observation
        scores (``window`` queries, pooled by ``window_pool`` "avg"/"max" over the odd ``window_kernel``), the
        accumulated score then starting from them [OURS].
    merge: False evicts without merging [OURS]. merge_floor: a cosine floor in [-1, 1] a merge must reach too.
    merge_into_sinks: False keeps the sinks from absorbing. merge_protect: the floor(merge_protect keep) kept
        entries of highest score never absorb (§5.6 step 5). merge_weighting: "similarity" or "score" (the
        entries' scores as weights, §5.6 step 6). merge_bias: log(n) added to the logit of an entry standing for
        n tokens. merge_chains: with interval > 1 an evicted entry may merge into a later evicted one (step 7).
    first_compression: "prefill", or "decode": the code's timing, the prompt compressed after the first step.

    Forms (all tested against ``compress_reference``): prefill and any other capacity, the reference; a decode
    step evicting one entry, ``kvpass::d2o_evict_one`` (Triton on CUDA, with the nearest keys of its candidates
    from the decode attention at batch >= 4); evicting m > 1, ``kvpass::d2o_evict_many``; merge_protect and score
    weights (which the kernels lack), fp64 and tensor-parallel evict-many, the plain-torch ``evict_in_place``.
    """

    name: ClassVar[str] = "d2o"
    section: ClassVar[str] = "§5"
    summary: ClassVar[str] = "variance layer budgets + H2O eviction + EMA-threshold merging"
    sinks: int = 4
    n_m_ratio: tuple[int, int] = (3, 1)
    beta: float = 0.7
    d2o_variant: str = "paper"
    allocation: str = "code"
    skip_layers: tuple[int, ...] = ()
    interval: int = 1
    scores: str = "accumulated"
    window: int = 32
    window_kernel: int = 7
    window_pool: str = "avg"
    merge: bool = True
    merge_floor: float | None = None
    merge_into_sinks: bool = True
    merge_protect: float = 0.0
    merge_weighting: str = "similarity"
    merge_bias: bool = False
    merge_chains: bool = True
    first_compression: str = "prefill"
    skip_memory: str = "shared"

    def __post_init__(self) -> None:
        super().__post_init__()
        require(isinstance(self.sinks, int) and self.sinks >= 0, f"d2o: sinks must be an int >= 0, got {self.sinks!r}")
        if isinstance(self.n_m_ratio, str):     # a spec's "n:m" (d2o[n_m_ratio=7:1])
            parts = self.n_m_ratio.split(":")
            require(len(parts) == 2 and all(x.strip().isdigit() for x in parts),
                    f"d2o: n_m_ratio must be two ints 'n:m', got {self.n_m_ratio!r}")
            object.__setattr__(self, "n_m_ratio", (int(parts[0]), int(parts[1])))
        ratio = tuple(self.n_m_ratio)
        require(len(ratio) == 2 and all(isinstance(x, int) and x >= 0 for x in ratio) and sum(ratio) > 0,
                f"d2o: n_m_ratio must be two ints >= 0, not both 0, got {self.n_m_ratio!r}")
        require(0.0 <= self.beta <= 1.0, f"d2o: beta must lie in [0, 1], got {self.beta!r}")
        for name, choices in _CHOICES.items():
            value = getattr(self, name)
            require(value in choices, f"d2o: {name} must be {_one_of(choices)}, got {value!r}")
        require(all(isinstance(i, int) for i in self.skip_layers), f"d2o: skip_layers must be ints, got {self.skip_layers!r}")
        require(isinstance(self.window, int) and self.window >= 1, f"d2o: window must be an int >= 1, got {self.window!r}")
        require(isinstance(self.window_kernel, int) and self.window_kernel >= 1 and self.window_kernel % 2 == 1,
                f"d2o: window_kernel must be an odd int >= 1, got {self.window_kernel!r}")
        for name in _FLAGS:
            require(isinstance(getattr(self, name), bool), f"d2o: {name} must be True or False, got {getattr(self, name)!r}")
        protect, floor = self.merge_protect, self.merge_floor
        require(isinstance(protect, (int, float)) and not isinstance(protect, bool) and 0.0 <= protect < 1.0,
                f"d2o: merge_protect must be a number in [0, 1), got {protect!r}")
        require(floor is None or (isinstance(floor, (int, float)) and not isinstance(floor, bool) and -1.0 <= floor <= 1.0),
                f"d2o: merge_floor must be None or a number in [-1, 1], got {floor!r}")

    # ------------------------------------------------------------------ what the graphs and the runtime read
    @property
    def stats(self) -> frozenset[Stat]:        # an instance's: scores="window" adds the window scores
        extra = {Stat.WINDOW_SCORES} if self.scores == "window" else set()
        return frozenset({Stat.COLUMN_SUM, Stat.HEAD_VARIANCE, *extra})

    def stat_options(self, stat: Stat) -> dict[str, object]:
        if stat == Stat.WINDOW_SCORES:
            return {"obs_window": self.window, "kernel": self.window_kernel, "pool": self.window_pool}
        return {}

    def min_budget(self) -> int:
        return 1 if self.merge_into_sinks else self.sinks + 1

    def prompt_compression_deferred(self) -> bool:
        return self.first_compression == "decode"

    def uncompressed_layers(self, n_layers: int) -> frozenset[int]:
        if self.skip_memory != "extra":
            return frozenset()
        return frozenset(i % n_layers for i in self.skip_layers if -n_layers <= i < n_layers)

    def prepare(self, cache: LayerCache, layer: int, budget: int) -> LayerCache:
        """scores="window": from here on the accumulated score starts from the window scores."""
        if self.scores == "window" and Stat.WINDOW_SCORES.value in cache.slot_meta:
            cache.slot_meta[Stat.COLUMN_SUM.value] = cache.slot_meta.pop(Stat.WINDOW_SCORES.value).float()
        return cache

    def deferred_scores(self) -> int:
        """``interval`` m > 1: the scores are read every m steps, so the steps' rows are computed then."""
        return self.interval if self.interval > 1 else 0

    def nearest_candidates(self) -> int:
        """The one-in-one-out step of the Triton op (no merge_protect, no score weights) names the next step's
        candidates, whose nearest keys the decode attention finds (``nearest.py``)."""
        return CANDIDATES if self.interval == 1 and self._kernel_options() else 0

    def decode_state(self, cache: LayerCache) -> dict[str, Tensor]:
        return nearest_state(cache)

    # ------------------------------------------------------------------ layer level (§5.4)
    def layer_density(self, caches: list[LayerCache]) -> list[float]:
        """sig_l per compressed layer from state['attn_var'] [B, Hq] (rows given together are averaged)."""
        out = []
        for cache in caches:
            var = self.heads.gather(cache.state[Stat.HEAD_VARIANCE.value]).double()   # [B, Hq], every rank's heads
            if self.allocation == "code":
                lo, hi = var.min(-1, keepdim=True).values, var.max(-1, keepdim=True).values
                var = (var - lo) / (hi - lo + 1e-6)
            out.append(float(var.mean()))
        return out

    def layer_budgets(self, budget: int, caches: list[LayerCache]) -> list[int]:
        n_layers = len(caches)
        prompt = max(int(c.length.max()) for c in caches)
        skip = ({i % n_layers for i in self.skip_layers if -n_layers <= i < n_layers}
                if self.skip_memory == "shared" else set())      # "extra": the runtime keeps them out
        total = n_layers * budget
        fixed = {i: max(prompt, 1) for i in skip}
        rest = [i for i in range(n_layers) if i not in skip]
        left = total - sum(fixed.values())
        if rest and left < len(rest):
            raise ValueError(f"d2o: skip_layers={self.skip_layers} keep {sum(fixed.values())} entries, leaving "
                             f"{left} of the total {total} for {len(rest)} other layers; lower skip_layers or raise the budget")
        if not rest:
            return [fixed[i] for i in range(n_layers)]
        if self.allocation == "uniform":
            shares = [1.0] * len(rest)
        else:
            rho = torch.softmax(-torch.tensor(self.layer_density(caches), dtype=torch.float64), dim=0)
            shares = [float(rho[i]) for i in rest]
        got = dict(fixed)
        got.update(zip(rest, apportion(shares, left, low=1, high=max(prompt, budget)), strict=True))
        return [got[i] for i in range(n_layers)]

    # ------------------------------------------------------------------ token level (§5.5, §5.6)
    def split(self, keep: int | Tensor) -> tuple[int | Tensor, int | Tensor, int | Tensor]:
        """(sinks, important N incl. sinks, recent M) of a budget of ``keep`` entries (an int, or [B] int64: per
        batch row, each [B])."""
        n, m = self.n_m_ratio
        recent = keep * m // (n + m)
        important = keep - recent
        return (important.clamp(max=self.sinks) if isinstance(keep, Tensor) else min(self.sinks, important),
                important, recent)

    def step_options(self) -> StepOptions:
        protect = float(self.merge_protect) if self.merge and self.merge_protect > 0 else 0.0
        min_cos = NO_MERGE if not self.merge else NO_FLOOR if self.merge_floor is None else float(self.merge_floor)
        chains = self.interval if self.merge_chains and self.merge and self.interval > 1 else 0
        return StepOptions(beta=self.beta, variant=self.d2o_variant, min_cos=min_cos, bias=self.merge_bias,
                           protect=protect, score_weights=self.merge_weighting == "score", chains=chains)

    def _score_name(self, cache: LayerCache) -> str:
        """What the eviction ranks: the window scores before ``prepare`` (scores="window"), else ``col_sum``."""
        if self.scores == "window" and Stat.WINDOW_SCORES.value in cache.slot_meta:
            return Stat.WINDOW_SCORES.value
        return Stat.COLUMN_SUM.value

    def _protected(self, keep: int | Tensor) -> tuple[int | Tensor, int | Tensor, int | Tensor]:
        """(sinks, recent, target_from) of a budget (an int, or [B] int64 per batch row)."""
        sinks, _, recent = self.split(keep)
        zero = torch.zeros_like(keep) if isinstance(keep, Tensor) else 0
        return sinks, recent, zero if self.merge_into_sinks else sinks

    def compress(self, cache: LayerCache, keep: int) -> LayerCache:
        """cache: k, v [B, Hkv, C, D], slot_meta['col_sum'] [B, Hkv, C] fp32 -> capacity min(keep, C), merged, the
        EMA threshold in state (``compress_reference``)."""
        return compress_reference(cache, self._score_name(cache), keep, *self._protected(keep), self.step_options(),
                                  self.heads)

    # ------------------------------------------------------------------ the fast forms
    def compress_into(self, cache: LayerCache, keep: int) -> None:
        """In place where every row evicts at most ``interval`` entries (capacity keep + 1 .. keep + interval): each
        row over ``keep`` evicts down to it. Any other capacity: ``compress`` and a copy back."""
        if not 1 <= cache.capacity - keep <= self.interval:
            forget_candidates(cache)
            load_into(cache, self.compress(cache, keep))
            return
        self._evict(cache, keep, keep + 1, cache.capacity - keep)

    def rows_in_one_call(self, budgets: Sequence[int], capacities: Sequence[int]) -> bool:
        """Interval 1: no row's capacity above its budget + 1 (a row is due exactly when it holds budget + 1).
        Interval m: every row's capacity its budget + m, or within its budget (it never compresses)."""
        if self.interval == 1:
            return all(1 <= cap <= keep + 1 for keep, cap in zip(budgets, capacities, strict=True))
        return all(1 <= cap <= keep or cap == keep + self.interval for keep, cap in zip(budgets, capacities, strict=True))

    def compress_rows_into(self, cache: LayerCache, keep: Tensor) -> None:
        """Rows of their own budgets keep [B] int64: a due row (budget + interval entries in some head) evicts
        ``interval`` entries as alone, the others are left as they are. No host sync."""
        self._evict(cache, keep.to(device=cache.k.device, dtype=torch.long).contiguous(), keep + self.interval,
                    self.interval)

    def compress_layers_into(self, jobs: Sequence[tuple[LayerCache, int | Tensor]]) -> None:
        """Under tensor parallelism on CUDA, the layers whose one-in-one-out Triton step applies run kernels A and B,
        then one all-gather of every layer's per-head statistics, then kernel C (``run_layers``): one collective a
        step, each layer as alone. Any other job first, on its own path (every rank takes the same paths)."""
        steps = []
        for cache, keep in jobs:
            step = self._sharded_step(cache, keep)
            if step is None:
                compress_job(self, cache, keep)
            else:
                steps.append(step)
        run_layers(steps, self.heads)

    def _kernel_options(self) -> bool:
        """Whether the options are the Triton steps' (they have no protected targets and no score weights)."""
        return not (self.merge and self.merge_protect > 0) and self.merge_weighting == "similarity"

    def _on_kernels(self, cache: LayerCache) -> bool:
        return cache.k.is_cuda and not torch.compiler.is_exporting() and self._kernel_options()

    def _inputs(self, cache: LayerCache, keep: int | Tensor, due: int | Tensor) -> tuple[StepTensors, Tensor]:
        """The layer's tensors and the [5, B] split of the ops (an int budget's checked: the ops read [B] values
        on the device, unchecked, and a row with no candidate or no merge target would poison the threshold)."""
        sinks, recent, target_from = self._protected(keep)
        if isinstance(keep, int) and not (sinks + recent <= keep and 0 <= target_from < keep):
            raise ValueError(f"d2o: a budget of {keep} leaves sinks {sinks}, recent {recent} and merge targets "
                             f"from slot {target_from}: a layer needs at least {self.min_budget()} entries")
        split = split_tensor(cache.k.shape[0], cache.k.device, keep, due, sinks, recent, target_from)
        return StepTensors.of(cache, self._score_name(cache)), split

    def _sharded_step(self, cache: LayerCache, keep: int | Tensor) -> Generator[Gathered, Gathered, None] | None:
        """The one-in-one-out Triton step under tensor parallelism as one layer of ``run_layers``, or None."""
        m = self.interval if isinstance(keep, Tensor) else cache.capacity - keep
        if self.heads.world == 1 or not self._on_kernels(cache) or m != 1:
            return None
        t, split = self._inputs(cache, keep, keep + 1)
        return evict_one_steps(t, layer_nearest(cache), split, self.step_options(), self.heads)

    def _evict(self, cache: LayerCache, keep: int | Tensor, due: int | Tensor, m: int) -> None:
        """The in-place step: the Triton ops where their options, device and process allow, else plain torch."""
        opts = self.step_options()
        if self._on_kernels(cache) and m == 1:
            if self.heads.world > 1:
                run_layers([self._sharded_step(cache, keep)], self.heads)
                return
            t, split = self._inputs(cache, keep, due)
            torch.ops.kvpass.d2o_evict_one(*t, layer_nearest(cache), split, opts.beta, opts.variant, opts.min_cos,
                                           opts.bias)
        elif self._on_kernels(cache) and self.heads.world == 1 and cache.k.dtype != torch.float64:
            t, split = self._inputs(cache, keep, due)
            torch.ops.kvpass.d2o_evict_many(*t, split, m, opts.beta, opts.variant, opts.min_cos, opts.bias,
                                            opts.chains)
        else:
            forget_candidates(cache)          # the plain-torch step keeps no norms
            evict_in_place(StepTensors.of(cache, self._score_name(cache)), keep, due, m, *self._protected(keep),
                           opts, self.heads)
