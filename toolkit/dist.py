"""The process group, the device and small collectives. The only reader of RANK/WORLD_SIZE/LOCAL_RANK."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def env_world_size() -> int:
    """World size as the launcher set it (1 when not launched by torchrun/accelerate)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed() -> DistEnv:
    """Join the process group the launcher described (if any) and pick this rank's device."""
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world_size = env_world_size()
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=30))
    return DistEnv(rank=rank, local_rank=local_rank, world_size=world_size, device=device)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def barrier(env: DistEnv) -> None:
    if env.distributed:
        dist.barrier()


def _to_backend(tensor: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """NCCL only moves device tensors: small host tensors (counts, checksums) travel through env.device."""
    return tensor.to(env.device)  # no copy on CPU/gloo


def _all_reduce(tensor: torch.Tensor, env: DistEnv, op) -> torch.Tensor:
    if env.distributed:
        moved = _to_backend(tensor, env)
        dist.all_reduce(moved, op=op)
        if moved is not tensor:
            tensor.copy_(moved)  # device sync on GPU: callers read the result on the host
    return tensor


def all_reduce_sum(tensor: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """Sum a small tensor over ranks in place (float64 sums stay exact for counts)."""
    return _all_reduce(tensor, env, dist.ReduceOp.SUM)


def all_gather_tensor(tensor: torch.Tensor, env: DistEnv) -> list[torch.Tensor]:
    """Every rank's copy of a small tensor of the same shape, in rank order, on the tensor's device."""
    if not env.distributed:
        return [tensor]
    moved = _to_backend(tensor, env)
    out = [torch.zeros_like(moved) for _ in range(env.world_size)]
    dist.all_gather(out, moved)
    return [t.to(tensor.device) for t in out]


def gather_objects(obj, env: DistEnv) -> list:
    """Every rank's small picklable object, in rank order (collective)."""
    if not env.distributed:
        return [obj]
    out = [None] * env.world_size
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj, env: DistEnv):
    if not env.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
