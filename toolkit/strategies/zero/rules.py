"""What `zero` is before any process group exists: its INFO, the checks a launcher and every rank make, its
data layout and the memory rules `toolkit plan` predicts with (DeepSpeed's partitioning: zero/memory.py). No
DeepSpeed import here."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from torch import nn

from toolkit.checkpoint.loading import whole_model_bytes
from toolkit.config.recipe import Recipe, plan_batch
from toolkit.config.strategy_options import option_names, options_of, strategy_options
from toolkit.cost.collectives import Collective
from toolkit.errors import RecipeError
from toolkit.memory.state_bytes import StateBytes
from toolkit.strategies.base import DataLayout, StrategyInfo, every_rank_a_shard, whole_stack_activations
from toolkit.strategies.dims.compression import check_reduce_dtype
from toolkit.strategies.zero import collectives as zero_collectives
from toolkit.strategies.zero import memory as zero_state
from toolkit.strategies.zero.config import (check_with_deepspeed, configured_stage, frees_gradients, offloads,
                                            resolve_ds_config, stage_of)

@strategy_options
class ZeroOptions:
    """The strategy.<option> keys zero reads (their defaults and trade-offs: docs/recipe-keys.md)."""

    stage: int | None
    offload_optimizer: bool
    offload_param: bool
    ds_config: str | None
    reduce_dtype: str | None  # DeepSpeed's communication_data_type; None: its default


OPTIONS = ZeroOptions  # the registry reads it by this name


INFO = StrategyInfo(
    name="zero", averages_gradients=True, accelerate_plugin="deepspeed", casts_parameters=True, tiles_loss=True,
    # and the Muon optimizer's module, which deepspeed.initialize imports on every ZeRO run: torch.compile decorates
    # its kernels as it loads, which imports torch's inductor (+41 MiB resident on CPU, measured): part of the runtime
    # too, not growth the plan cannot name; imported before the runtime is measured, as DeepSpeed itself is
    runtime_modules=("deepspeed", "deepspeed.runtime.zero.muon.muon_optimizer"),
    holds_gradients=False,  # the default stage 2 gives them back after each step; build() says it per recipe
    options=option_names(ZeroOptions),
    summary="DeepSpeed ZeRO: stage 1 shards optimizer state, 2 + gradients, 3 + parameters; optional CPU offload",
    arms={"zero0": ("strategy.name=zero", "strategy.stage=0"),
          "zero1": ("strategy.name=zero", "strategy.stage=1"),
          "zero2": ("strategy.name=zero", "strategy.stage=2"),
          "zero3": ("strategy.name=zero", "strategy.stage=3"),
          "zero2-offload": ("strategy.name=zero", "strategy.stage=2", "strategy.offload_optimizer=true"),
          "zero2-bf16reduce": ("strategy.name=zero", "strategy.stage=2", "strategy.reduce_dtype=bf16"),
          "zero3-offload": ("strategy.name=zero", "strategy.stage=3", "strategy.offload_optimizer=true",
                            "strategy.offload_param=true")})


class ZeroRules:
    """What zero is before any process group: its checks, data layout and memory rules (toolkit plan)."""

    def info(self, recipe: Recipe) -> StrategyInfo:
        # toolkit plan: stages 0-2 free their gradients after a step; stage 1 holds them all until backward ends
        return replace(INFO, holds_gradients=not frees_gradients(recipe),
                       whole_gradients_in_backward=configured_stage(recipe) == 1)

    def validate(self, recipe: Recipe, *, world_size: int) -> None:
        options = options_of(ZeroOptions, recipe)
        check_reduce_dtype(options.reduce_dtype)
        if options.stage is not None and options.stage not in (0, 1, 2, 3):
            raise RecipeError(f"strategy.stage must be 0, 1, 2 or 3, got {options.stage}")
        if options.offload_param and options.stage not in (3, None):
            raise RecipeError("strategy.offload_param needs strategy.stage=3; DeepSpeed offloads parameters "
                              "only under ZeRO-3")
        if options.offload_optimizer and options.stage == 0:  # stage None: the ds_config's, or 2
            raise RecipeError("strategy.offload_optimizer needs strategy.stage >= 1")
        config = resolve_ds_config(recipe, plan_batch(recipe.batch, world_size=world_size))  # JSON contradictions
        if options.ds_config is not None:
            check_with_deepspeed(config, Path(options.ds_config))
        if offloads(config)[1] and stage_of(config) != 3:
            raise RecipeError(f"{options.ds_config}: zero_optimization.offload_param needs stage 3")
        if recipe.train.on_nonfinite == "skip":  # the engine owns the step; it has no "drop these gradients"
            raise RecipeError("train.on_nonfinite=skip is not available under zero (DeepSpeed's engine steps on "
                              "every boundary); use stop, or fp16, whose loss scaling skips overflowing steps")

    def data_layout(self, recipe: Recipe, *, world_size: int, rank: int) -> DataLayout:
        return every_rank_a_shard(world_size=world_size, rank=rank)

    def predict_state_bytes(self, model: nn.Module, recipe: Recipe, *, world_size: int) -> list[StateBytes]:
        return zero_state.predict(model, recipe, world_size=world_size)

    def predict_load_bytes(self, model: nn.Module, recipe: Recipe, *, world_size: int,
                           resuming: bool = False) -> list[int]:
        whole = whole_model_bytes(model, recipe)
        if not partitioned_at_creation(recipe):
            return [whole] * world_size
        if resuming:  # every rank fills its partitions from the checkpoint, module by module (zero/init.py)
            return [0] * world_size
        return [whole if recipe.model.path is None else 0] + [0] * (world_size - 1)  # see zero/init.py

    def predict_step_bytes(self, model: nn.Module, recipe: Recipe, *, world_size: int,
                           device_type: str) -> list[int]:
        return zero_state.step_bytes(model, recipe, world_size=world_size, device_type=device_type)

    def predict_gathered_bytes(self, model: nn.Module, recipe: Recipe, *, world_size: int) -> list[int]:
        return [zero_state.gathered_bytes(model, recipe, world_size=world_size)] * world_size

    def predict_collectives(self, model: nn.Module, recipe: Recipe, *, world_size: int, rank: int,
                            shapes: list[tuple[int, int]]) -> list[Collective]:
        return zero_collectives.predict(model, recipe, world_size=world_size, num_micro_batches=len(shapes))

    def predict_activation_bytes(self, model: nn.Module, recipe: Recipe, *, world_size: int,
                                 how: dict[str, Any]) -> list[int]:
        return whole_stack_activations(model, recipe, world_size=world_size, how=how)


def partitioned_at_creation(recipe: Recipe) -> bool:
    """ZeRO-3's low-memory loading (zero/init.py). Not with LoRA: the adapters' initial values follow the whole
    model's build (as single draws them), which zero.Init's does not reproduce."""
    return recipe.model.low_memory_loading and recipe.model.lora is None and configured_stage(recipe) == 3


RULES = ZeroRules()
