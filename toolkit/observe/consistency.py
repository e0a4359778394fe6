"""Replica consistency: ranks that should hold identical weights prove it with a cheap checksum.

One all-gather of 3 float64 numbers per tensor within the group of ranks that hold the same copy
(every rank for DDP, a replica group for HSDP); any difference from that group's first rank stops the
run and names the first tensor that drifted. Where the groups are smaller than the world, one more
all-gather of a flag stops every rank with it, not only the drifted group's (check_groups).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from toolkit.process.dist import DistEnv, all_gather_tensor, all_reduce_max, all_reduce_sum, global_rank


class ReplicaDriftError(RuntimeError):
    """Replicas that must be identical are not."""


# elements read at a time: a multiple of 7, so every chunk's position weights are the first chunk's
CHUNK = 7 * 2 ** 18  # 1.8M elements, 14 MiB in float64


def checksums(named_params) -> torch.Tensor:
    """Per tensor: the float64 sum, sum of squares and position-weighted sum of its elements, read CHUNK at a time
    (at most two float64 chunks in memory, however big the tensor: a 128K × 4096 embedding whole would be 4 GiB
    twice over). Every rank computes them alike; a tensor of one chunk or less gives what one pass over it gives.
    The position weights are made once a call, not once a tensor: 3-8× faster than before on llama-tiny (0.23 s ->
    0.03-0.07 s), and let go on return (kept, they were a 14 MiB tensor the live-tensor census found in every run)."""
    named_params = list(named_params)
    longest = max((min(p.numel(), CHUNK) for _, p in named_params), default=0)
    weights = torch.arange(longest, dtype=torch.float64) % 7 + 1  # sees swapped elements
    rows = []
    for _, param in named_params:
        flat = param.detach().flatten()
        row = torch.zeros(3, dtype=torch.float64)
        for start in range(0, flat.numel(), CHUNK):
            part = flat[start:start + CHUNK].to("cpu", torch.float64)
            row += torch.stack([part.sum(), (part * part).sum(), (part * weights[:part.numel()]).sum()])
        rows.append(row)
    return torch.stack(rows) if rows else torch.zeros(0, 3, dtype=torch.float64)


def check_replicas(named_params, env: DistEnv, *, when: str, group=None) -> None:
    """Collective over `group` (default: every rank). Raises ReplicaDriftError on each of its ranks if
    any of them differs from the group's first rank."""
    if not env.distributed:
        return
    named_params = list(named_params)
    local = checksums(named_params)
    counts = all_gather_tensor(torch.tensor([local.shape[0]], dtype=torch.long), env, group=group)
    if len({int(c) for c in counts}) != 1:
        raise ReplicaDriftError(f"{when}: ranks hold different numbers of replicated parameters "
                                f"({[int(c) for c in counts]})")
    gathered = all_gather_tensor(local, env, group=group)
    first = global_rank(group, 0)
    for index, other in enumerate(gathered[1:], start=1):
        differs = (other != gathered[0]).any(dim=1).nonzero()
        if differs.numel():
            name = named_params[int(differs[0])][0]
            raise ReplicaDriftError(f"{when}: rank {global_rank(group, index)} differs from rank {first} in "
                                    f"parameter {name!r} (checksum {other[int(differs[0])].tolist()} vs "
                                    f"{gathered[0][int(differs[0])].tolist()})")


def check_groups(entries: list[tuple[list, object | None]], env: DistEnv, *, when: str) -> None:
    """check_replicas for each (named tensors, group) in order, then, if any group is smaller than the world, one
    flag per rank over every rank: a drift found in one group raises ReplicaDriftError on every rank, so all of
    them stop with the drift's exit code rather than the other groups failing when their peers leave."""
    found: ReplicaDriftError | None = None
    for named, group in entries:
        try:
            check_replicas(named, env, when=when, group=group)
        except ReplicaDriftError as exc:  # the later groups' collectives still run on this rank's peers
            found = found or exc
    if env.distributed and any(group is not None for _, group in entries):
        flags = all_gather_tensor(torch.tensor([found is not None], dtype=torch.long), env)
        ranks = [rank for rank, flag in enumerate(flags) if int(flag)]
        if ranks and found is None:
            raise ReplicaDriftError(f"{when}: replicas on rank(s) {', '.join(map(str, ranks))} drifted (their line "
                                    "names the tensor); this rank's own replicas agree")
    if found is not None:
        raise found


def drift(named_params, env: DistEnv, group=None) -> dict[str, float]:
    """Collective over every rank: how far replicas that are allowed to differ (local SGD between syncs) are apart:
    the largest |difference| of one element between any two replicas, and the replicas' root-mean-square distance
    from their mean relative to the mean's norm. `group`: the replicas of this rank's part of the model (a pipeline
    stage's over dp; default every rank holds a whole replica); the parts' distances and norms are then added up
    over the model. Three all-reduces of the parameters (float64) and two of a few numbers: the replica check's
    cadence (train.consistency_check_every) sets what it costs."""
    flat = torch.cat([p.detach().flatten().to("cpu", torch.float64) for _, p in named_params])
    replicas = dist.get_world_size(group) if env.distributed else 1
    high, low, mean = flat.clone(), -flat, flat.clone()
    all_reduce_max(high, env, group=group)
    all_reduce_max(low, env, group=group)
    all_reduce_sum(mean, env, group=group)
    mean /= replicas
    # per part: Σ over its replicas of ‖replica − mean‖², and ‖mean‖² (the same on each of its replicas)
    sums = torch.tensor([float(((flat - mean) ** 2).sum()), float(mean.norm() ** 2)], dtype=torch.float64)
    all_reduce_sum(sums, env, group=group)
    sums[1] /= replicas
    largest = torch.tensor([float((high + low).max()) if flat.numel() else 0.0], dtype=torch.float64)
    if group is not None:  # the other parts: every replica of a part adds its part's sums once more
        all_reduce_sum(sums, env)
        sums /= replicas
        all_reduce_max(largest, env)
    spread, norm = float(sums[0]), float(sums[1]) ** 0.5
    return {"max_abs": float(largest[0]), "relative_norm": (spread / replicas) ** 0.5 / norm if norm else 0.0}
