"""A pipeline's layout, before training starts: the recipe's checks, the (pp × dp) rank grid, which stage
each block goes to, and the idle bubble its schedule leaves (in theory; measured by count_busy_time and
count_p2p_time). Shared by the strategy's setup and its memory plan (toolkit/strategies/pipeline/memory.py)."""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, cast

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from toolkit.config.recipe import Recipe, plan_batch
from toolkit.errors import RecipeError, ranks_option
from toolkit.model.blocks import layer_stack, uncounted
from toolkit.model.build import meta_model
from toolkit.model.placement import blocks_of, check_split, part_of_blocks
from toolkit.model.stages import Stage, head_path, layout_of
from toolkit.strategies.dims.compression import WIRE_DTYPES
from toolkit.strategies.dims.levers import compression_of, local_sgd_of
from toolkit.strategies.pipeline.schedules import (LOOPED, SCHEDULES, SPLIT_BACKWARD, V_SHAPED, micro_batches_error,
                                                   stage_ids, stages_per_rank_error)
from toolkit.strategies.pipeline.split import Rows, block_costs, cost_balanced_starts, head_split

if TYPE_CHECKING:
    from torch.distributed.pipelining import PipelineStage



@dataclass(frozen=True)
class Grid:
    """The (pp × dp × tp) rank grid, tp innermost as in the one layout: rank = (pp_rank · dp + dp_rank) · tp +
    tp_rank (a stage's tensor-parallel ranks are neighbours, a replica's stages dp · tp ranks apart)."""

    pp: int
    dp: int
    sharded: bool = False  # a stage's dp replicas shard it (FSDP2, the layout's dp_shard) or hold it whole (DDP)
    schedule: str = "1f1b"  # a V-shaped one places the stages otherwise (schedules.stage_ids)
    tp: int = 1  # each stage's attention heads and MLP columns split over tp ranks (strategy.tp_degree)
    sequence_parallel: bool = False  # and its norms and residual adds over 1/tp of the tokens each
    loss_parallel: bool = False  # and its output layer (and a tied embedding) over 1/tp of the vocabulary each

    @property
    def dp_dim(self) -> str:
        """The layout dimension the dp replicas span (process.dist.world_mesh)."""
        return "dp_shard" if self.sharded else "dp_replicate"

    @property
    def dp_kind(self) -> str:
        return "fsdp" if self.sharded else "ddp"

    @property
    def split_backward(self) -> bool:
        """The schedule splits each backward into an input-gradient and a weight-gradient action: fsdp replicas
        keep their units gathered for the whole step (a unit resharded in between loses weight gradients), and
        ddp replicas average their gradients after the schedule (DDP's hooks see no weight gradient)."""
        return self.schedule in SPLIT_BACKWARD

    def coords(self, rank: int) -> tuple[int, int]:
        """(pp_rank, dp_rank) of a global rank: the stage it runs and the replica it is part of."""
        return divmod(rank // self.tp, self.dp)

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    def rank(self, pp_rank: int, dp_rank: int, tp_rank: int = 0) -> int:
        return (pp_rank * self.dp + dp_rank) * self.tp + tp_rank

    def stage_ids(self, pp_rank: int, stages_per_rank: int) -> list[int]:
        """The stages a pipeline rank runs: its own and, looped, every pp-th after it; V-shaped, its mirror."""
        return stage_ids(self.schedule, pp_rank=pp_rank, pp=self.pp, stages_per_rank=stages_per_rank)

    def stages_by_rank(self, block_parts: list[int], stages_per_rank: int, rows: list[Rows | None] | None = None
                       ) -> str:
        """Which blocks each rank runs, for the layout line: 'rank 0: stage 0: blocks 0-1; rank 1: stage 1: ...'
        (with replicas, 'ranks 0-1: ...': a pipeline rank's dp replicas are consecutive ranks), and under
        split_head each stage's rows of the head ('+ head rows 0-9999')."""
        out = []
        rows = rows or []

        def head(stage: int) -> str:
            held = rows[stage] if stage < len(rows) else None
            return f" + head rows {held[0]}-{held[1] - 1}" if held is not None else ""
        for pp_rank in range(self.pp):
            first, last = self.rank(pp_rank, 0), self.rank(pp_rank, self.dp - 1, self.tp - 1)
            ranks = f"rank {first}" if first == last else f"ranks {first}-{last}"
            stages = "; ".join(f"stage {s}: blocks {blocks_of(block_parts, s)}{head(s)}"
                               for s in self.stage_ids(pp_rank, stages_per_rank))
            out.append(f"{ranks}: {stages}")
        return "; ".join(out)


def check_levers(recipe: Recipe, grid: Grid) -> None:
    """A compression needs ddp replicas whose gradients DDP reduces (its hooks): not FSDP's shards, not the by-hand
    average of a split backward, not a grid without replicas. Local SGD needs whole replicas (ddp) to average."""
    compression = compression_of(recipe)
    compression.check(precision=recipe.precision)
    local = local_sgd_of(recipe)
    local.check(compression=compression.kind, precision=recipe.precision)
    compressing = (f"strategy.gradient_compression={compression.kind} compresses the gradient all-reduce of a "
                   "stage's ddp replicas")
    levers = {f"strategy.sync_every={local.every} averages the parameters of a stage's ddp replicas": local.on,
              compressing: compression.on}
    for what in (what for what, on in levers.items() if on):
        if grid.sharded:
            raise RecipeError(f"{what}; strategy.data_parallel fsdp shards them instead: set "
                              "strategy.data_parallel=ddp")
        if grid.dp < 2:
            raise RecipeError(f"{what}, and {grid.pp} stages on {grid.pp * grid.dp} ranks leave no replicas; use "
                              f"{ranks_option(2 * grid.pp)} or more")
    if compression.on and grid.split_backward and compression.kind not in WIRE_DTYPES:
        raise RecipeError(f"{compressing} through DDP's communication hook, which strategy.schedule {grid.schedule} "
                          "bypasses (its weight gradients are averaged after the schedule, cast to fp16 or bf16 "
                          "at most); use schedule 1f1b, gpipe or interleaved-1f1b, or gradient_compression fp16 or "
                          "bf16")


def grid_of(recipe: Recipe, world_size: int) -> Grid:
    """The rank grid of a pipeline, from the options of the preset that runs it (the only place that reads them):
    strategy.pipeline_degree stages (unset: every rank, or every group of strategy.tp_degree ranks, is one) ×
    replicas by strategy.data_parallel, each stage tensor-parallel over strategy.tp_degree ranks."""
    degree = recipe.strategy.pipeline_degree  # unset: every rank is a stage (strategy pipeline)
    if degree is not None and degree < 2:  # 0 once meant "every rank" without a word
        raise RecipeError(f"strategy.pipeline_degree must be >= 2 (pipeline stages), got {degree}; leave it unset "
                          "for a model split over strategy.devices inside each process")
    tp = 1 if recipe.strategy.tp_degree is None else recipe.strategy.tp_degree
    if tp < 1:
        raise RecipeError(f"strategy.tp_degree must be >= 1, got {tp}; leave it unset for stages without tensor "
                          "parallel")
    if world_size % tp:
        raise RecipeError(f"strategy.tp_degree {tp} does not divide the {world_size} ranks; use a degree that "
                          "divides them")
    pp = world_size // tp if degree is None else degree
    if pp < 2:
        raise RecipeError(f"a pipeline needs at least 2 ranks, one per stage, but the world size is {world_size}"
                          f"{f' with tp_degree {tp}' if tp > 1 else ''}; use {ranks_option(2 * tp)} or more")
    if world_size % (pp * tp):
        raise RecipeError(f"world size {world_size} is not divisible by strategy.pipeline_degree {pp}"
                          f"{f' × tp_degree {tp}' if tp > 1 else ''}; use a multiple of it")
    for key in ("sequence_parallel", "loss_parallel"):
        if getattr(recipe.strategy, key) and tp == 1:
            raise RecipeError(f"strategy.{key} needs tensor-parallel stages: set strategy.tp_degree (2 or more)")
    return Grid(pp=pp, dp=world_size // (pp * tp), sharded=recipe.strategy.data_parallel == "fsdp",
                schedule=recipe.strategy.schedule, tp=tp, sequence_parallel=recipe.strategy.sequence_parallel,
                loss_parallel=recipe.strategy.loss_parallel)


def stage_of_blocks(model: nn.Module, recipe: Recipe, grid: Grid) -> tuple[list[int], int]:
    """The stage of every block (strategy.split, or balanced by FLOPs: pipeline/split.py; under split_head the
    stages after the last block's hold none), and the number of stages."""
    options = recipe.strategy
    num_stages = grid.pp * options.stages_per_rank
    if options.split_head:
        return _head_split(model, recipe, num_stages)[0], num_stages
    blocks = layer_stack(model, options.blocks)
    split = options.split
    if split is None:
        costs, head = split_costs(model, recipe, tp=grid.tp, loss_parallel=grid.loss_parallel)
        split = tuple(cost_balanced_starts(costs, last_extra=head, num_parts=num_stages))
    return part_of_blocks(model, blocks=blocks, num_parts=num_stages, split=split), num_stages


def head_rows_of(model: nn.Module, recipe: Recipe, grid: Grid) -> list[Rows | None]:
    """Each stage's rows of the head's vocabulary under strategy.split_head (None: none of them; all None
    without it, the last stage computing the whole head)."""
    num_stages = grid.pp * recipe.strategy.stages_per_rank
    return _head_split(model, recipe, num_stages)[1] if recipe.strategy.split_head else [None] * num_stages


def shared_weight_stages(rows: list[Rows | None], *, tied: bool) -> list[int]:
    """The stages holding a copy of a weight shared between stages: a tied embedding's first and last stage (under
    split_head the first and each stage with rows of the head), or under split_head an untied head's stages with
    rows of it; none for an untied model without split_head."""
    with_rows = [s for s, r in enumerate(rows) if r is not None]
    if tied:
        return sorted({0, *(with_rows or [len(rows) - 1])})
    return with_rows


def split_costs(model: nn.Module, recipe: Recipe, *, tp: int, loss_parallel: bool) -> tuple[list[float], float]:
    """What the split balances, per token: each block's forward + backward FLOPs and the head's (block_costs),
    under strategy.split_by time the blocks' weighted by strategy.block_time_ratio (their seconds per FLOP over
    the head's: pipeline/timing.py measures it at setup where the recipe sets none)."""
    costs, head = block_costs(model, layer_stack(model, recipe.strategy.blocks), recipe, tp=tp,
                              loss_parallel=loss_parallel)
    ratio = recipe.strategy.block_time_ratio if recipe.strategy.split_by == "time" else None
    return ([cost * ratio for cost in costs] if ratio else costs), head


def split_how(recipe: Recipe) -> str:
    """How the stages were cut, for the layout lines of a run and of toolkit plan."""
    options = recipe.strategy
    if options.split is not None and not options.split_head:
        return "strategy.split"
    if options.split_by != "time":
        return "split by FLOPs"
    if options.block_time_ratio is None:
        return "split by FLOPs here; split_by time measures a block's time per FLOP at setup and may move it"
    return f"split by time: a block's FLOPs weighted {options.block_time_ratio:g}x the head's"


def _head_split(model: nn.Module, recipe: Recipe, num_stages: int) -> tuple[list[int], list[Rows | None]]:
    costs, head = split_costs(model, recipe, tp=1, loss_parallel=False)
    vocab = cast(nn.Linear, model.get_submodule(head_path(model, layout_of(model, recipe.strategy.blocks))))
    return head_split(costs, head=head, num_parts=num_stages, vocab=vocab.out_features)


def rank_stages(model: nn.Module, recipe: Recipe, grid: Grid, pp_rank: int) -> list[Stage]:
    """The stages pipeline rank `pp_rank` runs, each cut from its own copy of `model` (the meta model: a plan's)."""
    import copy

    parts, num_stages = stage_of_blocks(model, recipe, grid)
    rows = head_rows_of(model, recipe, grid)
    return [Stage(copy.deepcopy(model), layer_ids=[i for i, p in enumerate(parts) if p == s], first=s == 0,
                  last=s == num_stages - 1, blocks=recipe.strategy.blocks, head_rows=rows[s])
            for s in grid.stage_ids(pp_rank, recipe.strategy.stages_per_rank)]


def count_busy_time(stage: PipelineStage, owner: Any) -> None:
    """Add the time a stage computes (its forward and backward chunks, a split backward's weight part too) to `owner.busy_s`: the rest of a step is
    waiting, the measured bubble."""
    for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
        inner = getattr(stage, name)

        def timed(*args, _inner=inner, **kwargs):
            start = time.perf_counter()
            try:
                return _inner(*args, **kwargs)
            finally:
                owner.busy_s += time.perf_counter() - start

        setattr(stage, name, timed)


@contextlib.contextmanager
def count_p2p_time(owner: Any) -> Iterator[None]:
    """Within it, add the time the schedule's sends and receives take to post (torch's schedules._batch_p2p, each
    schedule's one way to start them) to `owner.p2p_s`: on gloo the calling thread copies into the sockets there,
    communication the rank does, not a wait for another stage (the time it waits on them stays idle)."""
    from torch.distributed.pipelining import schedules

    inner = schedules._batch_p2p

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            owner.p2p_s += time.perf_counter() - start

    schedules._batch_p2p = timed
    try:
        yield
    finally:
        schedules._batch_p2p = inner


# torch's stage metadata inference (torch 2.13): at a stage's first step, its module runs once forward and once
# backward (recomputing a checkpointed block) on empty tensors of the micro-batch's shapes, to size the buffers
SHAPE_INFERENCE = ("_forward_metadata_inference", "_backward_metadata_inference")


def uncount_shape_inference(stage: PipelineStage) -> None:
    """A stage's shape inference left out of the blocks' forward count (run.json's activation_checkpointing): it
    is not training's, and it added one forward and one recomputation per stage to the first step's count."""
    for name in SHAPE_INFERENCE:
        if hasattr(stage, name):
            setattr(stage, name, uncounted(getattr(stage, name)))
    submod = stage.submod
    if isinstance(submod, DistributedDataParallel) and hasattr(stage, SHAPE_INFERENCE[0]):
        inference = getattr(stage, SHAPE_INFERENCE[0])

        def outside_ddp(*args, **kwargs):
            with submod.no_sync():
                return inference(*args, **kwargs)

        setattr(stage, SHAPE_INFERENCE[0], outside_ddp)


def check_tensor_parallel(recipe: Recipe, grid: Grid) -> None:
    """Stages split over tp ranks: the model's plan, and the degree dividing what it splits (tp_plan.check_recipe);
    tested with the schedules that run a backward whole, and with replicas that FSDP2 shards (DDP takes no DTensor
    weights: torch 2.13 refuses them, and its own DDP × TP workaround swaps the parameters at every forward)."""
    from toolkit.model import tp_plan

    if grid.dp > 1 and not grid.sharded:
        raise RecipeError(f"tensor-parallel stages with {grid.dp} ddp replicas each: DDP cannot hold tensor-parallel "
                          "(DTensor) weights; shard the replicas with FSDP instead (parallel.dp_shard, or "
                          "strategy.data_parallel=fsdp)")
    if grid.split_backward:
        raise RecipeError(f"strategy.schedule {grid.schedule} with tensor-parallel stages is not tested yet; use "
                          "schedule 1f1b, gpipe or interleaved-1f1b")
    tp_plan.check_recipe(recipe, degree=grid.tp)


def check_stage_blocks(skeleton: nn.Module, names: tuple[str, ...] | None) -> None:
    """strategy.blocks under a pipeline may only name the blocks of the model's layer stack: a stage holds a run
    of them (stages.Stage cuts its block list), so other modules (LlamaRMSNorm, LlamaMLP) were counted as blocks by
    the split check and then cut nothing, or cut past the stack's end (an IndexError in every rank)."""
    if names is None:
        return
    try:
        stack = layer_stack(skeleton)
    except RecipeError:  # the model names no blocks of its own: the recipe's are the only ones (layout_of)
        return
    named = layer_stack(skeleton, names)
    if [id(b) for b in named] != [id(b) for b in stack]:
        kind = type(stack[0]).__name__
        raise RecipeError(f"strategy.blocks {list(names)}: a pipeline cuts {type(skeleton).__name__} between the "
                          f"{len(stack)} blocks of its layer stack ({kind}), which these do not name; leave "
                          f"strategy.blocks out or set it to [{kind}]")


def check_split_head(recipe: Recipe, grid: Grid, skeleton: nn.Module) -> None:
    """strategy.split_head: a causal LM's linear head, the blocks placed by the split itself, and the layouts its
    tests cover (equal to single: tests/test_model_parallel.py)."""
    options = recipe.strategy
    refused = {"strategy.split places the blocks by hand, where split_head places them with the head's rows; "
               "remove one": options.split is not None,
               f"model.task {recipe.model.task} has no vocabulary head; set model.task=causal-lm or "
               "strategy.split_head=false": recipe.model.task != "causal-lm",
               "tensor-parallel stages split the head over the vocabulary themselves (strategy.loss_parallel); "
               "remove strategy.tp_degree or split_head": grid.tp > 1,
               "precision fp16 is not tested with it yet; use bf16 or fp32": recipe.precision == "fp16",
               "local SGD (strategy.sync_every) averages two copies of a tied weight, not the head's copies on "
               "several stages; remove one": local_sgd_of(recipe).on}
    for why, wrong in refused.items():
        if wrong:
            raise RecipeError(f"strategy.split_head: {why}")
    head_path(skeleton, layout_of(skeleton, options.blocks))
    num_stages = grid.pp * options.stages_per_rank
    blocks = len(layer_stack(skeleton, options.blocks))
    if num_stages > blocks + cast(Any, skeleton).config.vocab_size - 1:
        raise RecipeError(f"strategy.split_head: {num_stages} stages for {blocks} blocks; use fewer stages")


def check_split_by(recipe: Recipe, grid: Grid) -> None:
    """strategy.split_by and block_time_ratio: a known measure, a positive ratio for a split by time, a split the
    measure decides, a block it can time alone."""
    options = recipe.strategy
    if options.split_by not in ("flops", "time"):
        raise RecipeError(f"strategy.split_by: unknown value {options.split_by!r}; choose flops or time")
    ratio = options.block_time_ratio
    if ratio is not None and options.split_by != "time":
        raise RecipeError("strategy.block_time_ratio weights the blocks of a split by time: set "
                          "strategy.split_by=time, or remove it")
    if ratio is not None and not (ratio > 0 and math.isfinite(ratio)):
        raise RecipeError(f"strategy.block_time_ratio must be a number > 0 (a block's seconds per FLOP over the "
                          f"head's), got {ratio}; remove it to measure it")
    if options.split_by == "time" and ratio is None and recipe.model.task != "causal-lm":
        raise RecipeError(f"strategy.split_by=time times a block against rows of a causal LM's output layer, and "
                          f"model.task is {recipe.model.task}; use split_by flops, or pin strategy.block_time_ratio")
    if options.split_by == "time" and options.split is not None and not options.split_head:
        raise RecipeError("strategy.split places the blocks by hand, where split_by time places them; remove one")
    if options.split_by == "time" and ratio is None and grid.tp > 1:
        raise RecipeError("strategy.split_by=time times a block on one rank, not split over strategy.tp_degree "
                          "ranks; pin strategy.block_time_ratio (a run's layout line gives one) or use split_by "
                          "flops")


def check_recipe(recipe: Recipe, *, world_size: int) -> None:
    """The pipeline's recipe errors, one RecipeError each, before training starts."""
    options = recipe.strategy
    if options.schedule not in SCHEDULES:
        raise RecipeError(f"strategy.schedule: unknown value {options.schedule!r}; choose one of "
                          f"{', '.join(SCHEDULES)}")
    if options.stages_per_rank < 1:
        raise RecipeError(f"strategy.stages_per_rank must be >= 1, got {options.stages_per_rank}; 2 or more "
                          f"with strategy.schedule {' or '.join(LOOPED)}, exactly 2 with {' or '.join(V_SHAPED)}")
    if options.devices is not None:  # hybrid: each rank runs its stages on its own device (toolkit.process.dist)
        raise RecipeError("strategy.devices applies to hybrid without strategy.pipeline_degree (a model split "
                          "inside each process); a pipeline stage runs on its rank's device: remove it")
    wrong = stages_per_rank_error(options.schedule, options.stages_per_rank)
    if wrong:
        raise RecipeError(wrong)
    if options.schedule in SPLIT_BACKWARD and recipe.train.recompute == "selective":
        raise RecipeError(f"train.activation_checkpointing: selective cannot run with strategy.schedule "
                          f"{options.schedule}, which runs each backward in two parts (input gradients, then weight "
                          "gradients) where torch's selective checkpointing allows one backward per block; set it to "
                          "true (full checkpointing runs with it) or use schedule 1f1b or interleaved-1f1b")
    if options.data_parallel not in ("ddp", "fsdp"):
        raise RecipeError(f"strategy.data_parallel: unknown value {options.data_parallel!r}; choose ddp or fsdp")
    grid = grid_of(recipe, world_size)
    check_split_by(recipe, grid)
    check_levers(recipe, grid)
    if grid.tp > 1:
        check_tensor_parallel(recipe, grid)
    stages = grid.pp * options.stages_per_rank
    skeleton = meta_model(recipe.model)
    check_stage_blocks(skeleton, options.blocks)
    layout_of(skeleton, options.blocks)  # a model its own modules and forward do not show how to cut
    if options.split_head:
        check_split_head(recipe, grid, skeleton)
    else:
        check_split(options.split, num_blocks=len(layer_stack(skeleton, options.blocks)), num_parts=stages,
                    what="stages")
    plan = plan_batch(recipe.batch, world_size=grid.dp)
    wrong = micro_batches_error(options.schedule, pp=grid.pp, micro_batches=plan.grad_accum_steps)
    if wrong:
        raise RecipeError(f"{wrong}, but batch.grad_accum_steps is {plan.grad_accum_steps}; change it or use gpipe")
    if recipe.precision == "fp16" and recipe.optim.implementation == "fused":
        raise RecipeError("optim.implementation fused cannot run a pipeline in fp16 (torch's ShardedGradScaler "
                          "hands the fused AdamW kernel a found-inf tensor of the wrong shape); use auto or loop")
