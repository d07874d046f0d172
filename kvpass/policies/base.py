"""What a policy is: data (the paper's hyperparameters) plus three things the runtime reads.

* ``stats``: the statistics the rewritten graphs must emit for it (prefill and decode; ``stat_options`` passes
  the policy's options to their ops);
* ``compress``: a pure function from a layer's cache to a cache of at most ``keep`` live entries per row: the
  policy's definition, which every faster form is tested against;
* ``attention``: which decode attention variant the rewrite inserts (``Attention.DENSE`` unless the policy
  recalls: then ``decode_inputs`` names the cache tensors its op takes and ``prepare`` builds them).

Implementing these three gives a correct slow path: the runtime compresses a layer with ``compress`` and copies
the result back, rows of budgets of their own each alone, layers one after another. Everything else here has a
default that is right for a policy that does not override it: budgets (``min_budget``, ``layer_budgets``,
``head_capacity``, ``full_kv_heads``, ``uncompressed_layers``, ``prompt_compression_deferred``), facts about the
cache (``compresses``, ``ragged_rows``, ``rows_independent``, ``prefill_chunks``, ``host_resident``), decode-time
upkeep (``maintenance_due``, ``maintain``, ``report``) and the model (``bind_model``, ``heads``). Faster or larger
forms are optional capabilities a policy declares by deriving from them (``kvpass.policies.capabilities``:
in place, ragged rows, gathers across heads under tensor parallelism, fused decode statistics); the runtime
detects them there and never asks which policy it holds. A new policy is a new file and a registry entry
(docs/adding-a-policy.md).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import TYPE_CHECKING, ClassVar

from kvpass.cache import LayerCache
from kvpass.head_group import SINGLE_PROCESS, HeadGroup

if TYPE_CHECKING:
    from kvpass.rewrites.attention_sites import AttentionSite


class Stat(Enum):
    """Statistics a policy asks the graphs for. Each lands in ``LayerCache.slot_meta[stat.value]``."""

    COLUMN_SUM = "col_sum"            # accumulated attention per entry: prefill column sums + every decode row
    WINDOW_SCORES = "window_scores"   # attention of the last prompt queries (observation window), prefill only
    HEAD_VARIANCE = "attn_var"        # per query head variance of the prefill column sums [B, Hq] (D2O §5.4)
    LAST_ATTENTION = "last_attn"      # attention of the newest query only: prompt last row, then each step (TOVA §6.10)
    # the most attention an entry receives while the model repeats the context (KVzip §6.13): computed after the
    # prefill by a pass of its own over the prompt's whole cache (kvpass/runtime/reconstruction.py), not by the
    # prefill graph; not updated by decode steps (their entries score 0)
    RECONSTRUCTION = "reconstruct"

    @property
    def per_slot(self) -> bool:
        """True: one value per cache slot [B, Hkv, T] (lands in ``slot_meta``); False: one value per
        head [B, H] (lands in ``LayerCache.state``, carried unchanged through compressions)."""
        return self not in _PER_HEAD_STATS

    @property
    def after_prefill(self) -> bool:
        """True: computed by a pass of its own after the prefill graph (``Stat.RECONSTRUCTION``), so the prefill
        graph leaves it out and ``KVPassModel.prefill`` adds it to the prefill's statistics."""
        return self is Stat.RECONSTRUCTION

    @property
    def accumulates(self) -> bool:
        """For statistics the decode step updates: True adds each step's attention row (``col_sum``),
        False replaces the value with it (``last_attn``)."""
        return self is not Stat.LAST_ATTENTION


_PER_HEAD_STATS = frozenset({Stat.HEAD_VARIANCE})


class Attention(Enum):
    """Decode attention variants. DENSE attends over every slot with the additive log-weight, which is
    plain attention while all weights are 0 and the log(degree) bias of merged entries otherwise."""

    DENSE = "dense"
    CLUSTER_RECALL = "cluster_recall"   # ClusterKV: score centroids, attend the selected clusters
    PAGE_RECALL = "page_recall"         # Quest: score pages by min/max keys, attend the selected pages
    EMS_EXPANSION = "ems_expansion"     # EMS: shared entries expanded through a slot table (per-slot key norms)


def require(condition: bool, message: str) -> None:
    """Raise ``InvalidValue(message)`` (a ValueError; rule ``policy.value`` of kvpass.validation) unless
    condition: for validating user-supplied hyperparameters."""
    if not condition:
        from kvpass.errors import InvalidValue

        raise InvalidValue(message, "policy_kwargs")


@dataclass(frozen=True)
class Policy:
    """Base of every policy. Subclasses are frozen dataclasses whose fields are the paper's
    hyperparameters with its defaults; an ``interval`` field, where a policy has one (the runtime reads 1
    otherwise), is how many decode steps a layer may grow past its budget before it is compressed again (so a
    layer holds between budget and budget + interval).

    ``expand_kv_heads`` (every policy, keyword-only; docs/policies.md §0.5 "paper-faithful expanded mode",
    §4.10, §5.3): False (default) keeps the cache per KV head, statistics averaged over the G = Hq/Hkv
    query heads of a group. True caches K, V repeated G times, as D2O's released code and EMS's
    Llama-3 runs do: the cache has Hq heads of group size 1, so every policy scores, evicts and merges
    per query head, at G times the memory. The rewrite does it for every policy alike
    (``kvpass.rewrites.expand_kv_heads``); no policy's code reads the flag."""

    name: ClassVar[str]
    section: ClassVar[str]                      # the section of docs/policies.md it implements
    summary: ClassVar[str]
    stats: ClassVar[frozenset[Stat]] = frozenset()
    attention: ClassVar[Attention] = Attention.DENSE
    compresses: ClassVar[bool] = True           # False: the cache keeps every token (budget ignored)
    # Names of LayerCache.slot_meta / state tensors the decode attention op takes after log_weight
    # (e.g. cluster centroids for CLUSTER_RECALL); the runtime passes them, the rewrite adds the inputs.
    decode_inputs: ClassVar[tuple[str, ...]] = ()
    # LayerCache fields ("k", "v") a recall policy keeps in host memory (pinned) when the model runs on
    # an accelerator; its decode op gathers the selected entries to the device. Reported as host_bytes.
    host_resident: ClassVar[tuple[str, ...]] = ()
    # True: ``compress`` treats every batch row on its own and its state is per batch row, so the runtime
    # may compress several layers of one budget as one cache of their stacked rows (one set of launches
    # for all of them: a prompt's compression is otherwise launch-bound on the GPU).
    rows_independent: ClassVar[bool] = False
    # True: the cache of one layer may hold batch rows of different budgets (each row compressed to its own,
    # as if alone: the runtime compresses a row in a copy of its own capacity and writes it back). False: every
    # row of a batch gets the budget of the batch's longest row (a row's tokens then depend on its batch-mates;
    # no policy needs it: EMS, whose slot table's width follows the budget, holds each row's table in one as
    # wide as the widest row's).
    ragged_rows: ClassVar[bool] = True
    # True: a chunked prefill (``prefill_chunk``, kvpass/runtime/chunked_prefill.py) may compress the cache between the
    # prompt's chunks, and later chunks attend over what ``compress`` left. False (EMS: its first compression
    # turns the cache into entries expanded through a slot table, which only its decode op reads): refused.
    prefill_chunks: ClassVar[bool] = True
    expand_kv_heads: bool = field(default=False, kw_only=True)

    def __post_init__(self) -> None:
        require(isinstance(self.expand_kv_heads, bool),
                f"{self.name}: expand_kv_heads must be True or False, got {self.expand_kv_heads!r}")
        interval = getattr(self, "interval", 1)
        require(isinstance(interval, int) and interval >= 1, f"{self.name}: interval must be an int >= 1, got {interval!r}")

    def stat_options(self, stat: Stat) -> dict[str, object]:
        """Extra keyword arguments of the prefill op computing ``stat`` (e.g. SnapKV's observation
        window and pooling kernel). The rewrite passes them through without interpreting them."""
        return {}

    @property
    def heads(self) -> HeadGroup:
        """The KV heads of a layer as this process holds them (``kvpass.head_group``): a statistic over all
        heads of a layer is taken over ``heads.gather(x)``, identity with one process."""
        return self.__dict__.get("_heads", SINGLE_PROCESS)

    def with_heads(self, heads: HeadGroup) -> Policy:
        """This policy on a rank holding ``heads`` (tensor parallel); itself when one process holds every head."""
        if heads.world == 1:
            return self
        out = copy.copy(self)
        object.__setattr__(out, "_heads", heads)
        return out

    def bind_model(self, model) -> Policy:
        """The policy to run on ``model`` (a transformers causal LM): facts a policy reads from the model
        itself (e.g. EMS's RoPE frequencies, to compare keys without their positions) are filled in
        here, once, before any cache exists. Default: unchanged."""
        return self

    def prompt_compression_deferred(self) -> bool:
        """True: the prompt is not compressed right after prefill but after the first decode step, whose
        attention row is then part of the scores (D2O's released code). Until then the layer holds the
        prompt and that step's entry, above its budget. Default: False."""
        return False

    def uncompressed_layers(self, n_layers: int) -> frozenset[int]:
        """Indices among the ``n_layers`` full-attention layers that keep every token at extra memory
        (never compressed, not counted in the others' budgets; D2O's released code skips layers 0, 1 and
        L - 1). Default: none."""
        return frozenset()

    def min_budget(self) -> int:
        """The fewest entries per layer the policy can work with (e.g. sinks + recent window)."""
        return 1

    def layer_budgets(self, budget: int, caches: list[LayerCache]) -> list[int]:
        """Per-layer entry budgets for the compressed layers (``caches`` after prefill, with their
        statistics). Default: the same budget everywhere."""
        return [budget] * len(caches)

    def full_kv_heads(self, sites: Sequence[AttentionSite]) -> dict[int, tuple[int, ...]]:
        """{layer: KV heads} that keep every token, for the model whose attention sites are ``sites``
        (Chelsea's outlier heads, §1.10). The rewrite gives them their own dense cache buffers beside
        the layer's compressed heads (split-group layout, §0.6 b) and the runtime lowers the other
        heads' budget so the total stays the nominal one (``budget.budget_with_full_heads``). Raises
        ValueError when the policy's data was made for another model. Default: none."""
        return {}

    def head_capacity(self, keep: int, heads: int) -> int:
        """The most live entries one KV head may hold after compressing a layer of ``heads`` KV heads to
        ``keep`` entries per head (on average): the runtime sizes each head's slots for it and checks it.
        Default ``keep`` (every head keeps the same number); head-adaptive budgets (``adakv``) more."""
        return keep

    def compress(self, cache: LayerCache, keep: int) -> LayerCache:
        """cache: one layer, capacity C, rows holding up to C entries. Returns a cache whose rows hold at most
        ``head_capacity(keep, Hkv)`` live entries (``keep`` unless the policy splits budgets unevenly; any capacity
        >= that), in sequence order. Pure: ``cache`` is left as it is."""
        raise NotImplementedError

    def prepare(self, cache: LayerCache, layer: int, budget: int) -> LayerCache:
        """Called once per full-attention layer after prefill (and after any compression): build the
        decode-time tensors ``decode_inputs`` names (page summaries, cluster centroids...). ``layer`` is
        the decoder layer index, ``budget`` the layer's token budget (for recall policies: the tokens
        attended per step; an int, or a [B] int64 tensor when the batch rows' budgets differ). Sliding-window layers are never prepared. Default: unchanged."""
        return cache

    def maintenance_due(self, new_tokens: int) -> bool:
        """Whether ``maintain`` runs after the decode step that brought the generated tokens written
        into the cache to ``new_tokens``. Default: never."""
        return False

    def maintain(self, cache: LayerCache, layer: int) -> LayerCache:
        """Periodic decode-time upkeep of a full-attention layer's cache (e.g. clustering the newly
        generated tokens); returns a cache of the same capacity. Default: unchanged."""
        return cache

    def report(self, caches: list[LayerCache]) -> dict[str, float]:
        """Policy-specific numbers for ``GenerationReport.policy_stats`` from the final full-attention
        layer caches (e.g. a recall hit rate). Default: none."""
        return {}

    @classmethod
    def defaults(cls) -> dict[str, object]:
        return {f.name: f.default for f in fields(cls)}
