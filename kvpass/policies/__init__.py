"""The policy registry: name -> class. ``get_policy`` builds one from user keyword arguments."""

from __future__ import annotations

from kvpass.policies.adakv import AdaKV
from kvpass.policies.base import Attention, Policy, Stat
from kvpass.policies.cam import CaM
from kvpass.policies.chelsea import Chelsea
from kvpass.policies.clusterkv import ClusterKV
from kvpass.policies.d2o import D2O
from kvpass.policies.ems import EMS
from kvpass.policies.full import Full
from kvpass.policies.h2o import H2O
from kvpass.policies.keydiff import KeyDiff
from kvpass.policies.knorm import Knorm
from kvpass.policies.kvmerger import KVMerger
from kvpass.policies.kvzip import KVzip
from kvpass.policies.pyramidkv import PyramidKV
from kvpass.policies.quest import Quest
from kvpass.policies.snapkv import SnapKV
from kvpass.policies.spec import parse_value, split_spec
from kvpass.policies.streamingllm import StreamingLLM
from kvpass.policies.tova import TOVA

POLICIES: dict[str, type[Policy]] = {p.name: p for p in (Full, StreamingLLM, D2O, H2O, SnapKV, PyramidKV, CaM,
                                                          Chelsea, KVMerger, EMS, ClusterKV, Quest, Knorm, TOVA,
                                                          AdaKV, KeyDiff, KVzip)}
# Chosen from the suite's leaderboard (benchmarks/results/quality-suite-smollm2.md, budget 0.2, query-aware,
# among policies that really save memory): SnapKV with a pooling kernel of 31 answers 97.0% [94.4, 98.4] of
# 300 cases against the full cache's 96.7%; with SnapKV's kernel of 7 it keeps only the first digits of a
# 7-digit answer (48.3%). The best merging configuration, d2o[scores=window,window_kernel=31], answers 64.5%
# (183 cases); paper D2O 3.4%. docs/quality.md.
DEFAULT_POLICY = "snapkv[kernel=31]"


def get_policy(name: str | Policy, **kwargs) -> Policy:
    """The policy called ``name`` with ``kwargs`` overriding its defaults. ``name`` may be a spec,
    ``name[key=value,...]`` (``split_spec``), whose values ``kwargs`` override in turn. A Policy
    instance passes through."""
    from kvpass.validation import refuse

    if isinstance(name, Policy):
        if kwargs:
            raise refuse("policy.kwargs_with_instance", names=", ".join(sorted(kwargs)))
        return name
    if not isinstance(name, str):
        raise refuse("policy.type", got=type(name).__name__, names=", ".join(sorted(POLICIES)))
    if "[" in name:
        name, spec_kwargs = split_spec(name)
        kwargs = {**spec_kwargs, **kwargs}
    if name not in POLICIES:
        raise refuse("policy.unknown", got=name, names=", ".join(sorted(POLICIES)))
    cls = POLICIES[name]
    unknown = set(kwargs) - set(cls.defaults())
    if unknown:
        owners = sorted(n for n, c in POLICIES.items() if unknown & set(c.defaults()))
        hint = f" ({', '.join(sorted(unknown))} belongs to: {', '.join(owners)})" if owners else ""
        raise refuse("policy.parameter", policy=name, got=", ".join(sorted(unknown)),
                     names=", ".join(cls.defaults()) or "none", hint=hint)
    from kvpass.errors import InvalidValue, KVPassError

    try:
        return cls(**kwargs)
    except KVPassError:                          # the policy's own refusal, naming its argument
        raise
    except TypeError as err:                     # a dataclass field given a value its code cannot take
        raise InvalidValue(f"{name}: {err}", "policy_kwargs") from err


def policy_from_spec(spec: str) -> Policy:
    """``get_policy`` of a spec ``name[key=value,...]`` (see ``split_spec``)."""
    return get_policy(spec)


__all__ = ["POLICIES", "DEFAULT_POLICY", "Attention", "Policy", "Stat", "get_policy", "parse_value", "split_spec",
           "policy_from_spec"]
