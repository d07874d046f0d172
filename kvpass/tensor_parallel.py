"""``kvpass.apply(..., tp=N)`` / ``device_mesh=``: which shard this process runs, and the head group its
policy and runtime reduce over. Run under ``torchrun --nproc-per-node N`` (one process per GPU, each with
its ``torch.cuda.set_device(LOCAL_RANK)`` and the whole model loaded); see
``kvpass/rewrites/shard_tensor_parallel.py`` for what is sharded."""

from __future__ import annotations

import datetime
import os

import torch

from kvpass.head_group import SINGLE_PROCESS, HeadGroup, ShardedHeadGroup
from kvpass.rewrites.shard_tensor_parallel import Shard


def resolve_shard(tp: int | None, device_mesh, device: torch.device) -> tuple[Shard | None, HeadGroup]:
    """(this rank's Shard, its head group) for ``tp`` processes or a 1-D ``device_mesh``; (None, the
    single-process group) when neither asks for more than one process."""
    from kvpass.validation import refuse

    if tp is not None and (isinstance(tp, bool) or not isinstance(tp, int) or tp < 1):
        raise refuse("tp.value", name="tp", allowed="an int >= 1 or None", got=tp)
    if device_mesh is None and (tp is None or tp == 1):
        return None, SINGLE_PROCESS
    import torch.distributed as dist
    if device_mesh is None:
        if not dist.is_initialized() and "RANK" not in os.environ:
            raise refuse("tp.processes", got=tp, found="this process runs alone: no torchrun, no torch.distributed")
        from torch.distributed.device_mesh import init_device_mesh
        world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
        if world != tp:
            raise refuse("tp.processes", got=tp, found=f"{world} processes run")
        device_mesh = init_device_mesh(device.type, (tp,))
    if device_mesh.ndim != 1:
        raise refuse("tp.value", argument="device_mesh", name="device_mesh",
                     allowed="a 1-D DeviceMesh (the tensor-parallel dimension)", got=f"{device_mesh.ndim} dims")
    world = device_mesh.size()
    if tp is not None and tp != world:
        raise refuse("tp.value", name="tp", allowed=f"the device_mesh's size, {world}", got=tp)
    if world == 1:
        return None, SINGLE_PROCESS
    group = device_mesh.get_group()
    rank = device_mesh.get_local_rank()
    return Shard(rank, world, group.group_name), ShardedHeadGroup(group.group_name, rank, world)


def init_distributed() -> tuple[int, int, torch.device]:
    """(rank, world, device) under torchrun: NCCL on CUDA (NVLink multicast off), gloo on CPU."""
    import torch.distributed as dist

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    cuda = torch.cuda.is_available() and os.environ.get("KVPASS_TP_CPU") != "1"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(minutes=30))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device
