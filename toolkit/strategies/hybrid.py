"""`hybrid`: a split model × data parallelism.

  with strategy.pipeline_degree   pipeline × data parallel on a (pp × dp) mesh: pipeline_degree stages,
                                  each stage replicated over world / pipeline_degree ranks and kept in
                                  step by DDP or sharded by FSDP2 (strategy.data_parallel); the pipeline
                                  strategy's code with a second mesh dimension
  without it                      model parallel inside each process (strategy.devices) × DDP across
                                  processes: the textbook pattern of part1 on cuda:0, part2 on cuda:1,
                                  the whole module wrapped in DistributedDataParallel
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from torch import nn

from toolkit.config.parallel import Degrees
from toolkit.config.recipe import Recipe
from toolkit.config.strategy_options import option_names, options_of, strategy_options
from toolkit.cost.collectives import Collective
from toolkit.errors import RecipeError, ranks_option
from toolkit.memory.state_bytes import StateBytes
from toolkit.model.precision import DTYPES
from toolkit.strategies.base import DataLayout, SetupArgs, Strategy, StrategyInfo, StrategyRules
from toolkit.strategies.model_parallel import check_model_split, one_device, place_model
from toolkit.strategies.dims.comm import ddp_collectives
from toolkit.strategies.dims.levers import LeverOptions
from toolkit.strategies.dims.parallelize import DdpWrap, ddp_no_sync, replicate_over_world
from toolkit.strategies.pipeline.layout import Grid, grid_of
from toolkit.strategies.pipeline.rules import PipelineRules
from toolkit.strategies.pipeline.strategy import PipelineStrategy
from toolkit.strategies.replicated import ReplicatedRules, ReplicatedStrategy, Replication

@strategy_options
class HybridOptions(LeverOptions):
    """The strategy.<option> keys hybrid reads (their defaults and trade-offs: docs/recipe-keys.md): the pipeline's,
    and how its stages are replicated; or, without pipeline_degree, a model split over devices × ddp."""

    schedule: str
    stages_per_rank: int
    split: tuple[int, ...] | None
    split_head: bool  # with pipeline_degree: the head's rows of the vocabulary over the last stages too
    split_by: str  # with pipeline_degree: flops, or time (pipeline/timing.py)
    block_time_ratio: float | None
    blocks: tuple[str, ...] | None
    pipeline_degree: int | None
    data_parallel: str
    devices: tuple[str, ...] | None
    tp_degree: int | None  # with pipeline_degree: each stage tensor-parallel over this many ranks (parallel.tp)
    sequence_parallel: bool  # with tp_degree: each stage's norms and residual adds on sequence shards
    loss_parallel: bool  # with tp_degree: the last stage's output layer (a tied embedding on the first) and the loss
    #   split over the vocabulary


OPTIONS = HybridOptions  # the registry reads it by this name


INFO = StrategyInfo(
    name="hybrid", averages_gradients=True, lora=False, options=option_names(HybridOptions),
    exports_in_place=True,  # the model split over devices × DDP; the pipeline form below does not
    summary="a split model × data parallel: pipeline stages replicated by DDP or sharded by FSDP over a "
            "(pp × dp) mesh, or a model split over devices in each process × DDP",
    arms={"pp-ddp": ("strategy.name=hybrid", "strategy.pipeline_degree=2", "strategy.data_parallel=ddp"),
          "pp-fsdp": ("strategy.name=hybrid", "strategy.pipeline_degree=2", "strategy.data_parallel=fsdp"),
          # tensor-parallel stages sharded over their replicas: --nproc 8 or more
          "pp-fsdp-tp2": ("strategy.name=hybrid", "strategy.pipeline_degree=2", "strategy.data_parallel=fsdp",
                          "strategy.tp_degree=2"),
          "pp-fsdp-tp2-sp": ("strategy.name=hybrid", "strategy.pipeline_degree=2", "strategy.data_parallel=fsdp",
                             "strategy.tp_degree=2", "strategy.sequence_parallel=true"),
          "pp-fsdp-tp2-sp-lossp": ("strategy.name=hybrid", "strategy.pipeline_degree=2",
                                   "strategy.data_parallel=fsdp", "strategy.tp_degree=2",
                                   "strategy.sequence_parallel=true", "strategy.loss_parallel=true"),
          "mp-ddp": ("strategy.name=hybrid", "strategy.data_parallel=ddp")})


def check_model_split_ddp(recipe: Recipe, world_size: int) -> None:
    options = options_of(HybridOptions, recipe)
    if options.data_parallel != "ddp":
        raise RecipeError("hybrid without strategy.pipeline_degree splits the model inside each process and "
                          "replicates it with ddp; set strategy.data_parallel=ddp, or a pipeline_degree for fsdp")
    if options.schedule != "1f1b" or options.stages_per_rank != 1 or options.split_head or \
            options.split_by != "flops" or options.block_time_ratio is not None:
        raise RecipeError("strategy.schedule / stages_per_rank / split_head / split_by / block_time_ratio need "
                          "strategy.pipeline_degree (a pipeline)")
    if options.tp_degree is not None:  # a model split inside each process splits no layer over ranks
        raise RecipeError("strategy.tp_degree under hybrid makes each pipeline stage tensor-parallel: it needs "
                          "strategy.pipeline_degree and strategy.data_parallel=fsdp; a model split over devices × ddp "
                          "takes none")
    for key in ("sequence_parallel", "loss_parallel"):
        if getattr(options, key):
            raise RecipeError(f"strategy.{key} under hybrid applies to tensor-parallel pipeline stages: it needs "
                              "strategy.pipeline_degree, strategy.tp_degree and strategy.data_parallel=fsdp")
    for key, off in (("gradient_compression", "none"), ("sync_every", 1)):
        if getattr(options, key) != off:
            raise RecipeError(f"strategy.{key} under hybrid applies to a pipeline's ddp replicas (set "
                              "strategy.pipeline_degree); a model split over devices × ddp runs without it, or use "
                              "strategy ddp")
    check_model_split(recipe, world_size)


def wrap_ddp(module: nn.Module, args: SetupArgs) -> nn.Module:
    # a module over several devices: DDP takes no device_ids and reduces each parameter where it lives
    return replicate_over_world(module, env=args.env, strategy=INFO.name, wrap=DdpWrap(one_device=False))


def split_ddp_reduction(model: nn.Module, recipe: Recipe, world_size: int) -> list[Collective]:
    """DDP's all-reduce of every gradient over the world, DDP's default buckets (DdpWrap)."""
    return ddp_collectives(model, group_size=world_size, group="dp_replicate", bucket_cap_mb=DdpWrap().bucket_cap_mb,
                           grad_dtype=DTYPES[recipe.model.load_dtype])


MODEL_SPLIT_DDP = Replication(
    info=INFO, place=place_model, wrap=wrap_ddp, reduce_desc="all-reduce mean ({dtype})",
    skip_sync=ddp_no_sync, check=check_model_split_ddp,
    one_device=one_device, collectives=split_ddp_reduction)


# the pipeline form: a tied weight has a copy per end stage, and rank 0 gathers the whole model to export it
PIPELINE_INFO = replace(INFO, tied_gradients=0, exports_in_place=False)
PIPELINE_RULES, MODEL_SPLIT_RULES = PipelineRules(PIPELINE_INFO), ReplicatedRules(MODEL_SPLIT_DDP)


class HybridRules:
    """The pipeline's rules with strategy.pipeline_degree, a model split × DDP's without: each form's own."""

    def _form(self, recipe: Recipe) -> StrategyRules:
        return PIPELINE_RULES if options_of(HybridOptions, recipe).pipeline_degree is not None else MODEL_SPLIT_RULES

    def info(self, recipe: Recipe) -> StrategyInfo:
        return self._form(recipe).info(recipe)

    def validate(self, recipe: Recipe, *, world_size: int) -> None:
        self._form(recipe).validate(recipe, world_size=world_size)

    def data_layout(self, recipe: Recipe, *, world_size: int, rank: int) -> DataLayout:
        return self._form(recipe).data_layout(recipe, world_size=world_size, rank=rank)

    def predict_state_bytes(self, model: nn.Module, recipe: Recipe, *, world_size: int) -> list[StateBytes]:
        return self._form(recipe).predict_state_bytes(model, recipe, world_size=world_size)

    def predict_load_bytes(self, model: nn.Module, recipe: Recipe, *, world_size: int,
                           resuming: bool = False) -> list[int]:
        return self._form(recipe).predict_load_bytes(model, recipe, world_size=world_size, resuming=resuming)

    def predict_step_bytes(self, model: nn.Module, recipe: Recipe, *, world_size: int,
                           device_type: str) -> list[int]:
        return self._form(recipe).predict_step_bytes(model, recipe, world_size=world_size, device_type=device_type)

    def predict_gathered_bytes(self, model: nn.Module, recipe: Recipe, *, world_size: int) -> list[int]:
        return self._form(recipe).predict_gathered_bytes(model, recipe, world_size=world_size)

    def predict_collectives(self, model: nn.Module, recipe: Recipe, *, world_size: int, rank: int,
                            shapes: list[tuple[int, int]]) -> list[Collective]:
        return self._form(recipe).predict_collectives(model, recipe, world_size=world_size, rank=rank, shapes=shapes)

    def predict_activation_bytes(self, model: nn.Module, recipe: Recipe, *, world_size: int,
                                 how: dict[str, Any]) -> list[int]:
        return self._form(recipe).predict_activation_bytes(model, recipe, world_size=world_size, how=how)


RULES = HybridRules()


def one_replica_per_stage(grid: Grid, world_size: int) -> str | None:
    """A hybrid whose grid leaves one replica per stage is the pipeline strategy: no data parallelism."""
    if grid.dp > 1:
        return None
    pp = grid.pp
    # tensor-parallel stages take fsdp replicas only (layout.check_tensor_parallel)
    fsdp = " and strategy.data_parallel=fsdp" if grid.tp > 1 and not grid.sharded else ""
    return (f"strategy hybrid with {pp} stages on {world_size} ranks has one replica per stage, so it runs as "
            f"strategy pipeline, without data parallelism; use {ranks_option(2 * pp * grid.tp)}{fsdp} for {pp} "
            f"stages × 2 replicas{f' of {grid.tp} tensor-parallel ranks' if grid.tp > 1 else ''}")


def pipeline_form() -> PipelineStrategy:
    return PipelineStrategy(PIPELINE_INFO, fallback=one_replica_per_stage)


def build(recipe: Recipe) -> Strategy:
    if options_of(HybridOptions, recipe).pipeline_degree is not None:
        return pipeline_form()
    return ReplicatedStrategy(MODEL_SPLIT_DDP)


def degrees(recipe: Recipe, *, world_size: int) -> Degrees:
    options = options_of(HybridOptions, recipe)
    if options.pipeline_degree is None:  # a model split over one process's devices, × ddp over the ranks
        return Degrees(dp_replicate=world_size)
    grid = grid_of(recipe, world_size)  # the one reading of the stages, their replicas and tp ranks
    return Degrees(pp=grid.pp, tp=grid.tp, **{grid.dp_dim: grid.dp})
