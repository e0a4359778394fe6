"""`single`: one process, one device, no parallelism. The reference every other strategy is checked against."""

from __future__ import annotations

from toolkit.config.parallel import Degrees
from toolkit.config.recipe import Recipe
from toolkit.config.strategy_options import NoOptions, option_names
from toolkit.strategies.base import StrategyInfo
from toolkit.strategies.replicated import ReplicatedRules, ReplicatedStrategy, Replication

OPTIONS = NoOptions  # reads no strategy.<option> key

INFO = StrategyInfo(
    name="single", one_process=True, tiles_loss=True, holds_gradients=False, tied_gradients=2, exports_in_place=True,
    options=option_names(OPTIONS),
    summary="one process, full model; the reference every other strategy is checked against",
    arms={"single": ("strategy.name=single",)})

SINGLE = Replication(info=INFO, wrap=lambda module, args: module, reduce_desc="none: one process")


RULES = ReplicatedRules(SINGLE)


def build(recipe: Recipe) -> ReplicatedStrategy:
    return ReplicatedStrategy(SINGLE)


def degrees(recipe: Recipe, *, world_size: int) -> Degrees:
    return Degrees()  # one process, one device
