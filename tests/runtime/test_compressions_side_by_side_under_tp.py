"""Under tensor parallelism the runtime compresses a layer after another only for policies whose compression
gathers statistics across heads (``GathersAcrossHeads``); every other policy's layers run side by side
as in one process, which is safe only if their compression calls no collective. The runtime checks it: a
policy that gathers but declares it does not is refused at its first compression, not left to hang on a GPU.
(Every registered policy is also run at tp=2 and 4 over gloo in tests/rewrites/test_shard_tensor_parallel.py,
where this check runs too.) Here one process plays a rank of two: each collective is counted and is the
identity."""

from __future__ import annotations

import pytest
import torch

import kvpass
from kvpass.head_group import HeadGroup
from kvpass.policies import POLICIES, get_policy
from kvpass.policies.capabilities import gathers_across_heads
from tests.conftest import tiny_model


class _RankOfTwoAlone(HeadGroup):
    """world 2 in one process: every collective counted, each the identity (so the caches hold every head)."""

    world = 2

    def __init__(self) -> None:
        self.collectives = 0

    def gather(self, x, dim=1):
        self.collectives += 1
        return x

    def max(self, x):
        self.collectives += 1
        return x

    def broadcast(self, x):
        self.collectives += 1
        return x


def _decode(policy_name: str, **kwargs) -> _RankOfTwoAlone:
    model = tiny_model("llama")
    policy = get_policy(policy_name, **kwargs)
    budget = max(16, policy.min_budget() + 8)
    km = kvpass.apply(model, policy=policy_name, budget=budget, **kwargs)
    heads = _RankOfTwoAlone()                               # the model's heads as a rank of two would see them
    km.heads, km.policy = heads, km.policy.with_heads(heads)
    ids = torch.randint(1, model.config.vocab_size, (1, budget + 24), generator=torch.Generator().manual_seed(0))
    steps = policy.interval + 4                             # at least one decode-time compression
    session = km.start(ids, max_new_tokens=steps)
    tok = session.logits.argmax(-1)
    for _ in range(steps):
        tok = session.step(tok).argmax(-1)
    assert session.compressions > 0
    return heads


def test_a_policy_that_gathers_but_says_not_is_refused_at_its_first_compression(monkeypatch) -> None:
    monkeypatch.setattr(type(get_policy("tova")), "gathers_across_heads", lambda self: False)
    with pytest.raises(RuntimeError, match="gathers_across_heads"):
        _decode("tova")


def test_the_declared_policies_compress() -> None:
    assert gathers_across_heads(get_policy("tova")) and gathers_across_heads(get_policy("d2o"))
    assert not gathers_across_heads(get_policy("tova", score_heads="group"))
    _decode("tova")                                         # one after another, gathering
    _decode("tova", score_heads="group")                    # side by side, no collective


# the other policies that compress while decoding (quest and clusterkv recall, full keeps, EMS compresses the prompt)
DECODE_COMPRESSING = sorted(n for n in set(POLICIES) - {"d2o", "adakv", "tova"}
                            if get_policy(n).compresses and getattr(get_policy(n), "interval", None))


@pytest.mark.parametrize("name", DECODE_COMPRESSING)
def test_every_other_policy_compresses_without_a_collective(name: str) -> None:
    assert not gathers_across_heads(get_policy(name))
    _decode(name)
