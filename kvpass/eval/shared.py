"""One prefill shared by many policies and budgets.

Every (policy, budget) cell of an evaluation prefills the same tokens; only the statistics the
policy asks the prefill graph for (``Policy.stats`` with ``Policy.stat_options``) differ. A
``SharedPrefill`` graph emits the union of the statistics of a group of policies, so one prefill per
batch of prompts serves the whole group: each cell builds its compressed caches from it with
``KVPassModel.start_from`` (which ignores the statistics its policy did not ask for) and decodes.
The K, V, logits and each statistic are computed by the same ops with the same arguments as in the
policy's own prefill graph, so the caches (and answers) are those of ``KVPassModel.start``.

Policies that want the same statistic with different options (say two SnapKV windows) cannot
share one graph output; ``stat_groups`` puts them in different groups (one prefill each).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import Tensor, nn

from kvpass.api import apply
from kvpass.eval.common import uses_budget
from kvpass.policies import Policy, Stat, policy_from_spec
from kvpass.rewrites import RewrittenGraphs, capture_model, compile_model
from kvpass.runtime import KVPassModel, Prefill


def _options_key(options: dict[str, object]) -> tuple:
    return tuple(sorted((k, repr(v)) for k, v in options.items()))


@dataclass
class StatUnion:
    """The prefill-graph view of a group of policies: every statistic any of them asks for, with its
    options (one option set per statistic). Quacks like a Policy for ``compile_model(..., prefill_only=True)``."""

    options: dict[Stat, dict[str, object]] = field(default_factory=dict)
    compresses = True

    @property
    def stats(self) -> frozenset[Stat]:
        return frozenset(self.options)

    def stat_options(self, stat: Stat) -> dict[str, object]:
        return dict(self.options[stat])

    def accepts(self, policy: Policy) -> bool:
        """True if ``policy``'s statistics can come from this union (no option conflicts)."""
        if not policy.compresses:
            return True
        return all(s not in self.options or _options_key(self.options[s]) == _options_key(policy.stat_options(s))
                   for s in policy.stats)

    def add(self, policy: Policy) -> None:
        if policy.compresses:
            for s in policy.stats:
                self.options.setdefault(s, policy.stat_options(s))


def stat_groups(policies: Sequence[Policy]) -> list[tuple[StatUnion, list[Policy]]]:
    """Partition ``policies`` (in order) into groups whose statistics one prefill graph can emit."""
    groups: list[tuple[StatUnion, list[Policy]]] = []
    for policy in policies:
        for union, members in groups:
            if union.accepts(policy):
                union.add(policy)
                members.append(policy)
                break
        else:
            union = StatUnion()
            union.add(policy)
            groups.append((union, [policy]))
    return groups


class Models:
    """One capture of ``model`` for every policy: per (policy, budget) a ``kvpass.apply`` of it (``full``: one
    for every budget), and per group of policies a shared prefill graph (``prefill_graphs``)."""

    def __init__(self, model: nn.Module, tokenizer=None, kv_dtype: str | None = None) -> None:
        self.model, self.tokenizer = model, tokenizer      # the tokenizer: policies that reconstruct the context
        self.kv_dtype = kv_dtype                           # every model's cache entries (kvpass.apply's kv_dtype)
        self.captured = capture_model(model)
        self._built: dict[tuple[str, object], KVPassModel] = {}
        self._prefills: dict[tuple, RewrittenGraphs] = {}

    def get(self, policy: str, budget: float | int | None) -> KVPassModel:
        key = (policy, budget if uses_budget(policy) else None)
        if key not in self._built:
            chosen = policy_from_spec(policy)     # a name or a spec: name[key=value,...]
            # eager decode (compile=False): a grid builds a model per (policy, budget) and decodes few tokens
            # each, so a compilation each would cost more than it saves, and stored results stay comparable
            self._built[key] = apply(self.model, chosen, key[1] if key[1] is not None else 1.0,
                                     captured=self.captured, compile=False, tokenizer=self.tokenizer,
                                     kv_dtype=self.kv_dtype)
        return self._built[key]

    def prefill_graphs(self, union: StatUnion) -> RewrittenGraphs:
        """The prefill graph emitting ``union``'s statistics (its decode graph is not built: None)."""
        key = tuple(sorted((s.value, _options_key(o)) for s, o in union.options.items()))
        if key not in self._prefills:
            self._prefills[key] = compile_model(self.captured, union, prefill_only=True)
        return self._prefills[key]

    def shared_prefill(self, union: StatUnion, input_ids: Tensor, attention_mask: Tensor | None = None,
                       max_new_tokens: int = 0) -> Prefill:
        """input_ids [B, T] -> a Prefill whose statistics serve every policy ``union`` accepts."""
        any_model = self.get("full", None)
        device = any_model.device                   # kvpass refuses ids on another device than the model
        mask = None if attention_mask is None else attention_mask.to(device)
        return any_model.prefill(input_ids.to(device), mask, max_new_tokens, graphs=self.prefill_graphs(union),
                                 stats_for=union)
