"""D2O, Dynamic Discriminative Operations (Wan et al., ICLR 2025; docs/policies.md §5)."""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

import kvpass.kernels  # noqa: F401  (registers torch.ops.kvpass)
from kvpass.cache import LayerCache, gather_slots, keep_slots, put_slots
from kvpass.kernels.cosine_match import cosine_match_reference
from kvpass.kernels.d2o_evict_many import evict_many_in_place, split_tensor
from kvpass.kernels.d2o_evict_one import (
    NO_FLOOR,
    NO_MERGE,
    SCORE_EPS,
    Gathered,
    OneEviction,
    d2o_evict_one_steps,
    evict_one_in_place,
    merged_log_weight,
    pick_one,
    protected_count,
    run_layers,
    score_merged_rows,
    threshold_and_merge,
    unprotected,
)
from kvpass.kernels.d2o_evict_one import merged_rows as _merged_rows
from kvpass.kernels.d2o_evict_one_ragged import d2o_evict_one_ragged_steps
from kvpass.kernels.d2o_merge_chains import chain_similarities, chain_window, fold_chains, put
from kvpass.kernels.decode_attention_nearest import (
    CANDIDATES,
    NEAREST_INPUTS,
    forget_candidates,
    has_nearest_state,
)
from kvpass.policies.allocation import apportion
from kvpass.policies.base import Policy, Stat, require
from kvpass.policies.selection import kept_slots, ordered_slots, select_kept

TAU, TAU_SET = "d2o_tau", "d2o_tau_set"     # LayerCache.state: EMA threshold [B] fp32, initialised [B] bool


@dataclass(frozen=True)
class D2O(Policy):
    """Layer-level allocation from attention variance + H2O-style eviction with sinks and a recent
    window + merging of evicted tokens into their nearest kept key under an EMA threshold (§5).

    Layer level (§5.4, code form): per query head the unbiased variance of the prefill column sums
    (``Stat.HEAD_VARIANCE``), min-max normalised within the layer, averaged over heads -> sig_l, per batch
    row: the runtime calls ``layer_budgets`` with each row's own caches, so a row's budgets are its own; rho = softmax(-sig); budget_l = L * rho_l * budget, clamped
    to [1, prompt length] like the code's r_l in [0.01, 1] and then re-split so the total is exactly
    L * budget [OURS: the code does not conserve it; kvpass's budget contract requires it].
    Token level (§5.5-5.6): of a budget b, the recent window is M = floor(b * m / (n + m)) and the rest
    N = b - M [OURS: the floors' remainder goes to N] holds min(sinks, N) sinks plus the top accumulated
    scores (``col_sum``, the group mean of §0.5). Each evicted entry is matched to its most cosine-similar
    kept key (post-RoPE keys, fp32); the per-layer EMA threshold tau (one scalar per batch row) is the
    mean best similarity at the first eviction and tau <- beta * mean + (1 - beta) * tau afterwards
    (the current similarities enter before the decision). Merge into the nearest kept entry:
    "paper" (GAT-like): k_j <- (e k_j + sum_i exp(u_ij) k_i) / (e + sum_i exp(u_ij)), per (head, token)
    decision u*_i >= tau; "code": k_j <- (k_j + sum_i u_ij k_i) / (1 + |E_j|), decision per evicted slot
    i on the mean over heads. Values use the keys' weights; ``col_sum`` is not changed by merging.
    Decode attention is plain (log-weights stay 0).

    With several evictions in one call (prefill, or ``interval`` > 1) the EMA takes one step with the
    mean over all of them [OURS]. By default scores and merges are per KV head (§0.5);
    ``expand_kv_heads=True`` (a field of every policy) gives the code's per-query-head cache (§5.3): K, V
    are cached repeated G = Hq/Hkv times, so every query head keeps, scores (its own ``col_sum``, not a
    group mean) and merges its own entries, the "code" decision means and tau over Hq heads, at G times
    the memory.

    Parameters
    ----------
    sinks: first tokens always kept, counted inside N (code: 4).
    n_m_ratio: important : recent split N:M (paper App. A.3: 3:1); a spec writes it "n:m" (``d2o[n_m_ratio=7:1]``).
    beta: EMA weight of the current step (paper: 0.7).
    d2o_variant: "paper" or "code" token-level merge (§5.6); default "paper".
    allocation: "code" (normalised variance, default), "paper" (raw variance softmax, §5.4 paper form,
        degenerate at long prompts) or "uniform" (every layer the same budget, Table 4 ablation).
    skip_layers: indices among the compressed layers (negative from the end) that are not compressed
        at prefill (budget = prompt length); the code skips 0, 1, L-1 at extra memory, here they are
        paid for by the other layers, so the default is none [OURS].
    interval: decode steps between compressions; 1 (default) = the paper's one-in-one-out step. 16 is faster at
        long prompts but lost 2 of 16 essay-cloze answers at 512-1k tokens, query-agnostic (docs/quality.md,
        "D2O with `interval` > 1"; with ``merge_chains`` it lost 3 of 11 on 32 cases). Above 1 a layer holds up to
        budget + interval entries and a due row evicts interval of them in place (``compress_into``,
        ``kvpass.kernels.d2o_evict_many``: on CUDA the Triton op ``kvpass::d2o_evict_many``, else plain torch;
        under tensor parallelism too, the threshold gathered from every rank).
    defer_scores: with ``interval`` > 1, compute the decode steps' attention rows once per compression from
        their kept queries instead of at every step (``deferred_scores``: the same scores up to rounding, a
        step without the per-slot scores pass). False: every step's attention returns its row (the
        before/after of tests and benchmarks).
    fuse_nearest: with ``interval`` 1 on CUDA at batch 4 or more, the decode attention also finds the nearest key
        of the four entries the next step may evict (``nearest_candidates``), so that step need not read the keys
        again: the same slots and values up to fp32 rounding (at batch 32, 32k, on an H200: 15.94 against 18.44 ms
        a step; docs/speed.md, "D2O's decode step"). Below batch 4 the step scans (the search would cost the
        step's path more than the scan beside it). False: every step scans (the before/after of benchmarks).

    Options, off by default (docs/d2o.md says which are the paper's, which the code's, and why):
    scores: "accumulated" (the paper: prompt column sums + every decode row) or "window": the first
        compression ranks by SnapKV-style observation-window scores (``Stat.WINDOW_SCORES``: the attention
        of the last ``window`` prompt queries, avg-pooled with ``window_kernel``), and from then on the
        accumulated score starts from them (window scores + every decode row), so the eviction keeps what
        the question attends to [OURS].
    window, window_kernel: the observation window (>= 1) and odd pooling kernel of scores="window".
    window_pool: "avg" (SnapKV's) or "max": how scores="window" pools; "max" with a kernel as wide as an
        answer keeps its every token beside the one the question attends to (a 7-digit number is 7
        tokens in SmolLM2; avg over 7 kept its first 3-4 digits, benchmarks/results/quality-suite-smollm2.md)
        [OURS].
    merge: False evicts without merging (the threshold still updates) [OURS, an ablation].
    merge_floor: a cosine floor in [-1, 1]: an evicted entry merges only if its best similarity is at least
        this as well as the EMA threshold (None: no floor, the paper) [OURS, the merge guard].
    merge_into_sinks: False: the sinks never absorb a token; an evicted entry is matched among the other
        kept entries (the merge guard: a sink holds much of every row's attention, so a token averaged into
        it moves the largest logits) [OURS]. Needs budgets above ``sinks``.
    merge_protect: a fraction in [0, 1): the floor(merge_protect * keep) kept entries with the highest
        eviction score (ties: the lower slot) never absorb an evicted token; it merges into its most similar
        unprotected kept entry, or is evicted without trace when none is left (and then does not enter the
        threshold). 0 (default): every kept entry may absorb, the paper [OURS, the merge guard: on the quality
        suite the evicted haystack merged into the needle's own entries, which the scores rank highest, and
        garbled 7-digit answers; docs/quality.md, "Merging against the eviction it builds on"]. Decode steps run the in-place step in
        plain torch (``evict_one_in_place``; the Triton op has no protection), batched rows of their own
        budgets in one call too (``compress_rows_into``), on CUDA inside the graphed step.
    merge_weighting: "similarity" (default: the variant's weights, exp(u) against e for "paper", u against 1
        for "code") or "score": a kept entry j and the evicted entries E_j merged into it are averaged with their
        eviction scores as weights, x_j <- (s_j x_j + sum_e s_e x_e) / (s_j + sum_e s_e) (each s + 1e-6), for
        keys and values; which entries merge is decided as before. An evicted token, ranked low, then moves
        a high-ranked entry little [OURS: the attention-mass-weighted mean; docs/quality.md,
        "Merging against the eviction it builds on"]. Decode steps take the plain-torch in-place step, as with merge_protect.
    merge_bias: True adds log(n) to the attention logit of an entry standing for n tokens (n = 1 + the
        tokens merged into it, recursively; ``LayerCache.log_weight``, as Chelsea's), so merged mass is
        attended in proportion to the tokens it replaced [OURS; the paper attends plainly].
    merge_chains: with ``interval`` m > 1, an evicted entry may merge into a later evicted one (ascending position),
        which then merges on, as the paper's one-in-one-out step lets it merge into a neighbour that a later step
        evicts (``kvpass.kernels.d2o_merge_chains``): among all of a decode compression's evicted entries (at most
        m), and among the last m of the prompt's (``chain_window``: one static shape, so the exported compress graph
        chains as the runtime does).
        False: only kept entries are targets, which lost more essay-cloze answers (docs/quality.md, "D2O with `interval` > 1")
        [OURS: interval > 1 is ours].
    first_compression: "prefill" (kvpass's contract: the budget holds from the first step) or "decode": the
        released code's timing, the prompt compressed after the first decode step with that step's
        attention row in its scores, the layer holding prompt + 1 entries until then.
    skip_memory: "shared" (skip_layers paid for by the other layers) or "extra": the released code's, the
        skip_layers keep every token at extra memory, never compressed (``skip_layers=(0, 1, -1)``).
    """

    name: ClassVar[str] = "d2o"
    section: ClassVar[str] = "§5"
    summary: ClassVar[str] = "variance layer budgets + H2O eviction + EMA-threshold merging"
    # interval > 1: decode compressions in place (``evict_many_in_place``); False: the general path and a copy
    # back (the before/after of tests and benchmarks)
    in_place_many: ClassVar[bool] = True
    sinks: int = 4
    n_m_ratio: tuple[int, int] = (3, 1)
    beta: float = 0.7
    d2o_variant: str = "paper"
    allocation: str = "code"
    skip_layers: tuple[int, ...] = ()
    interval: int = 1
    defer_scores: bool = True
    fuse_nearest: bool = True
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
        require(self.d2o_variant in ("paper", "code"), f"d2o: d2o_variant must be 'paper' or 'code', got {self.d2o_variant!r}")
        require(self.allocation in ("code", "paper", "uniform"),
                f"d2o: allocation must be 'code', 'paper' or 'uniform', got {self.allocation!r}")
        require(all(isinstance(i, int) for i in self.skip_layers), f"d2o: skip_layers must be ints, got {self.skip_layers!r}")
        require(self.scores in ("accumulated", "window"),
                f"d2o: scores must be 'accumulated' or 'window', got {self.scores!r}")
        require(isinstance(self.window, int) and self.window >= 1, f"d2o: window must be an int >= 1, got {self.window!r}")
        require(isinstance(self.window_kernel, int) and self.window_kernel >= 1 and self.window_kernel % 2 == 1,
                f"d2o: window_kernel must be an odd int >= 1, got {self.window_kernel!r}")
        require(self.window_pool in ("avg", "max"), f"d2o: window_pool must be 'avg' or 'max', got {self.window_pool!r}")
        for name in ("merge", "merge_into_sinks", "merge_bias", "merge_chains", "defer_scores", "fuse_nearest"):
            require(isinstance(getattr(self, name), bool), f"d2o: {name} must be True or False, got {getattr(self, name)!r}")
        protect = self.merge_protect
        require(isinstance(protect, (int, float)) and not isinstance(protect, bool) and 0.0 <= protect < 1.0,
                f"d2o: merge_protect must be a number in [0, 1), got {protect!r}")
        require(self.merge_weighting in ("similarity", "score"),
                f"d2o: merge_weighting must be 'similarity' or 'score', got {self.merge_weighting!r}")
        floor = self.merge_floor
        require(floor is None or (isinstance(floor, (int, float)) and not isinstance(floor, bool) and -1.0 <= floor <= 1.0),
                f"d2o: merge_floor must be None or a number in [-1, 1], got {floor!r}")
        require(self.first_compression in ("prefill", "decode"),
                f"d2o: first_compression must be 'prefill' or 'decode', got {self.first_compression!r}")
        require(self.skip_memory in ("shared", "extra"),
                f"d2o: skip_memory must be 'shared' or 'extra', got {self.skip_memory!r}")

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

    def deferred_scores(self) -> int:
        """``interval`` m > 1 with ``defer_scores``: the accumulated scores are read only when a layer compresses
        (every m steps), so the steps' rows are computed then, from the last m queries (``Policy.deferred_scores``);
        the steps in between attend without scores. ``defer_scores=False``: every step returns its row."""
        return self.interval if self.defer_scores and self.interval > 1 else 0

    def nearest_candidates(self) -> int:
        """``fuse_nearest`` with the one-in-one-out step of the Triton op (``interval`` 1, no merge_protect or score
        weights): the step names the M = 4 entries of lowest score the next step may evict, and the decode
        attention finds their nearest keys from its own read of K, so the next step reads the keys again only
        where its entry was not among them (kvpass/kernels/decode_attention_nearest.py): rows of one budget
        (``d2o_evict_one``) and of their own (``d2o_evict_one_ragged``). Same slots and values up to fp32 rounding.
        The eviction keeps each key's inverse norm for the attention ([B, Hkv, C] fp32 a layer, +0.8% of the
        cache at head size 128), computed where it scans a row and updated where it merges or moves."""
        return CANDIDATES if self.fuse_nearest and self.interval == 1 and self._in_place_op_applies() else 0

    def uncompressed_layers(self, n_layers: int) -> frozenset[int]:
        if self.skip_memory != "extra":
            return frozenset()
        return frozenset(i % n_layers for i in self.skip_layers if -n_layers <= i < n_layers)

    def prepare(self, cache: LayerCache, layer: int, budget: int) -> LayerCache:
        """scores="window": from here on the accumulated score starts from the window scores (which leave
        the slot metadata: decode accumulates into ``col_sum``)."""
        if self.scores == "window" and Stat.WINDOW_SCORES.value in cache.slot_meta:
            cache.slot_meta[Stat.COLUMN_SUM.value] = cache.slot_meta.pop(Stat.WINDOW_SCORES.value).float()
        return cache

    def _score_name(self, cache: LayerCache) -> str:
        """The slot metadata the eviction ranks: the window scores before ``prepare`` (scores="window"),
        else the accumulated ``col_sum``."""
        if self.scores == "window" and Stat.WINDOW_SCORES.value in cache.slot_meta:
            return Stat.WINDOW_SCORES.value
        return Stat.COLUMN_SUM.value

    def _score(self, cache: LayerCache) -> Tensor:
        return cache.slot_meta[self._score_name(cache)]

    def _min_cos(self) -> float:
        if not self.merge:
            return NO_MERGE
        return NO_FLOOR if self.merge_floor is None else float(self.merge_floor)

    def _target_from(self, keep: int) -> int:
        return 0 if self.merge_into_sinks else self.split(keep)[0]

    def _protecting(self) -> bool:
        return self.merge and self.merge_protect > 0

    def _protect(self) -> float:
        """The fraction of a row's budget that never absorbs a token (0 when nothing merges)."""
        return float(self.merge_protect) if self._protecting() else 0.0

    def _in_place_op_applies(self) -> bool:
        """The Triton decode ops ``kvpass::d2o_evict_one(_ragged)`` have neither protected targets nor score
        weights (their plain-torch step ``evict_one_in_place`` has both)."""
        return not self._protecting() and self.merge_weighting == "similarity"

    def _triton_step(self, cache: LayerCache) -> bool:
        """Whether the in-place decode step runs as the Triton op: on CUDA, not under export, and only for the
        options it has; else ``evict_one_in_place`` (plain torch, batched, no host sync)."""
        return cache.k.is_cuda and not torch.compiler.is_exporting() and self._in_place_op_applies()

    def _evict_many(self, cache: LayerCache, layer: tuple, keep: int | Tensor, due: int | Tensor, m: int,
                    sinks: int | Tensor, recent: int | Tensor, target_from: int | Tensor) -> None:
        """``interval`` > 1: the due rows evict down to ``keep`` in place (``layer``: ``_in_place_layer(cache)``). On
        CUDA in one process, for 16/32-bit caches and the options the kernels have, the Triton op
        ``torch.ops.kvpass.d2o_evict_many`` (three kernels a layer instead of some 150); else the plain-torch step
        ``evict_many_in_place`` that defines it."""
        if self._triton_step(cache) and self.heads.world == 1 and cache.k.dtype != torch.float64:
            split = split_tensor(cache.k.shape[0], cache.k.device, keep, due, sinks, recent, target_from)
            torch.ops.kvpass.d2o_evict_many(*layer, split, m, self.beta, self.d2o_variant, self._min_cos(),
                                            self.merge_bias, self._chaining())
        else:
            evict_many_in_place(*layer, keep, due, m, sinks, recent, target_from, *self._step_options(),
                                heads=self.heads, chains=self._chaining())

    def _unprotected(self, score: Tensor, live: Tensor, keep: int | Tensor) -> Tensor:
        """[B, Hkv, C] bool: the live slots outside the floor(merge_protect * keep) highest ``score`` [B, Hkv, C]
        of their row (ties: the lower slot first; a stable sort, the same on every device); ``keep``: an int
        or [B] int64 (per batch row, on the device)."""
        return unprotected(score, live, protected_count(self.merge_protect, keep))

    # ------------------------------------------------------------------ layer level (§5.4)
    def layer_density(self, caches: list[LayerCache]) -> list[float]:
        """sig_l per compressed layer from state['attn_var'] [B, Hq] (the runtime passes one row at a time
        when a batch has several, ``kvpass.runtime.layers.row_layer_budgets``; rows given together are averaged)."""
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
            sig = self.layer_density(caches)
            rho = torch.softmax(-torch.tensor(sig, dtype=torch.float64), dim=0)    # all layers take part
            shares = [float(rho[i]) for i in rest]
        split = apportion(shares, left, low=1, high=max(prompt, budget))
        got = dict(fixed)
        got.update(zip(rest, split, strict=True))
        return [got[i] for i in range(n_layers)]

    # ------------------------------------------------------------------ token level (§5.5, §5.6)
    def split(self, keep: int) -> tuple[int, int, int]:
        """(sinks, important N incl. sinks, recent M) for a budget of ``keep`` entries."""
        n, m = self.n_m_ratio
        recent = keep * m // (n + m)
        important = keep - recent
        return min(self.sinks, important), important, recent

    def compress(self, cache: LayerCache, keep: int) -> LayerCache:
        """cache: k, v [B, Hkv, C, D], slot_meta['col_sum'] [B, Hkv, C] fp32. Returns capacity
        min(keep, C) with merged K, V and the updated EMA threshold in state.

        C = keep + 1 (the one-in-one-out decode step: every row evicts at most one entry, a static
        fact) takes ``_compress_one``, O(C) work; anything else the general path. Both give the same
        entries (tested equal); neither synchronises with the device.

        The eviction's forms, and why more than one: ``_compress_general`` is the reference (any capacity,
        sequence order kept); the decode step's in-place op ``kvpass::d2o_evict_one`` (``compress_into``) is
        its fast form, with the plain-torch definition every op has and a Triton kernel; ``_compress_one`` is
        the op's step as a pure function (shift instead of move), kept for the callers of ``compress`` at
        capacity keep + 1 (tensor parallel decode, stacked or per-row copies), where the general path would
        sort every step. All share ``pick_one`` / ``threshold_and_merge`` / ``merged_rows``."""
        sinks, _, recent = self.split(keep)
        if cache.capacity == keep + 1:
            return self._compress_one(cache, keep)
        return self._compress_general(cache, keep, sinks, recent)

    def _compress_general(self, cache: LayerCache, keep: int, sinks: int, recent: int) -> LayerCache:
        kept = select_kept(self._score(cache), cache.length, keep, sinks, recent)
        out = keep_slots(cache, kept_slots(kept, keep))
        n_evicted = cache.capacity - out.capacity      # static upper bound: no device sync
        if n_evicted <= 0:
            return out
        evicted = cache.live & ~kept
        e_idx = ordered_slots(evicted, n_evicted)                              # [B, Hkv, E]
        valid = torch.gather(evicted, 2, e_idx)                                # [B, Hkv, E]
        k_e, v_e = gather_slots(cache.k, e_idx), gather_slots(cache.v, e_idx)
        # nearest live kept key per evicted entry, never the [E, K] similarity matrix on CUDA
        match = torch.ops.kvpass.cosine_match if k_e.is_cuda else cosine_match_reference   # CPU/export: plain torch
        targets = out.live & (torch.arange(out.capacity, device=out.k.device) >= self._target_from(keep))
        if self._protecting():
            targets = targets & self._unprotected(self._score(out), out.live, keep)
        nearest, u_star = match(k_e, out.k, targets)                           # [B, Hkv, E]
        matched = valid & (nearest >= 0) if self._protecting() else valid   # no target left: evicted without trace
        nearest = nearest.clamp(min=0)
        chains = self._chaining()
        if chains:                              # a later evicted entry may be the better target (merge_chains)
            index, ok = chain_window(valid, self.interval)
            k_w, v_w = gather_slots(k_e, index), gather_slots(v_e, index)
            u_m = torch.where(matched, u_star, float("-inf"))
            u_w, chained_w, parent = chain_similarities(k_w, ok & gather_slots(valid, index),
                                                        gather_slots(u_m, index))
            u_star, chained = put(u_m, index, ok, u_w), put(torch.zeros_like(valid), index, ok, chained_w)
            matched = matched | chained
        u_star = torch.where(matched, u_star, 0.0)
        merged, w_e, w_self = self._threshold_and_merge(out.state, u_star, matched)
        score_e = None
        if self.merge_weighting == "score":     # [OURS] w_self per kept entry [B, Hkv, K, 1]
            score_e = torch.gather(self._score(cache).float(), 2, e_idx) + SCORE_EPS
            w_e = torch.where(merged, score_e, 0.0)
        sizes = torch.gather(cache.log_weight, 2, e_idx).exp() if self.merge_bias else None
        if chains:                              # the linked entries fold into their evicted parents, children first
            own = gather_slots(score_e, index) if self.merge_weighting == "score" else w_self
            link = ok & gather_slots(chained & merged, index)
            k_w, v_w, s_w = fold_chains(k_w, v_w, parent, link, gather_slots(w_e, index), own,
                                        self.d2o_variant == "code" and self.merge_weighting != "score",
                                        None if sizes is None else gather_slots(sizes, index))
            k_e, v_e = put(k_e, index, ok, k_w), put(v_e, index, ok, v_w)
            sizes = None if sizes is None else put(sizes, index, ok, s_w)
            merged, w_e = merged & ~chained, torch.where(chained, 0.0, w_e)
        if self.merge_weighting == "score":
            w_self = self._score(out).float()[..., None] + SCORE_EPS
        if self.merge_bias:                     # sizes add: log_weight = log(sum of the members' sizes)
            size_e = torch.where(merged, sizes, 0.0)
            size = out.log_weight.exp().scatter_add(2, nearest, size_e)
            out.log_weight = torch.where(out.live, size.log(), out.log_weight)
        count, w_sum, (k_acc, v_acc) = _sums_into(nearest, merged.float(), w_e, (k_e, v_e),
                                                  (w_self * out.k.float(), w_self * out.v.float()))
        if self.merge_weighting == "score":
            norm = w_self[..., 0] + w_sum
        else:
            norm = w_self + (w_sum if self.d2o_variant == "paper" else count)  # [B, Hkv, K]
        target = (count > 0)[..., None]                                        # entries something merged into
        for name, acc in (("k", k_acc), ("v", v_acc)):
            base = getattr(out, name)
            setattr(out, name, torch.where(target, (acc / norm[..., None]).to(base.dtype), base))
        return out

    def _chaining(self) -> bool:
        """Whether compressions chain their merges (``merge_chains`` under ``interval`` > 1): the in-place steps
        all of their evicted entries (at most ``interval``), the general path the last ``interval`` of each row's
        (``chain_window``: the same entries at decode, those nearest the recent window of a prompt's)."""
        return self.merge_chains and self.merge and self.interval > 1

    def compress_into(self, cache: LayerCache, keep: int) -> None:
        """The runtime's call. One-in-one-out (capacity keep + 1, the decode step) runs in place: the
        evicted entry's slot takes the newest entry (slot keep), so nothing is shifted or copied back:
        O(C) reads of one layer's scores and keys, writes of two slots per row. The live slots stay
        [0, length) but no longer in sequence order, which is why the recent window is found by
        position (``pick_one``). Same entries and values as ``compress`` (tested as sets). On CUDA one
        op of three Triton kernels (``torch.ops.kvpass.d2o_evict_one``), elsewhere, under export and for
        merge_protect or merge_weighting="score" (which the kernels lack) its plain-torch step
        ``evict_one_in_place``. Under tensor parallelism the same step with ``heads=self.heads`` (the kernels on
        CUDA, else plain torch): the threshold's per-head statistics are gathered from every rank (one
        all-gather a layer), so each rank decides as one process does.

        ``interval`` m > 1, capacity C in (keep + 1, keep + m] (the runtime's layer of capacity keep + m, or a
        row's copy of capacity min(keep + m, its tokens)): every row over keep evicts down to keep in place
        (``_evict_many``: O(C) metadata, the evicted entries, their targets and the moved entries; no whole-cache
        copy, no host sync): the same entries and values as ``compress``
        (tests/kernels/test_d2o_evict_many.py). The runtime's one call for a layer whose rows may be due at steps
        of their own is ``compress_rows_into``, which leaves the rows that are not due. Every option; under tensor
        parallelism with the threshold's statistics gathered from every rank (``heads``). Any other capacity:
        ``compress`` and a copy back."""
        many = self._many_applies() and keep + 1 < cache.capacity <= keep + self.interval
        if not many and cache.capacity != keep + 1:
            forget_candidates(cache)
            super().compress_into(cache, keep)
            return
        sinks, _, recent = self.split(keep)
        layer = self._in_place_layer(cache)
        if many:
            self._evict_many(cache, layer, keep, keep + 1, cache.capacity - keep, sinks, recent,
                             self._target_from(keep))
        elif self.heads.world > 1 and self._triton_step(cache):     # the threshold over every rank's heads
            self.compress_layers_into([(cache, keep)])
        elif self._triton_step(cache) and self.heads.world == 1:
            torch.ops.kvpass.d2o_evict_one(*layer, self._nearest(cache), keep, sinks, recent, self.beta,
                                           self.d2o_variant, self._min_cos(),
                                           self._target_from(keep), self.merge_bias)
        else:
            forget_candidates(cache)
            evict_one_in_place(*layer, keep, sinks, recent, self._target_from(keep), *self._step_options(),
                               heads=self.heads)

    def _in_place_layer(self, cache: LayerCache) -> tuple:
        """The layer's tensors the in-place steps mutate, in their argument order: (k, v, the ranked slot metadata,
        position, log_weight, length, TAU, TAU_SET, every other slot metadata tensor, which follows the entries'
        moves). The EMA threshold state (TAU, TAU_SET [B]) is created here where missing: the ops mutate existing
        tensors."""
        b, device = cache.k.shape[0], cache.k.device
        for name, dtype in ((TAU, torch.float32), (TAU_SET, torch.bool)):
            if name not in cache.state:
                cache.state[name] = torch.zeros(b, dtype=dtype, device=device)
        score = self._score_name(cache)
        others = [t for n, t in cache.slot_meta.items() if n != score]
        return (cache.k, cache.v, cache.slot_meta[score], cache.position, cache.log_weight, cache.length,
                cache.state[TAU], cache.state[TAU_SET], others)

    @staticmethod
    def _nearest(cache: LayerCache) -> list[Tensor]:
        """The layer's state of the fused nearest-key search (``nearest_candidates``), or [] where it has none."""
        return [cache.state[n] for n in NEAREST_INPUTS] if has_nearest_state(cache) else []

    def _step_options(self) -> tuple[float, str, float, bool, float, bool]:
        """The plain-torch in-place steps' trailing arguments (``evict_one_in_place``, ``evict_many_in_place``):
        (beta, variant, min_cos, bias, protect, score_weights)."""
        return (self.beta, self.d2o_variant, self._min_cos(), self.merge_bias, self._protect(),
                self.merge_weighting == "score")

    def gathers_across_heads(self) -> bool:
        return True                                 # the EMA threshold's statistics over every KV head

    def compress_layers_into(self, jobs: Sequence[tuple[LayerCache, int | Tensor]]) -> None:
        """The runtime's call for the layers due at one decode step under tensor parallelism. Where the Triton step
        applies (``_sharded_step``), every such layer's kernels A and B run, then one all-gather of every layer's
        per-head statistics, then each layer's kernel C (``run_layers``): one collective a step, not one a layer,
        and each layer ends as it does alone (tests/kernels/test_d2o_evict_one_sharded.py). Any other job, before
        them, as ``compress_into`` / ``compress_rows_into`` (its own gathers; every rank takes the same paths, so
        the collectives keep one order)."""
        steps = []
        for cache, keep in jobs:
            step = self._sharded_step(cache, keep)
            if step is None:                    # compress_into / compress_rows_into forget the candidates where
                super().compress_layers_into([(cache, keep)])     # they take a path that keeps no norms
            else:
                steps.append(step)
        run_layers(steps, self.heads)

    def _sharded_step(self, cache: LayerCache, keep: int | Tensor) -> Generator[Gathered, Gathered, None] | None:
        """Under tensor parallelism on CUDA, the layer's one-in-one-out step as one layer of ``run_layers``
        (``d2o_evict_one_steps``, or ``d2o_evict_one_ragged_steps`` for a [B] ``keep`` of per-row budgets, as
        ``compress_into`` / ``compress_rows_into`` would call them); None where those take another path."""
        if self.heads.world == 1 or not self._triton_step(cache):
            return None
        layer = self._in_place_layer(cache)
        if isinstance(keep, Tensor):
            if self.interval > 1:
                return None
            keep = keep.to(device=cache.k.device, dtype=torch.long).contiguous()
            sinks, _, recent = self.split_rows(keep)
            target_from = torch.zeros_like(keep) if self.merge_into_sinks else sinks
            return d2o_evict_one_ragged_steps(*layer, keep, sinks, recent, target_from, self.beta, self.d2o_variant,
                                              self._min_cos(), self.merge_bias, self._nearest(cache), heads=self.heads)
        if cache.capacity != keep + 1:
            return None
        sinks, _, recent = self.split(keep)
        return d2o_evict_one_steps(*layer, self._nearest(cache), keep, sinks, recent, self.beta, self.d2o_variant,
                                   self._min_cos(),
                                   self._target_from(keep), self.merge_bias, heads=self.heads)

    def rows_in_one_call(self, budgets: Sequence[int], capacities: Sequence[int]) -> bool:
        """Rows of their own budgets in one call (``compress_rows_into``) where no row's capacity exceeds its
        budget + 1 (the one-in-one-out step, ``interval`` 1): a row is due exactly when it holds budget + 1
        entries, so compressing every row of the layer at its own budget evicts one entry from each due row
        and nothing from the others; under tensor parallelism too, the threshold gathered from every rank's
        heads (for ``interval`` > 1 as well).
        Every option: merge_protect and merge_weighting="score" take the plain-torch step (``compress_rows_into``).
        ``interval`` m > 1 (``_many_applies``): where every row's capacity is its budget + m (or at most its budget:
        it never compresses), ``compress_rows_into`` evicts in place from the rows holding budget + m entries, the
        due rows, and leaves the others as they are (rows of one budget too: the runtime then calls
        ``compress_rows_into``, not ``compress_into``, which compresses every row over the budget)."""
        if self.interval == 1:
            return all(1 <= cap <= keep + 1 for keep, cap in zip(budgets, capacities, strict=True))
        return self._many_applies() and all(1 <= cap <= keep or cap == keep + self.interval
                                            for keep, cap in zip(budgets, capacities, strict=True))

    def _many_applies(self) -> bool:
        """Whether ``interval`` > 1 compresses in place (``evict_many_in_place``; under tensor parallelism with
        ``heads``)."""
        return self.in_place_many and self.interval > 1

    def split_rows(self, keep: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``split`` per batch row: keep [B] int64 -> (sinks, important N incl. sinks, recent M), each [B]."""
        n, m = self.n_m_ratio
        recent = keep * m // (n + m)
        important = keep - recent
        return important.clamp(max=self.sinks), important, recent

    def compress_rows_into(self, cache: LayerCache, keep: Tensor) -> None:
        """``compress_into``'s one-in-one-out step with a budget per batch row, keep [B] int64 (the runtime's
        layers whose rows have budgets of their own, ``rows_in_one_call``), in the layer's own buffers of any
        capacity C >= every keep + 1: row b evicts one entry where it holds keep[b] + 1 entries (its newest in
        slot keep[b]) and is unchanged otherwise, so it gets exactly what it gets alone in a layer of capacity
        keep[b] + 1 (tests/kernels/test_d2o_evict_ragged.py). Each row's sinks and recent window come from
        its own budget (``split_rows``, device tensors: nothing synchronises, the CUDA-graphed step captures
        it). On CUDA the Triton op ``torch.ops.kvpass.d2o_evict_one_ragged`` (the same three kernels, which
        read the per-row values from the tensors: no compilation per budget); elsewhere, under export and for
        merge_protect (floor(merge_protect * keep[b]) protected per row, on the device) or
        merge_weighting="score", which the kernels lack, the plain-torch step ``evict_one_in_place``, batched
        and capturable all the same (tests/kernels/test_d2o_evict_ragged.py: each row as ``_compress_one`` alone)."""
        keep = keep.to(device=cache.k.device, dtype=torch.long).contiguous()
        sinks, _, recent = self.split_rows(keep)
        target_from = torch.zeros_like(keep) if self.merge_into_sinks else sinks
        layer = self._in_place_layer(cache)
        if self.heads.world > 1 and self.interval == 1 and self._triton_step(cache):   # the threshold spans ranks
            self.compress_layers_into([(cache, keep)])
        elif self.interval > 1:                   # the due rows (budget + interval entries) evict interval entries
            self._evict_many(cache, layer, keep, keep + self.interval, self.interval, sinks, recent, target_from)
        elif self._triton_step(cache) and self.heads.world == 1:
            torch.ops.kvpass.d2o_evict_one_ragged(*layer, self._nearest(cache), keep, sinks, recent, target_from,
                                                  self.beta, self.d2o_variant, self._min_cos(), self.merge_bias)
        else:
            forget_candidates(cache)              # the plain-torch step keeps no norms
            evict_one_in_place(*layer, keep, sinks, recent, target_from, *self._step_options(), heads=self.heads)

    def _pick_one(self, cache: LayerCache, keep: int) -> OneEviction:
        """``pick_one`` (§5.5-5.6 for rows of at most keep + 1 entries) on this layer's cache; merge_protect:
        the nearest unprotected kept entry (the protected ones ranked without the evicted slot)."""
        sinks, _, recent = self.split(keep)
        return pick_one(cache.k, cache.v, self._score(cache), cache.position, cache.length, keep, sinks, recent,
                        self._target_from(keep), self._protect())

    def _compress_one(self, cache: LayerCache, keep: int) -> LayerCache:
        """One-in-one-out (capacity keep + 1) as a pure function: the entry ``_pick_one`` chooses is
        evicted, merged into its nearest kept key, and the later slots shift down by one; a shorter
        row is unchanged (its slot keep is empty). O(C D) per row, no sort; returns capacity keep."""
        c = cache.capacity
        j = torch.arange(c, device=cache.k.device)
        pick = self._pick_one(cache, keep)
        e = pick.e
        # slot i of the output is slot i (before e) or i + 1 (from e on) of the input; a row that evicts
        # nothing has e = C - 1, so it keeps slots [0, keep)
        out = keep_slots(cache, j[:keep] + (j[:keep] >= e))
        merged, w_e, w_self = self._threshold_and_merge(out.state, pick.u_star, pick.valid)
        target = pick.nearest - (pick.nearest > e).long()                      # [B, Hkv, 1] in the output's slots
        if self.merge_weighting == "score":     # [OURS] the weights are the two entries' scores
            score = self._score(cache).float()
            w_e = torch.where(merged, torch.gather(score, 2, e) + SCORE_EPS, 0.0)
            w_into = torch.gather(score, 2, pick.nearest) + SCORE_EPS

            def rows(into: Tensor, src: Tensor) -> Tensor:
                return score_merged_rows(into, src, merged, w_into, w_e)
        else:
            def rows(into: Tensor, src: Tensor) -> Tensor:
                return _merged_rows(into, src, merged, w_e, w_self, self.d2o_variant)
        for name, s_e in (("k", pick.k_e), ("v", pick.v_e)):
            base = getattr(out, name)
            put_slots(base, target, rows(gather_slots(base, target), s_e))
        if self.merge_bias:
            into, src = torch.gather(out.log_weight, 2, target), torch.gather(cache.log_weight, 2, e)
            out.log_weight = out.log_weight.scatter(2, target, torch.where(merged, merged_log_weight(into, src), into))
        return out

    def _threshold_and_merge(self, state: dict[str, Tensor], u_star: Tensor, valid: Tensor
                             ) -> tuple[Tensor, Tensor, float]:
        """§5.6 steps 2-4 from this layer's u_star, valid [B, Hkv, E]: the EMA threshold (written to
        ``state``) and (merged, w_e [B, Hkv, E], w_self): ``threshold_and_merge``, the decode ops' own, whose
        threshold and "code" merge decision are statistics over every KV head of the layer (every rank's heads
        under tensor parallelism, in one all-gather), the rank keeping its own heads' part."""
        b = u_star.shape[0]
        prev = state.get(TAU, torch.zeros(b, device=u_star.device))
        was_set = state.get(TAU_SET, torch.zeros(b, dtype=torch.bool, device=u_star.device))
        state[TAU], state[TAU_SET], merged, w_e, w_self = threshold_and_merge(
            self.heads, u_star, valid, prev, was_set, self.beta, self.d2o_variant, self._min_cos())
        return merged, w_e, w_self


def _sums_into(nearest: Tensor, merged: Tensor, w_e: Tensor, srcs: tuple[Tensor, ...], accs: tuple[Tensor, ...]
               ) -> tuple[Tensor, Tensor, list[Tensor]]:
    """Per kept entry t: count = sum of ``merged`` over the evicted e with nearest[e] = t, the same sum of
    ``w_e``, and each acc plus the sum of w_e * src[e]. nearest, merged, w_e: [B, Hkv, E]; srcs:
    [B, Hkv, E, D]; accs: [B, Hkv, K, D] fp32 -> [B, Hkv, K], [B, Hkv, K], [[B, Hkv, K, D] fp32 ...].

    At run time scatter-adds (onto the accs, no extra buffer). Under ``torch.export`` (the ONNX export)
    the same sums as dense assignment matmuls, A[e, t] = (nearest[e] == t): TensorRT's core layers have
    no scatter-add (docs/deploy.md); the [E, K] matrix is the price, fine at the exported buffer sizes
    [OURS]."""
    capacity = accs[0].shape[2]
    if torch.compiler.is_exporting():
        assign = (nearest[..., None] == torch.arange(capacity, device=nearest.device)).float()   # [B, Hkv, E, K]
        weighted = assign * w_e[..., None]
        return ((assign * merged[..., None]).sum(2), weighted.sum(2),
                [acc + weighted.transpose(-1, -2) @ src.float() for src, acc in zip(srcs, accs, strict=True)])
    zeros = torch.zeros(*nearest.shape[:2], capacity, dtype=torch.float32, device=nearest.device)
    idx = nearest[..., None].expand(*nearest.shape, accs[0].shape[-1])
    return (zeros.scatter_add(2, nearest, merged), zeros.scatter_add(2, nearest, w_e),
            [acc.scatter_add(2, idx, w_e[..., None] * src.float()) for src, acc in zip(srcs, accs, strict=True)])
