"""Splitting a model by its transformer blocks: which blocks go to which part (device or pipeline stage),
the checks of a user's split and device list, and placing one model over several devices in one process.

Every part holds a run of consecutive blocks. Modules registered before the first block (embeddings) go
with the first part, those after the last block (final norm, head, pooler, classifier) with the last.
A parameter shared by two modules (tied input/output embeddings) stays where it was placed first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from toolkit.errors import RecipeError
from toolkit.model.blocks import layer_stack


def check_split(split: tuple[int, ...] | None, *, num_blocks: int, num_parts: int, what: str) -> None:
    """A user's split against the model: `num_parts - 1` increasing block indices in [1, num_blocks)."""
    if num_parts > num_blocks:
        raise RecipeError(f"{num_parts} {what} but the model has {num_blocks} blocks; use at most {num_blocks} "
                          f"{what}")
    if split is None:
        return
    if len(split) != num_parts - 1:
        raise RecipeError(f"strategy.split {list(split)}: {num_parts} {what} need {num_parts - 1} block indices "
                          "(where each later part starts)")
    if any(b <= a for a, b in zip(split, split[1:])):
        raise RecipeError(f"strategy.split {list(split)} is not increasing; give ascending block indices")
    if split and (split[0] < 1 or split[-1] > num_blocks - 1):
        raise RecipeError(f"strategy.split {list(split)} is out of range: the model has {num_blocks} blocks, "
                          f"so each index must be between 1 and {num_blocks - 1}")


def balanced_starts(block_params: list[int], *, first_extra: int, last_extra: int, num_parts: int) -> list[int]:
    """Block index where each later part starts, so that parts hold about equal parameter counts
    (the first part also holds `first_extra`, the last `last_extra`)."""
    weights = list(block_params)
    weights[0] += first_extra
    weights[-1] += last_extra
    total, running = sum(weights), 0
    starts: list[int] = []
    for index, weight in enumerate(weights[:-1]):
        running += weight
        remaining_blocks = len(weights) - index - 1
        remaining_parts = num_parts - 1 - len(starts)
        # start the next part once this one holds its share, leaving a block for every part still to come
        if remaining_parts and (running >= total * (len(starts) + 1) / num_parts or
                                remaining_blocks == remaining_parts):
            starts.append(index + 1)
    return starts


def part_of_blocks(model: nn.Module, *, blocks: list[nn.Module], num_parts: int,
                   split: tuple[int, ...] | None) -> list[int]:
    """The part index of every block."""
    check_split(split, num_blocks=len(blocks), num_parts=num_parts, what="parts")
    if split is None:
        in_blocks = {id(p) for block in blocks for p in block.parameters()}
        outside = [p for p in model.parameters() if id(p) not in in_blocks]
        head = sum(p.numel() for p in outside) // 2  # before and after the blocks, roughly half each
        split = tuple(balanced_starts([sum(p.numel() for p in b.parameters()) for b in blocks],
                                      first_extra=head, last_extra=head, num_parts=num_parts))
    starts = [0, *split]
    return [sum(1 for s in starts[1:] if index >= s) for index in range(len(blocks))]


@dataclass(frozen=True)
class Placement:
    devices: list[torch.device]  # per part
    block_parts: list[int]  # part index of every block
    input_device: torch.device  # where the model's inputs go (the embeddings' device)

    def describe(self) -> str:
        runs = [f"blocks {blocks_of(self.block_parts, part)} on {device}" for part, device in enumerate(self.devices)]
        return ", ".join(runs) + "; embeddings with the first, head with the last"


def blocks_of(block_parts: list[int], part: int) -> str:
    """'2-3': the blocks of one part, as a range."""
    mine = [index for index, p in enumerate(block_parts) if p == part]
    if not mine:  # a stage of the head's rows alone (strategy.split_head)
        return "none"
    return f"{mine[0]}-{mine[-1]}" if len(mine) > 1 else str(mine[0])


def place_over_devices(model: nn.Module, *, devices: list[torch.device], split: tuple[int, ...] | None,
                       block_names: tuple[str, ...] | None) -> Placement:
    """Move each block to its part's device, the modules before the blocks to the first device and those
    after to the last, and move every module's inputs to its device in a forward pre-hook (activations
    cross at the boundaries; the model's code is not touched)."""
    blocks = layer_stack(model, block_names)
    parts = part_of_blocks(model, blocks=blocks, num_parts=len(devices), split=split)
    placed: set[int] = set()
    block_ids = {id(b): index for index, b in enumerate(blocks)}
    seen_blocks = 0
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in block_ids:
            index = block_ids[id(module)]
            _move(module, devices[parts[index]], placed, recurse=True)
            _hook_inputs(module)
            inside.update(id(m) for m in module.modules())
            seen_blocks = index + 1
            continue
        if id(module) in inside or not _owns_tensors(module):
            continue
        part = 0 if seen_blocks == 0 else parts[-1] if seen_blocks == len(blocks) else parts[seen_blocks - 1]
        _move(module, devices[part], placed, recurse=False)
        _hook_inputs(module)
    embeddings = cast(Any, model).get_input_embeddings()  # a transformers model
    input_device = _device_of(embeddings)
    return Placement(devices=devices, block_parts=parts, input_device=input_device)


def _owns_tensors(module: nn.Module) -> bool:
    return bool(module._parameters) or bool(module._buffers)


def _move(module: nn.Module, device: torch.device, placed: set[int], *, recurse: bool) -> None:
    """Move parameters and buffers not placed yet (a tied parameter stays with its first module)."""
    for owner in (module.modules() if recurse else [module]):
        for name, param in owner._parameters.items():
            if param is not None and id(param) not in placed:
                param.data = param.data.to(device)
                placed.add(id(param))
        for name, buffer in owner._buffers.items():
            if buffer is not None:
                owner._buffers[name] = buffer.to(device)


def _device_of(module: nn.Module) -> torch.device:
    tensors: list[torch.Tensor] = [*module.parameters(), *module.buffers()]
    return tensors[0].device


def _hook_inputs(module: nn.Module) -> None:
    device = _device_of(module)

    def to_device(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.to(device, non_blocking=True)  # a no-op where it already is (always, on CPU)
        if isinstance(value, (tuple, list)):
            return type(value)(to_device(v) for v in value)
        if isinstance(value, dict):
            return {k: to_device(v) for k, v in value.items()}
        return value

    def pre_hook(_module, args, kwargs):
        return to_device(args), to_device(kwargs)

    module.register_forward_pre_hook(pre_hook, with_kwargs=True)


def parse_devices(devices: tuple[str, ...] | None, *, local_rank: int = 0) -> list[torch.device]:
    """The recipe's device list (default: every visible GPU, at least 2, else two `cpu` parts); under
    several processes per machine, local rank r takes the next len(devices) GPUs (cuda:r·n + i)."""
    if devices is None:
        count = torch.cuda.device_count()
        devices = tuple(f"cuda:{i}" for i in range(count)) if count >= 2 else ("cpu", "cpu")
    parsed = []
    for text in devices:
        try:
            device = torch.device(text)
        except RuntimeError:
            raise RecipeError(f"strategy.devices: {text!r} is not a device; use cpu or cuda:N") from None
        if device.type == "cuda":
            index = (device.index or 0) + local_rank * len(devices)
            if index >= torch.cuda.device_count():
                raise RecipeError(f"strategy.devices: cuda:{index} does not exist (this machine has "
                                  f"{torch.cuda.device_count()} CUDA devices)")
            device = torch.device("cuda", index)
        elif device.type != "cpu":
            raise RecipeError(f"strategy.devices: {text!r}: only cpu and cuda devices are supported")
        parsed.append(device)
    if len(parsed) < 2:
        raise RecipeError(f"strategy.devices {list(devices)}: a model split needs at least 2 devices")
    return parsed
