"""Replica consistency: ranks that should hold identical weights prove it with a cheap checksum.

One all-gather of 3 float64 numbers per parameter; any difference from rank 0 stops the run and
names the first parameter that drifted.
"""

from __future__ import annotations

import torch

from toolkit.dist import DistEnv, all_gather_tensor


class ReplicaDriftError(RuntimeError):
    """Replicas that must be identical are not."""


def checksums(named_params) -> torch.Tensor:
    rows = []
    for _, param in named_params:
        flat = param.detach().flatten().to("cpu", torch.float64)
        weights = torch.arange(flat.numel(), dtype=torch.float64) % 7 + 1  # sees swapped elements
        rows.append(torch.stack([flat.sum(), (flat * flat).sum(), (flat * weights).sum()]))
    return torch.stack(rows) if rows else torch.zeros(0, 3, dtype=torch.float64)


def check_replicas(named_params, env: DistEnv, *, when: str) -> None:
    """Collective. Raises ReplicaDriftError on every rank if any rank differs from rank 0."""
    if not env.distributed:
        return
    named_params = list(named_params)
    local = checksums(named_params)
    counts = all_gather_tensor(torch.tensor([local.shape[0]], dtype=torch.long), env)
    if len({int(c) for c in counts}) != 1:
        raise ReplicaDriftError(f"{when}: ranks hold different numbers of replicated parameters "
                                f"({[int(c) for c in counts]})")
    gathered = all_gather_tensor(local, env)
    for rank, other in enumerate(gathered[1:], start=1):
        differs = (other != gathered[0]).any(dim=1).nonzero()
        if differs.numel():
            name = named_params[int(differs[0])][0]
            raise ReplicaDriftError(f"{when}: rank {rank} differs from rank 0 in parameter {name!r} "
                                    f"(checksum {other[int(differs[0])].tolist()} vs "
                                    f"{gathered[0][int(differs[0])].tolist()})")
