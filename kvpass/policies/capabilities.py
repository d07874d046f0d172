"""Optional capabilities of a policy: faster or larger-scale forms of what ``Policy.compress`` defines.

A policy declares a capability by deriving from its class here; the runtime detects it with the functions below
(never by the policy's name) and otherwise takes the slow path, which ``compress`` alone makes correct:

* ``InPlace`` (``compress_into``): a layer compressed in its own buffers (same addresses, so a CUDA-graphed decode
  step replays it). Slow path: ``compress`` and a copy back (``load_into``). The same entries as ``compress``, in
  any slots (tests compare them as sets).
* ``RaggedRows`` (``rows_in_one_call``, ``compress_rows_into``): a layer whose batch rows have budgets of their own
  compressed by one call, each due row as alone and the others unchanged. Slow path: each due row compressed in a
  copy of its own capacity and written back (eager, a host sync a layer).
* ``GathersAcrossHeads`` (``gathers_across_heads``, ``compress_layers_into``): a compression that reads other KV
  heads' statistics through ``Policy.heads`` (collectives under tensor parallelism): the runtime then compresses
  the layers due at a step one after another in one call, every rank in one order. Without it the layers run side
  by side, and a collective asked for is refused (``kvpass.runtime.session``).
* ``FusedDecodeStatistics`` (``deferred_scores``, ``nearest_candidates``, ``decode_state``): statistics the decode
  graph computes in another form than one attention row a step: rows deferred to the next compression
  (``kvpass/runtime/recent_queries.py``), or the nearest keys of named candidates found by the decode attention.
  Without it every step returns its row and the compression scans.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from kvpass.cache import LayerCache, load_into


class InPlace:
    """A policy that compresses a layer in its own buffers."""

    def compress_into(self, cache: LayerCache, keep: int) -> None:
        """``compress(cache, keep)``'s entries in ``cache``'s own buffers (capacity and addresses kept). This
        default is the slow path itself, for an override's cases it does not cover (``super().compress_into``)."""
        load_into(cache, self.compress(cache, keep))


class RaggedRows(InPlace):
    """A policy that compresses a layer of rows of their own budgets in one call (in place)."""

    def rows_in_one_call(self, budgets: Sequence[int], capacities: Sequence[int]) -> bool:
        """Whether a layer whose row b has budget ``budgets[b]`` and is compressed when it holds ``capacities[b]``
        entries can be compressed by ``compress_rows_into`` whichever rows are due."""
        raise NotImplementedError

    def compress_rows_into(self, cache: LayerCache, keep: Tensor) -> None:
        """In place, keep [B] int64 on the cache's device: every due row (holding its capacity) as ``compress``
        gives it alone at keep[b] in a layer of its own capacity, every other row unchanged. No host sync."""
        raise NotImplementedError


class GathersAcrossHeads:
    """A policy whose compression reads other KV heads' statistics (``Policy.heads.gather``)."""

    def gathers_across_heads(self) -> bool:
        """Whether this configuration's compression gathers (default True)."""
        return True

    def compress_layers_into(self, jobs: Sequence[tuple[LayerCache, int | Tensor]]) -> None:
        """The layers due at one step, in order: ``compress_rows_into`` for a [B] ``keep``, else in place; a policy
        may gather once for all of them. Default: one after another."""
        for cache, keep in jobs:
            compress_job(self, cache, keep)


class FusedDecodeStatistics:
    """A policy whose decode statistics the decode graph computes in a fused form."""

    def deferred_scores(self) -> int:
        """m > 0: the accumulated ``col_sum`` is read only when a layer compresses, so the decode graph keeps each
        step's query in a ring of m per layer and the runtime adds their rows before every compression (the same
        ``col_sum`` up to rounding). 0: every step returns its row."""
        return 0

    def nearest_candidates(self) -> int:
        """M > 0: the compression seeks the nearest key of one of M candidate slots it names a step ahead, and the
        decode attention finds them from its own read of K (``kvpass::decode_attention_nearest``). 0: none."""
        return 0

    def decode_state(self, cache: LayerCache) -> dict[str, Tensor]:
        """The state tensors of a layer whose attention seeks the candidates' nearest keys, for its buffers (made
        after prefill and again whenever the buffers are made anew)."""
        return {}


def compress_in_place(policy, cache: LayerCache, keep: int) -> None:
    """``policy.compress_into`` where the policy has it, else ``compress`` and a copy back."""
    if isinstance(policy, InPlace):
        policy.compress_into(cache, keep)
    else:
        load_into(cache, policy.compress(cache, keep))


def compress_job(policy, cache: LayerCache, keep: int | Tensor) -> None:
    """One layer of ``compress_layers_into``: per-row budgets (a [B] ``keep``) or one budget."""
    if isinstance(keep, Tensor):
        policy.compress_rows_into(cache, keep)
    else:
        compress_in_place(policy, cache, keep)


def compress_layers_into(policy, jobs: Sequence[tuple[LayerCache, int | Tensor]]) -> None:
    """The layers due at one step: the policy's own call where it gathers across heads, else one by one."""
    if isinstance(policy, GathersAcrossHeads):
        policy.compress_layers_into(jobs)
    else:
        for cache, keep in jobs:
            compress_job(policy, cache, keep)


def rows_in_one_call(policy, budgets: Sequence[int], capacities: Sequence[int]) -> bool:
    """Whether the policy compresses a layer of these rows' budgets and capacities in one call."""
    return isinstance(policy, RaggedRows) and policy.rows_in_one_call(budgets, capacities)


def gathers_across_heads(policy) -> bool:
    return isinstance(policy, GathersAcrossHeads) and policy.gathers_across_heads()


def deferred_scores(policy) -> int:
    return policy.deferred_scores() if isinstance(policy, FusedDecodeStatistics) else 0


def nearest_candidates(policy) -> int:
    return policy.nearest_candidates() if isinstance(policy, FusedDecodeStatistics) else 0
