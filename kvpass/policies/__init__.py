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
from kvpass.policies.kvmerger import KVMerger
from kvpass.policies.pyramidkv import PyramidKV
from kvpass.policies.quest import Quest
from kvpass.policies.snapkv import SnapKV
from kvpass.policies.streamingllm import StreamingLLM

POLICIES: dict[str, type[Policy]] = {p.name: p for p in (Full, StreamingLLM, D2O, H2O, SnapKV, PyramidKV, CaM,
                                                          Chelsea, KVMerger, EMS, ClusterKV, Quest, AdaKV)}
DEFAULT_POLICY = "d2o"


def get_policy(name: str | Policy, **kwargs) -> Policy:
    """The policy called ``name`` with ``kwargs`` overriding its defaults. A Policy instance passes through."""
    if isinstance(name, Policy):
        if kwargs:
            raise TypeError("policy keyword arguments go with a policy name, not an instance")
        return name
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; available: {', '.join(sorted(POLICIES))}")
    cls = POLICIES[name]
    unknown = set(kwargs) - set(cls.defaults())
    if unknown:
        owners = sorted(n for n, c in POLICIES.items() if unknown & set(c.defaults()))
        hint = f" ({', '.join(sorted(unknown))} belongs to: {', '.join(owners)})" if owners else ""
        raise ValueError(f"policy {name!r} has no parameter(s) {', '.join(sorted(unknown))}; "
                         f"its parameters: {', '.join(cls.defaults()) or 'none'}{hint}")
    return cls(**kwargs)


__all__ = ["POLICIES", "DEFAULT_POLICY", "Attention", "Policy", "Stat", "get_policy"]
