"""What DeepSpeed ZeRO hands to collectives in one optimizer step (deepspeed 0.19, its torch.distributed backend),
read from the collective counter on CPU and held to it byte for byte (tests/test_comm_prediction.py):
- stage 0: one all-reduce of every gradient at the step's end;
- stages 1 and 2: an all-reduce of every gradient, in buckets of reduce_bucket_size: stage 1 once per step (at
  the accumulation boundary), stage 2 after every micro-batch's backward; after the update, each param group's
  partition (flattened, padded to a multiple of 2 × world) all-gathered in the parameters' dtype; gradients go
  in communication_data_type where the config sets it (strategy.reduce_dtype);
- stage 3: each parameter's partition (ceil(numel / world) elements) all-gathered before its forward, every
  micro-batch; one that stays whole (fewer elements than stage3_param_persistence_threshold) only once a step;
  gathered again before backward where DeepSpeed released it (the model beyond what its reuse distance and live
  limit keep: memory.gathered_bytes); every gradient reduce-scattered after every micro-batch's backward;
- the engine's own small all-reduces (overflow and norm checks): 4, 8 or 16 bytes a step for stage 0, 1-2, 3 (8
  with stage 3's optimizer offloaded: the CPU optimizer's norm), and at stages 1-2 in a 16-bit precision one
  byte more (the overflow flag; measured in bf16).
"""

from __future__ import annotations

import math

from torch import nn

from toolkit.config.recipe import Recipe
from toolkit.cost.collectives import Collective
from toolkit.memory.state_bytes import element_bytes
from toolkit.model.precision import DTYPES
from toolkit.strategies.optim.adamw import param_groups
from toolkit.strategies.zero import memory
from toolkit.strategies.zero.config import offloads, stage_of

ENGINE_CHECK_BYTES = {0: 4, 1: 8, 2: 8, 3: 16}  # measured: the engine's own small all-reduces per step
# ZeRO-3's host time per gather or reduce-scatter call beyond the collective itself: the Python of its module hooks
# (fetch, release, re-partition), its gradient bucket copies and its step's per-parameter flatten, unscale and
# gathers of the parameters kept whole. Measured by benchmarks/zero3_host_time.py on this project's 2-core CPU at
# 2 ranks (1 thread each; 2026-12-01): a step's forward-backward less its compute (one process at 1 thread on the
# rank's batch) and the time inside its collectives, plus its optimizer step less AdamW's, over the calls the
# rules predict: minilm-sst 0.62 ms (micro 16) and 0.55 (micro 8), llama-tiny 0.52, moe-tiny 0.60. Charged only
# where the host also computes (a CPU profile); on a GPU the host runs ahead of the device's kernels and the time
# is not charged (not measured there).
HOST_S_PER_CALL = 0.6e-3


def predict(model: nn.Module, recipe: Recipe, *, world_size: int, num_micro_batches: int) -> list[Collective]:
    if world_size == 1:
        return []
    config = memory.planned_config(model, recipe, world_size=world_size)
    stage, zero = stage_of(config), config.get("zero_optimization", {})
    size = element_bytes(memory.param_dtype(recipe))
    wire = config.get("communication_data_type")  # strategy.reduce_dtype, or a ds_config's
    sent = element_bytes(DTYPES[wire]) if wire else size
    trainable = [p for p in model.parameters() if p.requires_grad]
    grads = sum(p.numel() for p in trainable) * sent
    bucket = int(zero.get("reduce_bucket_size", memory.DEFAULT_REDUCE_BUCKET)) * sent

    def entry(op: str, payload: int, calls: int, phase: str, what: str, overlap: str = "nothing",
              host_s_per_call: float = 0.0) -> Collective:
        return Collective(op=op, payload_bytes=payload, calls=calls, group="dp_shard", group_size=world_size,
                          phase=phase, what=what, overlap=overlap, host_s_per_call=host_s_per_call)

    flag = 1 if stage in (1, 2) and recipe.precision != "fp32" else 0
    check_bytes = 8 if stage == 3 and offloads(config)[0] else ENGINE_CHECK_BYTES[stage] + flag
    checks = entry("allreduce_", check_bytes, 1 if stage < 3 else 2, "step",
                   "overflow and norm checks")
    if stage == 0:
        return [entry("allreduce_", grads, max(1, math.ceil(grads / (memory.ALLREDUCE_BUCKET * size))), "step",
                      "gradients"), checks]
    if stage in (1, 2):
        reductions = num_micro_batches if stage == 2 else 1
        groups = [[p.numel() for p in g["params"]] for g in param_groups(model, recipe.optim) if g["params"]]
        partitions = sum(memory.partition_numel(numels, world_size) for numels in groups)
        # beside backward only with overlap_comm (DeepSpeed's default: on for stage 3 alone)
        overlapped = "backward" if zero.get("overlap_comm", False) else "nothing"
        return [entry("allreduce_", reductions * grads, reductions * max(1, math.ceil(grads / bucket)), "backward",
                      "gradients", overlapped),
                entry("_allgather_base_", partitions * size, len(groups), "step", "updated partitions"), checks]
    threshold = int(zero.get("stage3_param_persistence_threshold", 0))
    shards = [math.ceil(p.numel() / world_size) for p in model.parameters()]
    whole = [s for p, s in zip(model.parameters(), shards) if p.numel() < threshold]
    parted = [s for p, s in zip(model.parameters(), shards) if p.numel() >= threshold]
    kept = memory.kept_gathered_numel(model, recipe, world_size=world_size)
    regathered = max(0, sum(parted) * world_size - kept) // world_size  # released after forward: again in backward
    gathers = num_micro_batches * (sum(parted) + regathered) + sum(whole)
    padded_grads = sum(math.ceil(p.numel() / world_size) * world_size for p in trainable) * sent
    return [entry("_allgather_base_", gathers * size, num_micro_batches * len(parted) + len(whole), "forward",
                  "parameters", "compute", HOST_S_PER_CALL),
            entry("_reduce_scatter_base_", num_micro_batches * padded_grads,
                  num_micro_batches * len(trainable), "backward", "gradients", "compute", HOST_S_PER_CALL), checks]
