"""`ddp`: DistributedDataParallel, one process per device, full replicas, gradients all-reduced (averaged)."""

from __future__ import annotations

import math
from typing import cast

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from toolkit.config.parallel import Degrees
from toolkit.config.recipe import Recipe
from toolkit.config.strategy_options import option_names, options_of, strategy_options
from toolkit.errors import RecipeError
from toolkit.process.dist import ensure_process_group, world_mesh
from toolkit.strategies.base import SetupArgs, StrategyInfo
from toolkit.strategies.dims.parallelize import DdpWrap, parallelize
from toolkit.strategies.replicated import ReplicatedRules, ReplicatedStrategy, Replication

@strategy_options
class DdpOptions:
    """The strategy.<option> keys ddp reads (their defaults and trade-offs: docs/recipe-keys.md)."""

    find_unused_parameters: bool
    bucket_cap_mb: float


OPTIONS = DdpOptions  # the registry reads it by this name


INFO = StrategyInfo(
    name="ddp", averages_gradients=True, exports_in_place=True, plain_data_parallel=True,
    options=option_names(DdpOptions),
    summary="DistributedDataParallel: a full replica per rank, gradients all-reduced; fastest when the model fits",
    arms={"ddp": ("strategy.name=ddp",)})


def wrap_ddp(module: nn.Module, args: SetupArgs) -> nn.Module:
    options, env = options_of(DdpOptions, args.recipe), args.env
    ensure_process_group(env, strategy=INFO.name)  # DDP needs a group, even of one rank
    # a 1-D mesh over the world: its group is the default one (no new group is made)
    mesh = world_mesh(env, degrees(args.recipe, world_size=env.world_size), keep=("dp_replicate",))
    wrap = DdpWrap(bucket_cap_mb=options.bucket_cap_mb, find_unused_parameters=options.find_unused_parameters)
    return parallelize(module, mesh=mesh, env=env, units=[], data_parallel=wrap)


def check_buckets(recipe: Recipe, world_size: int) -> None:
    size_mb = options_of(DdpOptions, recipe).bucket_cap_mb  # DDP takes 0 or less without a word, and inf as an overflow
    if not 0 < size_mb < math.inf:
        raise RecipeError(f"strategy.bucket_cap_mb must be a finite number > 0 (MiB per gradient bucket), got "
                          f"{size_mb}; DDP's default is 25")


DDP = Replication(
    info=INFO, wrap=wrap_ddp, reduce_desc="all-reduce mean ({dtype})", check=check_buckets,
    # no_sync: keep gradients local on non-final micro-batches; the last backward all-reduces the sum
    skip_sync=lambda wrapped: cast(DistributedDataParallel, wrapped).no_sync())


RULES = ReplicatedRules(DDP)


def build(recipe: Recipe) -> ReplicatedStrategy:
    return ReplicatedStrategy(DDP)


def degrees(recipe: Recipe, *, world_size: int) -> Degrees:
    return Degrees(dp_replicate=world_size)
