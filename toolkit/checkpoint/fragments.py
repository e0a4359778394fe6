"""A checkpoint state held in pieces across ranks (DeepSpeed ZeRO's flat fp32 partitions), written by each rank
as its own chunks of the shared layout's full tensors: no rank ever holds a whole tensor.

A piece is a run of consecutive elements of a flattened parameter (or of its Adam moment). DCP stores a tensor
as boxes (an N-d offset and size each) and reshards any set of boxes on load, so each piece is cut into the
boxes that cover its run in row-major order (at most 2·(dims-1)+1: a partial first row, whole rows, a partial
last row, recursively) and handed to DCP as its write items, through `PiecesSavePlanner`: DCP's default planner
with these items added. The checkpoint it writes is the one every other strategy writes (the same keys and
full shapes; only the chunks differ), so any strategy at any world size loads it.

Why not gather: the pieces gathered on rank 0 and cut into full tensors cost rank 0 two fp32 copies of the
whole model and its Adam moments (12 bytes per parameter each) at every save: +530 MiB on the 22M-parameter
MiniLM at 2 ranks, 168 GB for 7B parameters. Why not DeepSpeed's accessors (safe_get_full_*): they all-gather
every tensor on DeepSpeed's own groups, on the training thread. Here the training thread only lists this rank's
pieces (views, no copy); with checkpoint.async `flatten()` copies them into one buffer on the checkpoint's copy
thread, after which training may update, and DCP writes that copy in the background.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Iterator

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (LoadPlan, ReadItem, SavePlan, TensorWriteData, WriteItem,
                                                  WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list


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

    def flatten(self) -> "Fragments":
        """A copy, for a save written while training goes on: the pieces in one new fp32 CPU buffer (views into
        it), the whole entries cloned."""
        if not self.pieces:
            return Fragments(pieces=[], shapes=self.shapes, whole=_cloned(self.whole))
        flat = torch.cat([p.tensor.detach().reshape(-1).to("cpu", torch.float32) for p in self.pieces])
        pieces, offset = [], 0
        for piece in self.pieces:
            numel = piece.tensor.numel()
            pieces.append(Piece(piece.key, piece.start, flat.narrow(0, offset, numel)))
            offset += numel
        return Fragments(pieces=pieces, shapes=self.shapes, whole=_cloned(self.whole))

    def state(self) -> dict[str, dict[str, torch.Tensor]]:
        """The whole entries in the state dict's parts ({"model": ..., "optim": ...}); the pieces go to DCP as
        write items (`PiecesSavePlanner`)."""
        out: dict[str, dict[str, torch.Tensor]] = {"model": {}, "optim": {}}
        for key, value in self.whole.items():
            part, name = key.split(".", 1)
            out[part][name] = value
        return out

    def write_items(self) -> dict[MetadataIndex, tuple[WriteItem, torch.Tensor]]:
        """Every box of every piece: its DCP write item and its data (fp32: the layout's dtype)."""
        items: dict[MetadataIndex, tuple[WriteItem, torch.Tensor]] = {}
        for key, chunk, view in self.boxes():
            box = view.detach().to(torch.float32)  # a frozen ZeRO-3 weight is in its compute dtype
            index = MetadataIndex(key, chunk.offsets)
            items[index] = (WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=TensorWriteData(
                chunk=chunk, properties=TensorProperties.create_from_tensor(box),
                size=torch.Size(self.shapes[key]))), box)
        return items

    def boxes(self) -> Iterator[tuple[str, ChunkStorageMetadata, torch.Tensor]]:
        """Every box of every piece: its key, its chunk of the full tensor, and the piece's view of it."""
        for piece in self.pieces:
            for offsets, sizes, begin in boxes(self.shapes[piece.key], piece.start, piece.tensor.numel()):
                view = piece.tensor.narrow(0, begin, math.prod(sizes)).view(sizes)
                yield piece.key, ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)), view


def _cloned(whole: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in whole.items()}


def boxes(shape: tuple[int, ...], start: int, numel: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """The boxes (offsets, sizes, where the box begins within the run) that cover elements [start, start +
    numel) of a row-major tensor of `shape`, in element order: each box's elements are consecutive."""
    out: list[tuple[tuple[int, ...], tuple[int, ...], int]] = []
    begin = 0
    for offsets, sizes in _boxes(tuple(shape), start, start + numel):
        out.append((offsets, sizes, begin))
        begin += math.prod(sizes)
    assert begin == numel, (shape, start, numel)
    return out


def _boxes(shape: tuple[int, ...], start: int, stop: int) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
    if stop <= start:
        return
    if len(shape) <= 1:  # a 1-d run (or a scalar, which is one element)
        yield ((start,), (stop - start,)) if shape else ((), ())
        return
    row = math.prod(shape[1:])
    first, end = start // row, stop // row  # rows [first, end) may be whole; row `end` holds the tail
    if start % row:  # a partial first row
        head_stop = min(stop, (first + 1) * row)
        for offsets, sizes in _boxes(shape[1:], start - first * row, head_stop - first * row):
            yield (first, *offsets), (1, *sizes)
        first += 1
        if head_stop == stop:
            return
    if end > first:  # whole rows
        yield (first, *[0] * (len(shape) - 1)), (end - first, *shape[1:])
    if stop % row:  # a partial last row
        for offsets, sizes in _boxes(shape[1:], 0, stop - end * row):
            yield (end, *offsets), (1, *sizes)


class PiecesSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, plus this rank's pieces as write items of their keys (DCP's documented way
    to change what a save writes is a planner of its own). `fragments` may be set after construction: with
    checkpoint.async it is the copy, made on the copy thread before DCP plans."""

    def __init__(self, fragments: Fragments | None = None) -> None:
        super().__init__()
        self.fragments = fragments
        self._items: dict[MetadataIndex, tuple[WriteItem, torch.Tensor]] = {}

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        self._items = self.fragments.write_items() if self.fragments is not None else {}
        extra = [item for item, _ in self._items.values()]
        # the state dict's path of each key, as flatten_state_dict records the others' ("model", "<name>")
        mappings = {**(plan.planner_data or {}),
                    **{item.index.fqn: tuple(item.index.fqn.split(".", 1)) for item in extra}}
        self.plan = dataclasses.replace(plan, items=[*plan.items, *extra], planner_data=mappings)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        found = self._items.get(write_item.index)
        return found[1] if found is not None else super().resolve_data(write_item)


class PiecesLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, plus read items that fill this rank's pieces (views into the strategy's live
    state, fp32) from whatever chunks the checkpoint holds of their keys."""

    def __init__(self, fragments: Fragments) -> None:
        super().__init__()
        self.fragments = fragments
        self._targets: dict[MetadataIndex, torch.Tensor] = {}

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        extra: list[ReadItem] = []
        for key, chunk, view in self.fragments.boxes():
            assert view.dtype == torch.float32, (key, view.dtype)  # read in place: no cast may copy it
            self._targets[MetadataIndex(key, chunk.offsets)] = view
            saved = self.metadata.state_dict_metadata[key] if self.metadata is not None else None
            assert isinstance(saved, TensorStorageMetadata), key  # the reader checked the keys are there
            extra += create_read_items_for_chunk_list(key, saved, [chunk])
        return dataclasses.replace(plan, items=[*plan.items, *extra])

    def resolve_tensor(self, read_item: ReadItem):
        target = self._targets.get(read_item.dest_index)
        if target is None:
            return super().resolve_tensor(read_item)
        return self.transform_tensor(read_item, target)
