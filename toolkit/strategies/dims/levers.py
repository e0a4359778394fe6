"""The replica levers' strategy.<option> keys: gradient compression (dims/compression.py), read by ddp and by hybrid's
pipeline replicas, and local SGD (dims/local_sgd.py), read by those and by fsdp's HSDP replica groups; each
strategy's options dataclass holds them by inheriting LeverOptions (both) or LocalSgdOptions."""

from __future__ import annotations

from toolkit.config.recipe import Recipe
from toolkit.config.strategy_options import options_of, strategy_options
from toolkit.strategies.dims.compression import Compression
from toolkit.strategies.dims.local_sgd import LocalSgdConfig


@strategy_options
class LocalSgdOptions:
    """The strategy.<option> keys of local SGD and DiLoCo (their defaults and trade-offs: docs/recipe-keys.md)."""

    sync_every: int
    outer_optimizer: str
    outer_lr: float | None
    outer_momentum: float


@strategy_options
class LeverOptions(LocalSgdOptions):
    """The strategy.<option> keys of the levers on data-parallel replicas whose gradients DDP reduces: compression's
    and local SGD's."""

    gradient_compression: str
    powersgd_rank: int
    powersgd_start_step: int


def compression_of(recipe: Recipe) -> Compression:
    options = options_of(LeverOptions, recipe)
    return Compression(kind=options.gradient_compression, rank=options.powersgd_rank,
                       start_step=options.powersgd_start_step)


def local_sgd_of(recipe: Recipe) -> LocalSgdConfig:
    options = options_of(LocalSgdOptions, recipe)
    return LocalSgdConfig(every=options.sync_every, outer=options.outer_optimizer, outer_lr=options.outer_lr,
                          outer_momentum=options.outer_momentum)
