"""A pipeline rank's memory, before a run (`toolkit plan`, run.json's prediction): its stages' model states
(state_bytes_per_rank) and activations (activation_bytes_per_rank).

A stage keeps what one micro-batch's forward leaves for backward (its saved activations and its output)
for every micro-batch it has in flight; how many that is comes from the schedule:
  gpipe             every micro-batch of the step: all forwards run before the first backward
  1f1b              stage s of S: min(M, S - s) (torch's Schedule1F1B warms up with that many forwards, then
                    alternates one backward, one forward)
  interleaved-1f1b, interleaved-zb, zbv, dualpipev
                    the order torch's class computes for the rank, over its stages (a split backward's
                    weight gradient frees the micro-batch)
On top, torch's PipelineStage allocates receive buffers for every micro-batch of the step at its first step
and keeps them: the activations a stage receives (all but the first stage) and the gradients of its
output (all but the last), micro × padded length × hidden each, for each padded length whose stages the rank
keeps (batches.KEPT_SHAPES: planned at the longest, max_length and 8 below; packed data has max_length alone).
"""

from __future__ import annotations

import sys
from collections import defaultdict
from typing import Any, cast

from torch import nn

from toolkit.config.recipe import Recipe, plan_batch
from toolkit.memory.activations import Traced, traced_stage
from toolkit.memory.state_bytes import (StateBytes, adam_state, dim0_held, dim0_shard, dim0_shard_of, element_bytes,
                                        of_shapes, whole)
from toolkit.model import tp_plan
from toolkit.model.stages import plain_lookup, tied_embedding_names
from toolkit.model.precision import DTYPES
from toolkit.strategies.dims.compression import powersgd_state_bytes
from toolkit.strategies.dims.levers import compression_of, local_sgd_of
from toolkit.strategies.dims.local_sgd import outer_state
from toolkit.strategies.pipeline.batches import longest_kept
from toolkit.strategies.pipeline.layout import Grid, grid_of, head_rows_of, rank_stages, stage_of_blocks

Action = tuple[str, int]  # ("F" forward | "B" backward, stage index)


def state_bytes_per_rank(model: nn.Module, recipe: Recipe, *, world_size: int) -> list[StateBytes]:
    """Each rank's stages cut from the meta model as setup cuts them (a tied embedding is held by the
    first and the last stage, once each), whole under ddp, dim-0 shards under fsdp (of a tp rank's slices, with
    tensor-parallel stages)."""
    grid, dtype = grid_of(recipe, world_size), DTYPES[recipe.model.load_dtype]
    sharded = grid.sharded and grid.dp > 1
    # a stage's ddp replicas under PowerSGD: each stage's DDP module keeps its own error and factors
    compression = compression_of(recipe) if grid.dp > 1 and not grid.sharded else None
    # fsdp: a replica's AdamW moments are made like its unpadded shard (dim0_held), so where a dim 0 does not divide
    # the replicas, the last ones hold less than their padded parameters and gradients
    per_coords: dict[tuple[int, int], StateBytes] = {}
    for pp_rank in range(grid.pp):
        # tensor-parallel stages: a tp rank's slices of the split layers, the rest whole (tp_plan); fsdp shards
        # those over the replicas
        stages = [(stage, tp_plan.local_shapes(stage, grid.tp, loss_parallel=grid.loss_parallel)
                   if grid.tp > 1 else None)
                  for stage in rank_stages(model, recipe, grid, pp_rank)]
        for dp_rank in range(grid.dp if sharded else 1):
            total = StateBytes(params_bytes=0, grads_bytes=0, optim_bytes=0)
            for stage, shapes in stages:
                if sharded:
                    held = dim0_shard_of(shapes, grid.dp) if shapes is not None else dim0_shard(grid.dp)
                    moments = dim0_held(grid.dp, dp_rank, shapes)
                else:
                    held, moments = (of_shapes(shapes) if shapes is not None else whole), None
                total += adam_state(stage.named_parameters(), dtype=dtype, local=held, moments=moments)
                if compression is not None:
                    kept = powersgd_state_bytes(stage.parameters(), compression, dtype=dtype,
                                                steps=recipe.train.max_steps)
                    total += StateBytes(params_bytes=0, grads_bytes=0, optim_bytes=kept)
            per_coords[pp_rank, dp_rank] = total
    per_rank = []
    for rank in range(world_size):
        pp_rank, dp_rank = grid.coords(rank)
        per_rank.append(per_coords[pp_rank, dp_rank if sharded else 0])
    # a stage's ddp replicas under DiLoCo: the outer step's anchor and momentum of its stages
    return outer_state(per_rank, local_sgd_of(recipe))


def activation_bytes_per_rank(model: nn.Module, recipe: Recipe, *, world_size: int, how: dict[str, Any]) -> list[int]:
    """Each rank's stages (cut as setup cuts them) with the micro-batches its schedule keeps in flight, and
    the receive buffers of every micro-batch."""
    options, grid = recipe.strategy, grid_of(recipe, world_size)
    how = _stage_how(recipe, grid, how)
    parts, num_stages = stage_of_blocks(model, recipe, grid)
    micro_batches = plan_batch(recipe.batch, world_size=grid.dp).grad_accum_steps
    hidden = cast(Any, model).config.hidden_size
    # the stages of the KEPT_SHAPES longest padded lengths (batches.longest_kept), each with its own buffers: of
    # a tp rank's share of the sequence under sequence parallelism (stages send and receive shares)
    shares = grid.tp if grid.sequence_parallel else 1
    kept = sum(-(-length // shares) for length in longest_kept(recipe.data.max_length, packing=recipe.data.packing))
    buffer = recipe.batch.micro_batch_size * kept * hidden * element_bytes(how["params_dtype"])
    rows = head_rows_of(model, recipe, grid)
    # split_head: a stage after the first with rows of the head receives each token's two fp32 row stats beside
    # the final norm's output, and one before the last sends them (their gradients come back)
    stats = 2 * recipe.batch.micro_batch_size * kept * 4
    # split_head: a stage with rows keeps a gradient buffer of the whole head from its first backward to the step's
    # end (stages._Rows, and the tied first stage's stages._TiedLookup), but a tied first stage whose embedding's
    # own forward runs (stages._TiedRows)
    tied = tied_embedding_names(model) is not None and not plain_lookup(cast(Any, model).get_input_embeddings())
    head = cast(Any, model).get_output_embeddings() if any(rows) else None
    head_buffer = head.weight.numel() * element_bytes(how["params_dtype"]) if head is not None else 0

    def uses_row_buffer(stage: int) -> bool:
        return rows[stage] is not None and not (stage == 0 and tied)
    per_pp_rank = []
    for pp_rank in range(grid.pp):
        stage_ids = grid.stage_ids(pp_rank, options.stages_per_rank)
        traces = _rank_traces(model, recipe, grid, pp_rank, how, parts=parts, rows=rows)
        buffers = sum(micro_batches * buffer * ((s != 0) + (s != num_stages - 1)) for s in stage_ids)
        buffers += sum(micro_batches * stats * ((s > 0 and rows[s - 1] is not None) + (s < num_stages - 1))
                       for s in stage_ids if rows[s] is not None)
        actions = schedule_actions(options.schedule, rank=pp_rank, pp=grid.pp,
                                   stages_per_rank=options.stages_per_rank, micro_batches=micro_batches)
        per_pp_rank.append(buffers + in_flight_peak(actions, traces, kept={s: head_buffer for s in stage_ids
                                                                           if uses_row_buffer(s)}))
    return [per_pp_rank[grid.coords(rank)[0]] for rank in range(world_size)]


def stage_traces(model: nn.Module, recipe: Recipe, *, world_size: int, pp_rank: int,
                 how: dict[str, Any]) -> dict[int, Traced]:
    """One micro-batch through each stage pipeline rank `pp_rank` holds, traced as its run computes it (its blocks,
    the embeddings or the head where it holds them, its tp share): keyed by stage index."""
    grid = grid_of(recipe, world_size)
    return _rank_traces(model, recipe, grid, pp_rank, _stage_how(recipe, grid, how),
                        parts=stage_of_blocks(model, recipe, grid)[0], rows=head_rows_of(model, recipe, grid))


def _stage_how(recipe: Recipe, grid: Grid, how: dict[str, Any]) -> dict[str, Any]:
    if grid.sharded and recipe.precision != "fp32":  # the replicas' MixedPrecisionPolicy
        return {**how, "params_dtype": DTYPES[recipe.precision]}
    return how


def _rank_traces(model: nn.Module, recipe: Recipe, grid: Grid, pp_rank: int, how: dict[str, Any], *,
                 parts: list[int], rows: list[tuple[int, int] | None]) -> dict[int, Traced]:
    """`parts`: each block's stage (stage_of_blocks), `rows`: each stage's rows of the head (head_rows_of)."""
    num_stages = len(rows)
    return {s: traced_stage(model, recipe, blocks=parts.count(s), first=s == 0, last=s == num_stages - 1,
                            tp_degree=grid.tp, sequence_parallel=grid.sequence_parallel,
                            loss_parallel=grid.loss_parallel, head_rows=rows[s], **how)
            for s in grid.stage_ids(pp_rank, recipe.strategy.stages_per_rank)}


def schedule_actions(schedule: str, *, rank: int, pp: int, stages_per_rank: int, micro_batches: int) -> list[Action]:
    """This rank's forwards and backwards, in the order its schedule runs them (one micro-batch each). A split
    backward frees a micro-batch's activations at its weight gradient, the last to read them."""
    from toolkit.strategies.pipeline.schedules import actions

    try:
        order = actions(schedule, rank=rank, pp=pp, stages_per_rank=stages_per_rank, micro_batches=micro_batches)
    except (AttributeError, TypeError, ValueError):
        print(f"[toolkit] plan: this torch does not give {schedule}'s order; the rank is planned with every "
              "micro-batch in flight (an upper bound)", file=sys.stderr, flush=True)
        local = Grid(pp=pp, dp=1, schedule=schedule).stage_ids(rank, stages_per_rank)
        return [("F", s) for s in local] * micro_batches + [("B", s) for s in reversed(local)] * micro_batches
    return [("F" if a.kind == "F" else "B", a.stage) for a in order if a.kind in ("F", "B", "W")]


def in_flight_peak(actions: list[Action], traces: dict[int, Traced], kept: dict[int, int] | None = None) -> int:
    """The most bytes the rank's stages hold at once running `actions`: at a backward, every micro-batch in
    flight holds its forward's bytes, and the one going backward has reached its own peak. `kept`: bytes a stage
    makes at its first backward and keeps to the step's end (in its traced peak once)."""
    in_flight: dict[int, int] = defaultdict(int)
    kept = kept or {}
    backed: set[int] = set()
    peak = 0
    for kind, stage in actions:
        held = sum(count * traces[s].held for s, count in in_flight.items()) + sum(kept.get(s, 0) for s in backed)
        if kind == "F":
            in_flight[stage] += 1
            peak = max(peak, held + traces[stage].held)
        else:
            again = kept.get(stage, 0) if stage in backed else 0
            peak = max(peak, held - traces[stage].held + traces[stage].peak - again)
            in_flight[stage] -= 1
            backed.add(stage)
    return peak

