"""The strategy registry: name -> module. Each module has `INFO` (a StrategyInfo) and `build()`.

Adding a strategy = one module in this package + one line here. Modules load lazily, so DeepSpeed
is imported only when a zero run sets up.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import TYPE_CHECKING, Any

from toolkit.config.parallel import Degrees, resolve
from toolkit.config.recipe import BatchPlan, Recipe, plan_batch
from toolkit.errors import RecipeError
from toolkit.config.strategy_options import option_names
from toolkit.strategies.base import DataLayout, Strategy, StrategyInfo, StrategyRules, import_runtime_module

_MODULES = {
    "single": "toolkit.strategies.single",
    "dp": "toolkit.strategies.dp",
    "ddp": "toolkit.strategies.ddp",
    "fsdp": "toolkit.strategies.fsdp",
    "zero": "toolkit.strategies.zero.engine",
    "model_parallel": "toolkit.strategies.model_parallel",
    "pipeline": "toolkit.strategies.pipeline.strategy",
    "hybrid": "toolkit.strategies.hybrid",
    "tp": "toolkit.strategies.tp",
    "hf_native": "toolkit.strategies.hf_native",
}

if TYPE_CHECKING:  # the type checker holds every strategy class to the protocol
    from toolkit.strategies.fsdp import FsdpRules, FsdpStrategy
    from toolkit.strategies.hf_native import HfNativeRules, HfNativeStrategy
    from toolkit.strategies.hybrid import HybridRules
    from toolkit.strategies.pipeline.rules import PipelineRules
    from toolkit.strategies.pipeline.strategy import PipelineStrategy
    from toolkit.strategies.replicated import ReplicatedRules, ReplicatedStrategy
    from toolkit.strategies.tp import TpRules, TpStrategy
    from toolkit.strategies.zero.engine import ZeroStrategy
    from toolkit.strategies.zero.rules import ZeroRules

    _PROTOCOL_CHECK: tuple[type[Strategy], ...] = (ReplicatedStrategy, FsdpStrategy, ZeroStrategy, PipelineStrategy,
                                                   TpStrategy, HfNativeStrategy)
    _RULES_CHECK: tuple[type[StrategyRules], ...] = (ReplicatedRules, FsdpRules, ZeroRules, PipelineRules, TpRules,
                                                     HybridRules, HfNativeRules)


def strategy_names() -> tuple[str, ...]:
    return tuple(_MODULES)


def strategy_info(name: str) -> StrategyInfo:
    return _module(name).INFO


def import_runtime_modules(recipe: Recipe) -> None:
    """Import the libraries the recipe's strategy runs on (StrategyInfo.runtime_modules): a rank does it before
    it measures the runtime its memory prediction starts from, so that the runtime holds them, as toolkit plan's."""
    for name in strategy_info(recipe.strategy.name).runtime_modules:
        import_runtime_module(name)


def make_strategy(recipe: Recipe) -> Strategy:
    """The recipe's strategy, not yet set up (an unknown name is a RecipeError). `recipe`: resolved (its
    `parallel:` degrees turned into a preset: toolkit.config.parallel.resolve, where the world size is known)."""
    assert recipe.strategy.name != "single" or all((getattr(recipe.parallel, name) or 1) == 1 for name in (
        "dp_replicate", "dp_shard", "tp", "pp")), "make_strategy needs the recipe resolve() returns"
    return _module(recipe.strategy.name).build(recipe)


def strategy_rules(recipe: Recipe) -> StrategyRules:
    """The recipe's strategy before any process group: its checks, data layout and memory rules. `recipe`: resolved."""
    return _module(recipe.strategy.name).RULES


def data_layout(recipe: Recipe, *, world_size: int, rank: int) -> DataLayout:
    """Which shard of each global batch `rank` reads under the recipe's strategy (`recipe`: resolved)."""
    return strategy_rules(recipe).data_layout(recipe, world_size=world_size, rank=rank)


def strategy_degrees(recipe: Recipe, *, world_size: int) -> Degrees:
    """The parallel degrees the recipe's strategy runs at `world_size` (what the run prints and run.json keeps)."""
    return _module(recipe.strategy.name).degrees(recipe, world_size=world_size)


def layout_line(recipe: Recipe, *, world_size: int) -> str:
    """`fsdp (dp_shard 2 × tp 2)`: the preset and the degrees it runs at, in one line."""
    return f"{recipe.strategy.name} ({strategy_degrees(recipe, world_size=world_size).describe()})"


def arm_aliases() -> dict[str, tuple[str, ...]]:
    """Every strategy's `toolkit compare` arm names -> recipe overrides, in registry order."""
    return {arm: overrides for name in _MODULES for arm, overrides in strategy_info(name).arms.items()}


def strategy_for_plugin(plugin: str) -> str:
    """The strategy that runs what an `accelerate launch` config file's plugin (fsdp, deepspeed) asks for."""
    return next(name for name in _MODULES if strategy_info(name).accelerate_plugin == plugin)


def validate_strategy(recipe: Recipe, *, world_size: int) -> BatchPlan:
    """The recipe's strategy against a world size, before any process group exists: the name, options
    set for another strategy, the strategy's own checks, the batch arithmetic (its rules: no strategy is made)."""
    recipe = resolve(recipe, world_size=world_size)  # parallel degrees -> their preset; unchanged without them
    rules = strategy_rules(recipe)
    info = rules.info(recipe)
    _check_options(recipe)
    if recipe.model.lora is not None and not info.lora:
        raise RecipeError(f"model.lora is not available with strategy {recipe.strategy.name} yet (its split of the "
                          f"model goes by layer names LoRA changes); use {_those('lora')}")
    if recipe.train.compile and not info.compiles:
        raise RecipeError(f"train.compile is not available with strategy {recipe.strategy.name} yet (its compiled "
                          "blocks are not checked against eager ones); set train.compile: false")
    if recipe.train.tiled_loss and not info.tiles_loss:
        raise RecipeError(f"train.tiled_loss is not available with strategy {recipe.strategy.name} yet (not checked "
                          f"against the full loss there); use {_those('tiles_loss')}, or set train.tiled_loss: false")
    rules.validate(recipe, world_size=world_size)
    layout = rules.data_layout(recipe, world_size=world_size, rank=0)
    return plan_batch(recipe.batch, world_size=layout.size)  # the global batch is split over data shards


def _those(capability: str) -> str:
    """The strategies whose StrategyInfo has `capability` (a flag such as lora), as "a, b or c"."""
    names = [name for name in strategy_names() if getattr(strategy_info(name), capability)]
    return f"{', '.join(names[:-1])} or {names[-1]}" if len(names) > 1 else names[0]


def _check_options(recipe: Recipe) -> None:
    """An option set away from its default for a strategy that ignores it is a mistake, not a no-op."""
    foreign = foreign_options(recipe)
    if foreign:
        option, readers = next(iter(foreign.items()))
        raise RecipeError(f"strategy.{option} applies to {'/'.join(readers)} only, but strategy.name is "
                          f"{recipe.strategy.name}; remove it or set strategy.name={readers[0]}")


def foreign_options(recipe: Recipe) -> dict[str, tuple[str, ...]]:
    """The strategy options the recipe sets away from their defaults that its own strategy does not read: each
    option -> the strategies that read it, in registry order."""
    owners: dict[str, list[str]] = {}
    for name in _MODULES:
        for option in option_names(_module(name).OPTIONS):
            owners.setdefault(option, []).append(name)
    config = recipe.strategy
    return {f.name: tuple(owners[f.name]) for f in dataclasses.fields(config)
            if f.name in owners and config.name not in owners[f.name] and getattr(config, f.name) != f.default}


def without_foreign_options(recipe: Recipe) -> tuple[Recipe, tuple[str, ...]]:
    """The recipe with the options `foreign_options` names set back to their defaults, and those options as the
    recipe set them (`strategy.offload_optimizer=true`): a layout of another strategy than the recipe's, planned
    beside it, runs without them, where a run of the recipe itself is refused."""
    from toolkit.config.files import override_value

    foreign = foreign_options(recipe)
    if not foreign:
        return recipe, ()
    defaults: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(recipe.strategy) if f.name in foreign}
    dropped = tuple(f"strategy.{name}={override_value(getattr(recipe.strategy, name))}" for name in foreign)
    return dataclasses.replace(recipe, strategy=dataclasses.replace(recipe.strategy, **defaults)), dropped


def _module(name: str):
    if name not in _MODULES:
        raise RecipeError(f"strategy.name: unknown value {name!r}; choose one of {', '.join(_MODULES)} "
                          "(`toolkit strategies` lists them)")
    return importlib.import_module(_MODULES[name])
