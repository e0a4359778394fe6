"""`model_parallel`: one process splits the model by its transformer blocks over several devices.

Each device holds a run of consecutive blocks; embeddings sit with the first, the final norm and head with
the last; activations move at the boundaries through forward pre-hooks (the model's code is untouched).
Only one device works at a time (no pipelining): it fits a model one device cannot hold, at the speed of
one device plus the transfers. On a machine without GPUs the device list may repeat `cpu`: the code path
and the boundaries are the same.
"""

from __future__ import annotations

import torch
from torch import nn

from toolkit.config.parallel import Degrees
from toolkit.config.recipe import Recipe
from toolkit.config.strategy_options import option_names, options_of, strategy_options
from toolkit.model.blocks import count_blocks
from toolkit.model.placement import check_split, parse_devices, place_over_devices
from toolkit.strategies.base import SetupArgs, StrategyInfo
from toolkit.strategies.replicated import ReplicatedRules, ReplicatedStrategy, Replication

@strategy_options
class ModelParallelOptions:
    """The strategy.<option> keys model_parallel reads (their defaults and trade-offs: docs/recipe-keys.md)."""

    devices: tuple[str, ...] | None
    split: tuple[int, ...] | None
    blocks: tuple[str, ...] | None


OPTIONS = ModelParallelOptions  # the registry reads it by this name


INFO = StrategyInfo(
    name="model_parallel", one_process=True, lora=False, holds_gradients=False, tied_gradients=2, exports_in_place=True,
    options=option_names(ModelParallelOptions),
    summary="one process, the model split by blocks over strategy.devices; fits a model no single device holds, "
            "one device busy at a time",
    arms={"mp": ("strategy.name=model_parallel",)})


def check_model_split(recipe: Recipe, world_size: int) -> None:
    """The device list and the split against the model's blocks, before training starts."""
    options = options_of(ModelParallelOptions, recipe)
    devices = parse_devices(options.devices, local_rank=max(0, world_size - 1))
    check_split(options.split, num_blocks=count_blocks(recipe.model, options.blocks),
                num_parts=len(devices), what="devices")


def place_model(model: nn.Module, args: SetupArgs) -> tuple[nn.Module, torch.device, str]:
    options = options_of(ModelParallelOptions, args.recipe)
    devices = parse_devices(options.devices, local_rank=args.env.local_rank)
    placement = place_over_devices(model, devices=devices, split=options.split, block_names=options.blocks)
    return model, placement.input_device, placement.describe()


def one_device(args: SetupArgs) -> str | None:
    """Why a split whose parts all share one device (the CPU's default: two `cpu` parts) is no split, in one line;
    None where the parts are on devices of their own."""
    devices = parse_devices(options_of(ModelParallelOptions, args.recipe).devices, local_rank=args.env.local_rank)
    if len(set(devices)) > 1:
        return None
    return (f"strategy {args.recipe.strategy.name} put all {len(devices)} parts of the model on {devices[0]}: the "
            "split's code ran (inputs moved at each boundary), but one device held the whole model, so its memory "
            "and speed are not a split's; list two or more devices in strategy.devices (e.g. [cuda:0, cuda:1])")


MODEL_PARALLEL = Replication(info=INFO, place=place_model, wrap=lambda module, args: module,
                             reduce_desc="none: one process", check=check_model_split, one_device=one_device)


RULES = ReplicatedRules(MODEL_PARALLEL)


def build(recipe: Recipe) -> ReplicatedStrategy:
    return ReplicatedStrategy(MODEL_PARALLEL)


def degrees(recipe: Recipe, *, world_size: int) -> Degrees:
    return Degrees()  # one process: its parts are devices of the process, not ranks of a mesh
