"""What a pipeline rank hands to collectives in one optimizer step (torch.distributed.pipelining), read from the
collective counter on CPU and held to it byte for byte (tests/test_comm_prediction.py):
- each stage sends its output to the next stage's rank every micro-batch (all but the last stage), and the
  gradient of its input back (all but the first), where that stage is on another rank: micro × the step's padded length × hidden each
  (batches.padded_length: the longest sample rounded up to 8; under sequence parallelism a tp rank's share of it,
  ceil(length / tp)), in the dtype the residual stream has there;
- a tied embedding's two copies (first and last stage) sum their gradients, once a step (strategy._sync_tied),
  over the two ranks holding them (V-shaped schedules hold both on one rank and add them there);
- the clip's sum of squares over the stages, one fp32 number (strategy._sync_and_clip); in fp16 the scaler's
  found-inf over every rank (dims/comm.fp16_scaler_collectives);
- tensor-parallel stages: each stage's split layers' activations over its tp ranks, as tp's (dims/comm.tp_collectives,
  the stage's blocks only), and the clip's sum over every rank;
- with replicas, the step's padded length: one int64, its maximum over the replicas (strategy._run);
- the stages' data-parallel replicas: DDP's all-reduce of each stage's gradients in its buckets (a stage is a DDP
  module of its own, bucketed as plain ddp's), or what strategy.gradient_compression's hook sends instead of the
  gradients (dims/compression.compression_collectives, per stage); a zero-bubble schedule: one all-reduce of
  each stage's gradients after the schedule, by hand; under local SGD none, and at a sync this rank's parameters
  averaged in one all-reduce; or FSDP2 over the replicas, each unit gathered before
  every micro-batch's forward and once more for the step's backwards (the stage keeps it gathered between them:
  torch's schedule does not reshard after a backward but the last), reduce-scattered once a step; under a
  zero-bubble schedule gathered once a step, at its first forward (it is not resharded after a forward); with
  tensor-parallel stages, FSDP2 gathers and reduce-scatters a tp rank's slices of the split layers.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, cast

import torch
from torch import nn

from toolkit.config.recipe import Recipe
from toolkit.cost.collectives import Collective
from toolkit.memory.state_bytes import dim0_rows, element_bytes
from toolkit.model import tp_plan
from toolkit.model.precision import DTYPES
from toolkit.model.stages import Stage
from toolkit.model.tied import tied_aliases
from toolkit.strategies.dims.comm import (PARTIAL_GRADIENTS, fp16_scaler_collectives, fsdp_collectives, fsdp_units,
                                          sequence_parallel_norms, sequence_parallel_params, tp_collectives)
from toolkit.strategies.dims.compression import WIRE_DTYPES, compression_collectives
from toolkit.strategies.dims.parallelize import DdpWrap
from toolkit.strategies.pipeline.batches import padded_length
from toolkit.strategies.dims.levers import compression_of, local_sgd_of
from toolkit.strategies.dims.local_sgd import local_sgd_collectives
from toolkit.strategies.pipeline.layout import grid_of, head_rows_of, rank_stages, shared_weight_stages


def predict(model: nn.Module, recipe: Recipe, *, world_size: int, rank: int,
            shapes: list[tuple[int, int]]) -> list[Collective]:
    grid = grid_of(recipe, world_size)
    stages = rank_stages(model, recipe, grid, grid.coords(rank)[0])
    stored = DTYPES[recipe.model.load_dtype]
    # FSDP's replicas compute in the 16-bit precision (MixedPrecisionPolicy); autocast keeps an fp32 residual
    flowing = DTYPES[recipe.precision] if grid.sharded else stored
    micro = len(shapes)
    length = padded_length([n for _, n in shapes], max_length=recipe.data.max_length)
    # under sequence parallelism a tp rank sends its share of the sequence (rank 0's: the largest, where tp does
    # not divide the length)
    sent = -(-length // grid.tp) if grid.sequence_parallel else length
    one = recipe.batch.micro_batch_size * sent * cast(Any, model).config.hidden_size * element_bytes(flowing)
    pp_rank = grid.coords(rank)[0]
    owner = {s: r for r in range(grid.pp) for s in grid.stage_ids(r, recipe.strategy.stages_per_rank)}
    mine = grid.stage_ids(pp_rank, recipe.strategy.stages_per_rank)
    # to the next stage and back to the previous one, where that stage is on another rank (V-shaped schedules
    # keep the middle boundary on one rank: handed over in memory)
    # split_head: a stage with rows of the head sends each token's two fp32 row stats beside its output (3
    # tensors), and one that received them sends their gradients back
    rows = head_rows_of(model, recipe, grid)
    stats = 2 * recipe.batch.micro_batch_size * sent * 4
    sends = [(not stage.last and owner[s + 1] != pp_rank, rows[s] is not None) for s, stage in zip(mine, stages)]
    sends += [(not stage.first and owner[s - 1] != pp_rank, rows[s - 1] is not None)
              for s, stage in zip(mine, stages)]
    count = sum(3 if with_stats else 1 for crossing, with_stats in sends if crossing)
    sent_bytes = sum(one + (stats if with_stats else 0) for crossing, with_stats in sends if crossing)
    out = [Collective(op="send", payload_bytes=sent_bytes * micro, calls=count * micro, group="pp",
                      group_size=grid.pp, phase="forward", what="activations and their gradients")]
    tied = any(name != first for name, first in tied_aliases(model).items())
    local = local_sgd_of(recipe)
    synced = grid.dp > 1 and local.on  # counted at a local SGD sync (strategy._local_step), one step in local.every
    # the ranks holding a copy of a weight shared between stages: a tied embedding's first and last stage (under
    # split_head: the first and those with rows of the head), an untied head's stages with rows of it; a rank
    # adds its own copies up, then all-reduces them once
    holders = shared_weight_stages(rows, tied=tied)
    holding = sorted({owner[s] for s in holders})
    copies = [stage for s, stage in zip(mine, stages) if s in holders][:1] if len(holding) > 1 else []
    for stage in copies:
        weight = stage.tied_weight()
        assert weight is not None
        # loss_parallel: a tp rank's rows of the vocabulary; fsdp: its replica's dim-0 shard of them, unpadded
        # (the sync sends the local shard: where the replicas do not divide the rows, the last hold fewer)
        vocab = weight.shape[0] // grid.tp if grid.loss_parallel else weight.shape[0]
        held = dim0_rows(vocab, grid.dp, grid.coords(rank)[1]) if grid.sharded and grid.dp > 1 else vocab
        numel = held * weight.shape[1]
        out.append(Collective(op="allreduce_", payload_bytes=numel * element_bytes(stored), calls=1, group="pp",
                              group_size=len(holding), phase="step",
                              what="the tied embedding's gradient" if tied else "the head's gradient, its copies'"))
        if synced:  # its two copies evened after the sync
            out.append(Collective(op="allreduce_", payload_bytes=numel * element_bytes(stored), calls=1,
                                  group="pp", group_size=2, phase="step",
                                  what="the tied embedding's copies evened after the sync", every=local.every))
    if recipe.precision == "fp16":  # its ShardedGradScaler over every rank (strategy.py)
        out += fp16_scaler_collectives(world_size=world_size, dtensors=grid.sharded and grid.dp > 1)
    if grid.tp > 1:  # each stage's split layers: their activations (and the partial gradients) over its tp ranks,
        padded = [(recipe.batch.micro_batch_size, length)] * micro  # every micro-batch padded, as sent (above)
        split = [c for stage in stages for c in tp_collectives(
            stage, tp=grid.tp, shapes=padded, activation_dtype=DTYPES[recipe.precision],
            sequence_parallel=grid.sequence_parallel, loss_parallel=grid.loss_parallel,
            recompute=recipe.train.recompute != "none", stream_dtype=flowing,
            shard=grid.dp if grid.sharded else 1, shard_index=grid.coords(rank)[1] if grid.sharded else 0)]
        # the partial gradients of all the rank's stages are summed in one call (strategy.forward_backward), with
        # the sequence-parallel norms' where no FSDP shards the replicas (FSDP all-reduces each of those itself)
        partial = [c for c in split if c.what == PARTIAL_GRADIENTS]
        out += [c for c in split if c.what != PARTIAL_GRADIENTS]
        norms = sum(p.numel() for stage in stages for p in sequence_parallel_params(stage)) \
            if grid.sequence_parallel else 0
        if grid.sequence_parallel and grid.sharded:
            reduce = stored if recipe.precision == "fp32" else torch.float32
            out += [c for stage in stages for c in sequence_parallel_norms(stage, tp=grid.tp, reduce_dtype=reduce)]
        elif norms:
            partial.append(Collective(op="allreduce_", payload_bytes=norms * 4, calls=1, group="tp",
                                      group_size=grid.tp, phase="step", what=PARTIAL_GRADIENTS))
        if partial:
            out.append(dataclasses.replace(partial[0], payload_bytes=sum(c.payload_bytes for c in partial)))
    if recipe.optim.max_grad_norm is not None:
        everyone = grid.sharded or grid.tp > 1  # the split weights' squares too (tested without replicas)
        out.append(Collective(op="allreduce_", payload_bytes=4, calls=1, group="world" if everyone else "pp",
                              group_size=world_size if everyone else grid.pp, phase="step",
                              what="the clip's sum of squares"))
    if synced:  # the drift's sums added up over the stages
        out.append(Collective(op="allreduce_", payload_bytes=16, calls=1, group="pp", group_size=grid.pp,
                              phase="step", what="the stages' drift sums at the sync", every=local.every))
    if grid.dp > 1:
        out.append(Collective(op="allreduce_", payload_bytes=8, calls=1, group=grid.dp_dim, group_size=grid.dp,
                              phase="forward", what="the replicas' padded length (their longest)"))
        out += _replicas(stages, recipe, dp=grid.dp, sharded=grid.sharded, micro=micro,
                         by_hand=grid.split_backward, tp=grid.tp)
    return out


def _replicas(stages: list[Stage], recipe: Recipe, *, dp: int, sharded: bool, micro: int,
              by_hand: bool, tp: int) -> list[Collective]:
    stored = DTYPES[recipe.model.load_dtype]
    if sharded:
        compute = stored if recipe.precision == "fp32" else DTYPES[recipe.precision]
        reduce = stored if recipe.precision == "fp32" else torch.float32
        units = [unit for stage in stages for unit in fsdp_units(stage, stage.blocks())]
        # tensor-parallel stages: FSDP shards a tp rank's slices of the split layers
        lossp = recipe.strategy.loss_parallel
        split = {name: shape for stage in stages
                 for name, shape in tp_plan.local_shapes(stage, tp, loss_parallel=lossp).items()} \
            if tp > 1 else None
        # a split backward keeps each unit gathered from its first forward to the step's end (strategy._replicate)
        return fsdp_collectives(units, shard=dp, replicate=1, compute_dtype=compute, reduce_dtype=reduce,
                                gathers_per_unit=1 if by_hand else micro + 1,
                                local_shape=(lambda name, p: split[name]) if split else None)
    params = [p for stage in stages for p in stage.parameters() if p.requires_grad]
    grads = sum(p.numel() for p in params) * element_bytes(stored)
    local = local_sgd_of(recipe)
    if local.on:  # no gradient reduced; at a sync (the step counted) this rank's parameters averaged in one call
        return local_sgd_collectives(grads, local, group_size=dp)
    compression = compression_of(recipe)
    if by_hand:  # a split backward: each stage's gradients in one all-reduce (strategy._average_replicas)
        sent = sum(p.numel() for p in params) * 2 if compression.kind in WIRE_DTYPES else grads
        return [Collective(op="allreduce_", payload_bytes=sent, calls=len(stages), group="dp_replicate",
                           group_size=dp, phase="step", what="gradients, averaged after the schedule")]
    # each stage is a DDP module of its own: its buckets, as plain ddp's (dims/comm.ddp_collectives)
    shapes = [[tuple(p.shape) for p in stage.parameters() if p.requires_grad] for stage in stages]
    buckets = [max(1, math.ceil(sum(math.prod(s) for s in each) * element_bytes(stored)
                                / (DdpWrap().bucket_cap_mb * 2 ** 20))) for each in shapes]
    if compression.on:  # each stage's DDP module runs the compression's hook on its buckets
        return [c for each, count in zip(shapes, buckets) for c in compression_collectives(
            each, compression, group_size=dp, group="dp_replicate", buckets=count,
            grad_bytes_per_number=element_bytes(stored))]
    return [Collective(op="allreduce_", payload_bytes=grads, calls=sum(buckets), group="dp_replicate", group_size=dp,
                       phase="backward", what="gradients", overlap="backward")]
