"""What `pipeline` is before any process group exists: its INFO, the checks a launcher and every rank make, which
data shard a rank reads (its replica's) and the memory rules `toolkit plan` predicts with (pipeline/memory.py)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from toolkit.cost.collectives import Collective
from toolkit.checkpoint.loading import whole_model_bytes
from toolkit.config.recipe import Recipe
from toolkit.config.strategy_options import option_names, strategy_options
from toolkit.memory.state_bytes import StateBytes, element_bytes
from toolkit.model.precision import DTYPES
from toolkit.strategies.base import DataLayout, StrategyInfo
from toolkit.strategies.pipeline.layout import check_recipe, grid_of, rank_stages



@strategy_options
class PipelineOptions:
    """The strategy.<option> keys pipeline reads (their defaults and trade-offs: docs/recipe-keys.md); hybrid's
    pipeline form adds pipeline_degree and data_parallel (hybrid.HybridOptions)."""

    schedule: str
    stages_per_rank: int
    split: tuple[int, ...] | None
    split_head: bool  # the head's rows of the vocabulary over the last stages too (pipeline/split.py head_split)
    split_by: str  # flops, or time: block costs weighted by a measured time per FLOP (pipeline/timing.py)
    block_time_ratio: float | None  # split_by time: a pinned weight instead of the measured one
    blocks: tuple[str, ...] | None
    tp_degree: int | None  # each stage's blocks tensor-parallel over this many ranks (parallel.tp)
    sequence_parallel: bool  # with tp_degree: each stage's norms and residual adds on sequence shards
    loss_parallel: bool  # with tp_degree: the last stage's output layer (a tied embedding on the first) and the loss
    #   split over the vocabulary


OPTIONS = PipelineOptions  # the registry reads it by this name


INFO = StrategyInfo(
    name="pipeline", averages_gradients=True, lora=False, options=option_names(PipelineOptions), tied_gradients=0,
    summary="one stage of consecutive blocks per rank, micro-batches pipelined (torch.distributed.pipelining); "
            "1/N of the model per rank, an idle bubble of (N-1)/(m+N-1); with tp_degree, each stage tensor-parallel "
            "over that many ranks",
    arms={"pp-gpipe": ("strategy.name=pipeline", "strategy.schedule=gpipe"),
          "pp-1f1b": ("strategy.name=pipeline", "strategy.schedule=1f1b"),
          "pp-interleaved": ("strategy.name=pipeline", "strategy.schedule=interleaved-1f1b",
                             "strategy.stages_per_rank=2"),
          "pp-interleaved-zb": ("strategy.name=pipeline", "strategy.schedule=interleaved-zb",
                                "strategy.stages_per_rank=2"),
          "pp-zbv": ("strategy.name=pipeline", "strategy.schedule=zbv", "strategy.stages_per_rank=2"),
          "pp-dualpipev": ("strategy.name=pipeline", "strategy.schedule=dualpipev", "strategy.stages_per_rank=2"),
          # the head's rows of the vocabulary split over the stages too: for a head that outweighs a stage's share
          "pp-gpipe-head": ("strategy.name=pipeline", "strategy.schedule=gpipe", "strategy.split_head=true"),
          "pp-1f1b-head": ("strategy.name=pipeline", "strategy.schedule=1f1b", "strategy.split_head=true"),
          # each stage tensor-parallel over 2 ranks: --nproc 4 or more
          "pp-tp2": ("strategy.name=pipeline", "strategy.tp_degree=2"),
          "pp-tp2-sp": ("strategy.name=pipeline", "strategy.tp_degree=2", "strategy.sequence_parallel=true"),
          "pp-tp2-lossp": ("strategy.name=pipeline", "strategy.tp_degree=2", "strategy.loss_parallel=true"),
          "pp-tp2-sp-lossp": ("strategy.name=pipeline", "strategy.tp_degree=2", "strategy.sequence_parallel=true",
                              "strategy.loss_parallel=true")})


class PipelineRules:
    """What a pipeline is before any process group: its checks, data layout and memory rules (toolkit plan)."""

    def __init__(self, info: StrategyInfo = INFO) -> None:
        self._info = info  # hybrid's pipeline form has its own

    def info(self, recipe: Recipe) -> StrategyInfo:
        return self._info

    def validate(self, recipe: Recipe, *, world_size: int) -> None:
        check_recipe(recipe, world_size=world_size)

    def data_layout(self, recipe: Recipe, *, world_size: int, rank: int) -> DataLayout:
        grid = grid_of(recipe, world_size)
        return DataLayout(rank=grid.coords(rank)[1], size=grid.dp)  # a replica's stages read the same samples

    def predict_state_bytes(self, model: nn.Module, recipe: Recipe, *, world_size: int) -> list[StateBytes]:
        from toolkit.strategies.pipeline.memory import state_bytes_per_rank

        return state_bytes_per_rank(model, recipe, world_size=world_size)

    def predict_load_bytes(self, model: nn.Module, recipe: Recipe, *, world_size: int,
                           resuming: bool = False) -> list[int]:
        """Nothing beyond the stages where each rank reads only its stages' tensors from the pretrained files or
        the checkpoint it resumes from (PipelineStrategy.build_model); else every rank builds the whole model, then
        keeps its stages."""
        from toolkit.checkpoint.loading import ModelSource

        whole = [whole_model_bytes(model, recipe)] * world_size
        if not recipe.model.low_memory_loading:
            return whole
        if resuming or ModelSource(recipe=recipe, tokenizer=None).weight_files(model):
            return [0] * world_size
        return whole

    def predict_step_bytes(self, model: nn.Module, recipe: Recipe, *, world_size: int,
                           device_type: str) -> list[int]:
        # the recipe's AdamW; fused (what auto resolves to) makes no copy, the per-tensor loop's temporaries
        # (about 2 x the largest parameter) are not counted
        return [0] * world_size

    def predict_gathered_bytes(self, model: nn.Module, recipe: Recipe, *, world_size: int) -> list[int]:
        # a stage's blocks are whole under ddp. Under fsdp, torch's schedule sets reshard_after_backward(False) for
        # every backward but the step's reduction (PipelineStage.backward_maybe_with_nosync), so from a unit's first
        # backward to the step's end it holds its gathered parameters (compute dtype) and its whole gradient
        # (accumulated over the micro-batches in fp32 under a 16-bit precision, as FSDP2 reduces it): each rank's
        # own stages whole (with tensor-parallel stages, its tp slices whole), twice over
        from toolkit.model import tp_plan

        grid = grid_of(recipe, world_size)
        if not grid.sharded:
            return [0] * world_size
        stored = DTYPES[recipe.model.load_dtype]  # fp32: MixedPrecisionPolicy casts nothing
        compute = stored if recipe.precision == "fp32" else DTYPES[recipe.precision]
        grads = compute if recipe.precision == "fp32" else torch.float32
        per_param = element_bytes(compute) + element_bytes(grads)

        def held(stage: nn.Module) -> int:
            if grid.tp == 1:
                return sum(p.numel() for p in stage.parameters())
            shapes = tp_plan.local_shapes(stage, grid.tp, loss_parallel=grid.loss_parallel)
            return sum(math.prod(shape) for shape in shapes.values())
        numel = [sum(held(stage) for stage in rank_stages(model, recipe, grid, pp_rank)) for pp_rank in range(grid.pp)]
        return [numel[grid.coords(rank)[0]] * per_param for rank in range(world_size)]

    def predict_collectives(self, model: nn.Module, recipe: Recipe, *, world_size: int, rank: int,
                            shapes: list[tuple[int, int]]) -> list[Collective]:
        from toolkit.strategies.pipeline import collectives

        return collectives.predict(model, recipe, world_size=world_size, rank=rank, shapes=shapes)

    def predict_activation_bytes(self, model: nn.Module, recipe: Recipe, *, world_size: int,
                                 how: dict[str, Any]) -> list[int]:
        from toolkit.strategies.pipeline.memory import activation_bytes_per_rank

        return activation_bytes_per_rank(model, recipe, world_size=world_size, how=how)


RULES = PipelineRules()


def stage_lines(model: nn.Module, recipe: Recipe, *, world_size: int) -> list[str]:
    """`toolkit plan`'s lines for a pipeline: each stage's blocks and predicted FLOPs per step (its replica's
    micro-batches at data.max_length), and its share of the pipeline's (the table above gives their memory)."""
    from toolkit.config.recipe import plan_batch
    from toolkit.model.blocks import layer_stack
    from toolkit.model.placement import blocks_of
    from toolkit.strategies.pipeline.layout import head_rows_of, split_how, stage_of_blocks
    from toolkit.strategies.pipeline.split import block_costs, stage_costs

    grid = grid_of(recipe, world_size)
    parts, num_stages = stage_of_blocks(model, recipe, grid)
    rows = head_rows_of(model, recipe, grid)
    costs, head = block_costs(model, layer_stack(model, recipe.strategy.blocks), recipe, tp=grid.tp,
                              loss_parallel=grid.loss_parallel)
    batch = plan_batch(recipe.batch, world_size=grid.dp)
    tokens = batch.micro_batch_size * batch.grad_accum_steps * recipe.data.max_length
    flops = stage_costs(costs, head, parts, rows)
    total = sum(flops) or 1.0
    how = split_how(recipe)
    how += ", the head's rows too" if any(rows) else ""
    per = f" of a tp rank of {grid.tp}" if grid.tp > 1 else ""

    def head_of(stage: int) -> str:
        held = rows[stage]
        if held is not None:
            return f" + head rows {held[0]}-{held[1] - 1}"
        return " + head" if stage == num_stages - 1 and head and not any(rows) else ""
    return [f"stages ({how}; forward + backward FLOPs per step{per}):"] + [
        f"  stage {s}: blocks {blocks_of(parts, s)}{head_of(s)}, "
        f"{_flop(f * tokens)} ({100 * f / total:.0f} %)" for s, f in enumerate(flops)]


def _flop(count: float) -> str:
    """FLOPs in the unit that keeps them short: 7.29 GFLOP, 4785.07 TFLOP (not 4785074.60 GFLOP)."""
    return f"{count / 1e12:,.2f} TFLOP" if count >= 1e12 else f"{count / 1e9:.2f} GFLOP"
