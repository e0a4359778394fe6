"""The replica levers' strategy.<option> keys, read by ddp and by hybrid's pipeline replicas: gradient compression
(dims/compression.py) and local SGD (dims/local_sgd.py); each strategy's options dataclass holds them by inheriting
LeverOptions."""

from __future__ import annotations

from toolkit.config.recipe import Recipe
from toolkit.config.strategy_options import options_of, strategy_options
from toolkit.strategies.dims.compression import Compression
from toolkit.strategies.dims.local_sgd import LocalSgdConfig


@strategy_options
class LeverOptions:
    """The strategy.<option> keys of the levers on data-parallel replicas (their defaults and trade-offs:
    docs/recipe-keys.md)."""

    gradient_compression: str
    powersgd_rank: int
    powersgd_start_step: int
    sync_every: int
    outer_optimizer: str
    outer_lr: float | None
    outer_momentum: float


def compression_of(recipe: Recipe) -> Compression:
    options = options_of(LeverOptions, recipe)
    return Compression(kind=options.gradient_compression, rank=options.powersgd_rank,
                       start_step=options.powersgd_start_step)


def local_sgd_of(recipe: Recipe) -> LocalSgdConfig:
    options = options_of(LeverOptions, recipe)
    return LocalSgdConfig(every=options.sync_every, outer=options.outer_optimizer, outer_lr=options.outer_lr,
                          outer_momentum=options.outer_momentum)
