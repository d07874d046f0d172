"""A policy as JSON and back: its registered name and hyperparameters (``save_pretrained``'s kvpass_config.json,
the ONNX export's metadata)."""

from __future__ import annotations

import json
from dataclasses import fields

from kvpass.policies.base import Policy


def policy_metadata(policy: Policy) -> dict:
    """The policy's name and fields as JSON values (tuples as lists, a wrapped policy as {"policy": its own}),
    for ``rebuild_policy``. Raises TypeError for a field JSON cannot hold."""
    out = {"name": policy.name}
    for f in fields(policy):
        value = getattr(policy, f.name)
        if isinstance(value, Policy):
            value = {"policy": policy_metadata(value)}
        out[f.name] = list(value) if isinstance(value, tuple) else value
    json.dumps(out)                                  # a field JSON cannot hold fails here
    return out


def rebuild_policy(meta: dict) -> Policy:
    """The policy ``policy_metadata`` describes (tuples restored where the field's default is one)."""
    from kvpass.policies import POLICIES

    cls = POLICIES[meta["name"]]
    defaults = cls.defaults()

    def value(k, v):
        if isinstance(v, dict) and set(v) == {"policy"}:
            return rebuild_policy(v["policy"])
        return tuple(v) if isinstance(defaults.get(k), tuple) and isinstance(v, list) else v

    return cls(**{k: value(k, v) for k, v in meta.items() if k != "name"})


def rebuildable(policy: Policy) -> bool:
    """Whether ``rebuild_policy(policy_metadata(policy))`` gives this policy (registered, JSON fields)."""
    from kvpass.policies import POLICIES

    if POLICIES.get(policy.name) is not type(policy):
        return False
    try:
        return rebuild_policy(policy_metadata(policy)) == policy
    except (TypeError, ValueError):
        return False
