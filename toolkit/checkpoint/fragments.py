"""A checkpoint state held in pieces across ranks (DeepSpeed ZeRO's flat fp32 partitions), assembled into the
shared layout's full tensors on rank 0 by a gather on a process group training never uses.

Why: DeepSpeed's accessors (safe_get_full_*) all-gather every tensor on DeepSpeed's own groups, so they must
run on the training thread and hold it up for the whole gather. Here the training thread only lists this
rank's pieces (views, no copy); `flatten()` copies them into one buffer (on the checkpoint's copy thread,
after which training may update), and `Flat.assemble()` gathers and cuts them (still in the background).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Piece:
    key: str  # "model.<name>" or "optim.state.<name>.<key>", as in the shared layout
    start: int  # where this rank's elements begin in the flattened full tensor
    tensor: torch.Tensor  # 1-D: this rank's elements (a view into the strategy's live state)


@dataclass(frozen=True)
class Fragments:
    """This rank's pieces, the full shape of every key they belong to, and what rank 0 holds whole."""

    pieces: list[Piece]
    shapes: dict[str, tuple[int, ...]]  # the full shape of every key a piece may belong to
    whole: dict[str, torch.Tensor]  # rank 0 only: keys it holds in full (buffers, the optimizer step)

    def flatten(self) -> "Flat":
        """Copy: this rank's pieces in one new fp32 CPU buffer, the whole entries cloned."""
        flat = torch.cat([p.tensor.detach().reshape(-1).to("cpu", torch.float32) for p in self.pieces]) \
            if self.pieces else torch.zeros(0)
        table = [(p.key, p.start, p.tensor.numel()) for p in self.pieces]
        whole = {k: v.detach().to("cpu", copy=True) for k, v in self.whole.items()}
        return Flat(buffer=flat, table=table, shapes=self.shapes, whole=whole)


@dataclass(frozen=True)
class Flat:
    buffer: torch.Tensor
    table: list[tuple[str, int, int]]  # (key, start in the full tensor, numel), in buffer order
    shapes: dict[str, tuple[int, ...]]
    whole: dict[str, torch.Tensor]

    def assemble(self, group: Any = None) -> dict[str, dict[str, torch.Tensor]]:
        """Collective on `group` (every rank of it): rank 0 gets {"model": {...}, "optim": {...}} with full
        tensors, the other ranks empty parts (rank 0 alone writes them, as with DeepSpeed's accessors)."""
        world = dist.get_world_size(group) if dist.is_initialized() else 1
        is_main = not dist.is_initialized() or dist.get_rank(group) == 0
        tables: list[Any] = [self.table]
        buffers = [self.buffer]
        if world > 1:
            tables = [None] * world
            dist.all_gather_object(tables, self.table, group=group)  # small: names and offsets
            size = max(sum(n for _, _, n in t) for t in tables)
            padded = self.buffer
            if padded.numel() < size:  # gather takes equal sizes
                padded = torch.cat([padded, torch.zeros(size - padded.numel())])
            buffers = [torch.empty(size) for _ in range(world)] if is_main else []
            dist.gather(padded, buffers if is_main else None, group=group, group_dst=0)
        if not is_main:
            return {"model": {}, "optim": {}}
        return _cut(tables, buffers, shapes=self.shapes, whole=self.whole)


def _cut(tables, buffers, *, shapes: dict[str, tuple[int, ...]], whole: dict[str, torch.Tensor]) -> dict:
    listed = {key for table in tables for key, _, _ in table}  # (no Adam moments before the first step)
    full = {key: torch.empty(_numel(shapes[key])) for key in sorted(listed)}
    covered = dict.fromkeys(full, 0)
    for table, buffer in zip(tables, buffers):
        offset = 0
        for key, start, numel in table:
            full[key][start:start + numel] = buffer[offset:offset + numel]
            covered[key] += numel
            offset += numel
    # every element comes from exactly one rank (ZeRO's partitions do not overlap; padding is never listed)
    assert all(covered[k] == full[k].numel() for k in full), \
        [k for k in full if covered[k] != full[k].numel()][:3]
    out: dict[str, dict[str, torch.Tensor]] = {"model": {}, "optim": {}}
    for key, value in [*((k, v.view(shapes[k])) for k, v in full.items()), *whole.items()]:
        part, name = key.split(".", 1)
        out[part][name] = value
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
