"""`ddp`: DistributedDataParallel, one process per device, full replicas, gradients all-reduced (averaged)."""

from __future__ import annotations

import math
from torch import nn

from toolkit.config.parallel import Degrees
from toolkit.config.recipe import Recipe
from toolkit.config.strategy_options import option_names, options_of, strategy_options
from toolkit.cost.collectives import Collective
from toolkit.errors import RecipeError
from toolkit.memory.state_bytes import element_bytes
from toolkit.model.precision import DTYPES
from toolkit.strategies.base import SetupArgs, StrategyInfo
from toolkit.strategies.dims.comm import ddp_collectives
from toolkit.strategies.dims.levers import LeverOptions, compression_of, local_sgd_of
from toolkit.strategies.dims.local_sgd import local_sgd_collectives
from toolkit.strategies.dims.parallelize import DdpWrap, ddp_no_sync, replicate_over_world
from toolkit.strategies.replicated import ReplicatedRules, ReplicatedStrategy, Replication

@strategy_options
class DdpOptions(LeverOptions):
    """The strategy.<option> keys ddp reads (their defaults and trade-offs: docs/recipe-keys.md): the replica levers
    (dims/levers.py) and DDP's own."""

    find_unused_parameters: bool
    bucket_cap_mb: float


OPTIONS = DdpOptions  # the registry reads it by this name


INFO = StrategyInfo(
    name="ddp", averages_gradients=True, tiles_loss=True, exports_in_place=True, plain_data_parallel=True,
    options=option_names(DdpOptions),
    summary="DistributedDataParallel: a full replica per rank, gradients all-reduced; fastest when the model fits",
    arms={"ddp": ("strategy.name=ddp",),
          "ddp-fp16c": ("strategy.name=ddp", "strategy.gradient_compression=fp16"),
          "ddp-bf16c": ("strategy.name=ddp", "strategy.gradient_compression=bf16"),
          "ddp-powersgd": ("strategy.name=ddp", "strategy.gradient_compression=powersgd"),
          "ddp-localsgd4": ("strategy.name=ddp", "strategy.sync_every=4"),
          "ddp-diloco8": ("strategy.name=ddp", "strategy.sync_every=8", "strategy.outer_optimizer=nesterov")})


def wrap_ddp(module: nn.Module, args: SetupArgs) -> nn.Module:
    options = options_of(DdpOptions, args.recipe)
    wrap = DdpWrap(bucket_cap_mb=options.bucket_cap_mb, find_unused_parameters=options.find_unused_parameters)
    return replicate_over_world(module, env=args.env, strategy=INFO.name, wrap=wrap)


def check_options(recipe: Recipe, world_size: int) -> None:
    size_mb = options_of(DdpOptions, recipe).bucket_cap_mb  # DDP takes 0 or less without a word, and inf as an overflow
    if not 0 < size_mb < math.inf:
        raise RecipeError(f"strategy.bucket_cap_mb must be a finite number > 0 (MiB per gradient bucket), got "
                          f"{size_mb}; DDP's default is 25")
    compression = compression_of(recipe)
    compression.check(precision=recipe.precision)
    local_sgd_of(recipe).check(compression=compression.kind, precision=recipe.precision)


def ddp_reduction(model: nn.Module, recipe: Recipe, world_size: int) -> list[Collective]:
    """Its gradients (in the load dtype: autocast leaves the parameters alone) all-reduced over every rank; under
    local SGD none, and at a sync step (what the counter counts) the parameters averaged in one all-reduce."""
    local = local_sgd_of(recipe)
    if local.on:
        numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
        return local_sgd_collectives(numel * element_bytes(DTYPES[recipe.model.load_dtype]), local,
                                     group_size=world_size)
    return ddp_collectives(model, group_size=world_size, group="dp_replicate",
                           bucket_cap_mb=options_of(DdpOptions, recipe).bucket_cap_mb,
                           grad_dtype=DTYPES[recipe.model.load_dtype], compression=compression_of(recipe))


DDP = Replication(
    info=INFO, wrap=wrap_ddp, reduce_desc="all-reduce mean ({dtype})", check=check_options,
    skip_sync=ddp_no_sync, collectives=ddp_reduction, compression=compression_of, local_sgd=local_sgd_of)


RULES = ReplicatedRules(DDP)


def build(recipe: Recipe) -> ReplicatedStrategy:
    return ReplicatedStrategy(DDP)


def degrees(recipe: Recipe, *, world_size: int) -> Degrees:
    return Degrees(dp_replicate=world_size)
