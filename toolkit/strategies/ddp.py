"""`ddp`: DistributedDataParallel, one process per device, full replicas, gradients all-reduced (averaged)."""

from __future__ import annotations

import math
from typing import cast

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from toolkit.config.parallel import Degrees
from toolkit.config.recipe import Recipe
from toolkit.errors import RecipeError
from toolkit.process.dist import ensure_process_group
from toolkit.strategies.base import SetupArgs, StrategyInfo
from toolkit.strategies.replicated import ReplicatedRules, ReplicatedStrategy, Replication

INFO = StrategyInfo(
    name="ddp", averages_gradients=True, exports_in_place=True, plain_data_parallel=True,
    options=("find_unused_parameters", "bucket_cap_mb"),
    summary="DistributedDataParallel: a full replica per rank, gradients all-reduced; fastest when the model fits",
    arms={"ddp": ("strategy.name=ddp",)})


def wrap_ddp(module: nn.Module, args: SetupArgs) -> nn.Module:
    options = args.recipe.strategy
    ensure_process_group(args.env, strategy=INFO.name)  # DDP needs a group, even of one rank
    device_ids = [args.env.device.index] if args.env.device.type == "cuda" else None
    # gradient_as_bucket_view: .grad are views into DDP's all-reduce buckets. Without it DDP keeps a second
    # copy of every gradient in its buckets (measured: 17.7 MiB beside llama-tiny's 17.7 MiB of gradients,
    # found by the live-tensor census in run.json); same reduction, same numbers
    return DistributedDataParallel(module, device_ids=device_ids, bucket_cap_mb=options.bucket_cap_mb,
                                   find_unused_parameters=options.find_unused_parameters,
                                   gradient_as_bucket_view=True)


def check_buckets(recipe: Recipe, world_size: int) -> None:
    size_mb = recipe.strategy.bucket_cap_mb  # DDP takes 0 or less without a word, and inf as an overflow
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
