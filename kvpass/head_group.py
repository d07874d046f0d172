"""The KV heads of a layer as this process sees them: all of them (one process, ``HeadGroup``), or this
rank's 1/N under tensor parallelism (``ShardedHeadGroup``, built by ``kvpass.apply(..., tp=N)``).

Policies work per KV head, so most never look across heads. Where one does (D2O's head variances for
its layer budgets, its EMA threshold and "code" merge decision), it asks its ``heads`` for the
statistic of every head of the layer (``gather``), computes exactly what one process computes, and keeps
its own heads' part (``local``). The runtime uses the same object to agree on host-side lengths
(``max``) and on each sampled token (``broadcast``). With one process every method returns its input
unchanged: no op is added anywhere.

Communication goes through the ops of torch's functional collectives (``torch.ops._c10d_functional``,
what ``torch.distributed._functional_collectives`` calls), which trace and replay inside CUDA graphs.
"""

from __future__ import annotations

import torch
from torch import Tensor

_c10d = torch.ops._c10d_functional     # the functional collectives' ops (what funcol calls; trace, CUDA-graph)


class HeadGroup:
    """One process holds every head: each method is the identity."""

    rank: int = 0
    world: int = 1
    collectives: int = 0                            # the collectives asked for so far (none in one process)

    def gather(self, x: Tensor, dim: int = 1) -> Tensor:
        """x: this rank's heads along ``dim`` -> every head of the layer, in rank order."""
        return x

    def local(self, x: Tensor, dim: int = 1) -> Tensor:
        """x: every head along ``dim`` -> this rank's heads (the inverse of ``gather``)."""
        return x

    def max(self, x: Tensor) -> Tensor:
        """Elementwise maximum of ``x`` over the ranks."""
        return x

    def broadcast(self, x: Tensor) -> Tensor:
        """Rank 0's ``x`` on every rank."""
        return x

    def __repr__(self) -> str:
        return "HeadGroup()"


class ShardedHeadGroup(HeadGroup):
    """Rank ``rank`` of ``world`` holds heads [rank * n / world, (rank + 1) * n / world) of every layer; the
    collectives run over the process group called ``group_name`` (a ``DeviceMesh``'s group)."""

    def __init__(self, group_name: str, rank: int, world: int) -> None:
        if world < 2 or not 0 <= rank < world:
            raise ValueError(f"ShardedHeadGroup needs world >= 2 and 0 <= rank < world, got rank={rank}, world={world}")
        self.group_name, self.rank, self.world = group_name, rank, world
        self.collectives = 0

    def gather(self, x: Tensor, dim: int = 1) -> Tensor:
        if x.dtype == torch.bool:                  # not every backend gathers bool
            return self.gather(x.to(torch.uint8), dim).bool()
        first = x.movedim(dim, 0).contiguous()     # the collective stacks ranks along dim 0
        self.collectives += 1
        out = _c10d.all_gather_into_tensor.default(first, self.world, self.group_name)
        return _c10d.wait_tensor.default(out).movedim(0, dim)

    def local(self, x: Tensor, dim: int = 1) -> Tensor:
        size = x.shape[dim]
        if size % self.world:
            raise ValueError(f"{size} heads along dim {dim} do not split over {self.world} ranks")
        n = size // self.world
        return x.narrow(dim, self.rank * n, n)

    def max(self, x: Tensor) -> Tensor:
        self.collectives += 1
        return _c10d.wait_tensor.default(_c10d.all_reduce.default(x.contiguous(), "max", self.group_name))

    def broadcast(self, x: Tensor) -> Tensor:
        self.collectives += 1
        return _c10d.wait_tensor.default(_c10d.broadcast.default(x.contiguous(), 0, self.group_name))

    def __repr__(self) -> str:
        return f"ShardedHeadGroup(rank={self.rank}, world={self.world}, group={self.group_name!r})"


SINGLE_PROCESS = HeadGroup()

__all__ = ["SINGLE_PROCESS", "HeadGroup", "ShardedHeadGroup"]
