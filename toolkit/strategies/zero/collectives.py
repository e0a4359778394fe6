"""What DeepSpeed ZeRO hands to collectives in one optimizer step (deepspeed 0.19, its torch.distributed backend),
read from the collective counter on CPU and held to it byte for byte (tests/test_comm_prediction.py):
- stage 0: one all-reduce of every gradient at the step's end;
- stages 1 and 2: an all-reduce of every gradient, in buckets of reduce_bucket_size: stage 1 once per step (at
  the accumulation boundary, in the optimizer's parameter groups' order), stage 2 after every micro-batch's
  backward (in the order backward finishes the gradients: order.py); a call per bucket, and one per gradient
  larger than a bucket (bucket_calls); after the update, each param group's
  partition (flattened, padded to a multiple of 2 × world) all-gathered in the parameters' dtype; gradients go
  in communication_data_type where the config sets it (strategy.reduce_dtype);
- stage 3: each parameter's partition (ceil(numel / world) elements) all-gathered before its forward, every
  micro-batch, the partitions of the parameters its prefetch takes together in one call (prefetch_calls); one
  that stays whole (fewer elements than stage3_param_persistence_threshold) only once a step, a call each after
  the update; gathered again before backward where DeepSpeed released it (the model beyond what its reuse
  distance and live limit keep: memory.gathered_bytes); every gradient reduce-scattered after every
  micro-batch's backward, in buckets as stage 2's;
- the engine's own small all-reduces (overflow and norm checks): stage 0 one gradient norm of 4 bytes a step;
  stages 1-3 one per optimizer parameter group that holds parameters (decay and no-decay: 2; LoRA's adapters,
  all decayed: 1) of 4 bytes at stages 1-2 and 8 at stage 3 (4 with its optimizer offloaded: the CPU
  optimizer's norm), and at stages 1-2 in a 16-bit precision one byte more in a call of its own (the overflow
  flag; measured in bf16).
At world size 1 DeepSpeed gathers nothing (a partition is the whole parameter; stages 1-2 gather no updated
partition either) but calls every other collective above on its group of one: held to the counter as well, and
priced as local copies (cost/step_time.local_call_s). ZeRO-3 there takes each block as a unit (order.block_units),
which changes the order its gradients reach the buckets (order.leaf_backward).
Calls are held to the counter too: the tiny Llama's stage 1 makes 15 gradient all-reduces a step where a bucket
count (its gradients' bytes over the bucket's) said 1,929.
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
from toolkit.strategies.zero.order import block_units, leaf_backward, param_order

DEFAULT_PREFETCH_BUCKET = 50_000_000  # stage3_prefetch_bucket_size's default (elements)

NORM_BYTES = {0: 4, 1: 4, 2: 4, 3: 8}  # measured: each gradient norm's all-reduce (stage 3 offloaded: 4)
# ZeRO-3's host time per tensor it gathers or reduce-scatters (a parameter's partition each micro-batch, or once a
# step where it stays whole; a gradient each micro-batch), beyond the collective itself: the Python of its module
# hooks (fetch, release, re-partition), its gradient bucket copies and its step's per-parameter flatten, unscale
# and gathers of the parameters kept whole, which go a tensor at a time whatever calls carry them. Measured by
# benchmarks/zero3_host_time.py on this project's 2-core CPU at 2 ranks (1 thread each; 2026-12-01): a step's
# forward-backward less its compute (one process at 1 thread on the rank's batch) and the time inside its
# collectives, plus its optimizer step less AdamW's, over those tensors: minilm-sst 0.62 ms (micro 16) and 0.55
# (micro 8), llama-tiny 0.52, moe-tiny 0.60. Charged only where the host also computes (a CPU profile). On a GPU
# it is not charged yet, although the host does not run ahead there: one H200 at world size 1 (docs/benchmarks.md,
# 2026-12-04) ran a 1B Llama's ZeRO-3 step in 584 ms of which its kernels took 180 (single's: 195 ms a step), about
# the 0.6 ms of ~600 tensor visits; no multi-GPU step has been measured to tell how the host time adds to the
# device's there. At world size 1 (each block a unit: order.block_units) the same benchmark with --nproc 1 measured
# 0.61-1.28 ms a tensor on this CPU (docs/benchmarks.md), charged at this constant as well.
HOST_S_PER_TENSOR = 0.6e-3


def predict(model: nn.Module, recipe: Recipe, *, world_size: int, num_micro_batches: int) -> list[Collective]:
    config = memory.planned_config(model, recipe, world_size=world_size)
    stage, zero = stage_of(config), config.get("zero_optimization", {})
    size = element_bytes(memory.param_dtype(recipe))
    wire = config.get("communication_data_type")  # strategy.reduce_dtype, or a ds_config's
    sent = element_bytes(DTYPES[wire]) if wire else size
    trainable = [p for p in model.parameters() if p.requires_grad]
    grads = sum(p.numel() for p in trainable) * sent
    bucket = int(zero.get("reduce_bucket_size", memory.DEFAULT_REDUCE_BUCKET))  # elements

    def entry(op: str, payload: int, calls: int, phase: str, what: str, overlap: str = "nothing",
              tensors: int = 0) -> Collective:
        return Collective(op=op, payload_bytes=payload, calls=calls, group="dp_shard", group_size=world_size,
                          phase=phase, what=what, overlap=overlap, host_s=tensors * HOST_S_PER_TENSOR)

    flag = 1 if stage in (1, 2) and recipe.precision != "fp32" else 0
    optimizer_groups = [g["params"] for g in param_groups(model, recipe.optim) if g["params"]]
    groups = [[p.numel() for p in params] for params in optimizer_groups]
    # a gradient norm per optimizer parameter group holding parameters (stages 1-3), the engine's one (stage 0)
    norms = 1 if stage == 0 else len(groups)
    norm_bytes = 4 if stage == 3 and offloads(config)[0] else NORM_BYTES[stage]
    checks = entry("allreduce_", norms * norm_bytes + flag, norms + flag, "step", "overflow and norm checks")
    if stage == 0:
        return [entry("allreduce_", grads, max(1, math.ceil(grads / (memory.ALLREDUCE_BUCKET * size))), "step",
                      "gradients"), checks]
    params = list(model.parameters())
    if stage in (1, 2):
        reductions = num_micro_batches if stage == 2 else 1
        partitions = sum(memory.partition_numel(numels, world_size) for numels in groups)
        # stage 1 reduces at the step's end, group by group; stage 2 as backward finishes each gradient
        numels = [n for numels in groups for n in numels] if stage == 1 else \
            [params[i].numel() for i in param_order(model, recipe).backward]
        # beside backward only with overlap_comm (DeepSpeed's default: on for stage 3 alone)
        overlapped = "backward" if zero.get("overlap_comm", False) else "nothing"
        # one rank: a partition is the whole group, which DeepSpeed does not gather
        gathered = len(groups) if world_size > 1 else 0
        return [entry("allreduce_", reductions * grads, reductions * bucket_calls(numels, bucket), "backward",
                      "gradients", overlapped),
                entry("_allgather_base_", partitions * size if gathered else 0, gathered, "step",
                      "updated partitions"), checks]
    threshold = int(zero.get("stage3_param_persistence_threshold", 0))
    shards = [math.ceil(p.numel() / world_size) for p in model.parameters()]
    whole = [s for p, s in zip(model.parameters(), shards) if p.numel() < threshold]
    parted = [s for p, s in zip(model.parameters(), shards) if p.numel() >= threshold]
    kept = memory.kept_gathered_numel(model, recipe, world_size=world_size)
    regathered = max(0, sum(parted) * world_size - kept) // world_size  # released after forward: again in backward
    gathers = num_micro_batches * (sum(parted) + regathered) + sum(whole)
    padded_grads = sum(math.ceil(p.numel() / world_size) * world_size for p in trainable) * sent
    order = param_order(model, recipe)
    # the forward's gathers, and backward's of what DeepSpeed released after the forward: the parameters used
    # earliest (the blocks within its reuse distance of the forward's end stay gathered: memory.gathered_bytes)
    prefetch = int(zero.get("stage3_prefetch_bucket_size", DEFAULT_PREFETCH_BUCKET))
    groups = [[params[i].numel() for i in group if params[i].numel() >= threshold] for group in order.forward]
    released = _released(groups, kept=kept)
    calls = prefetch_calls(groups, prefetch) + prefetch_calls(released[::-1], prefetch)
    blocks, _ = block_units(model, config, world_size=world_size)
    backward = leaf_backward(model, order, blocks, optimizer_groups) if blocks else order.backward
    reduced = [params[i].numel() for i in backward]
    if world_size == 1:  # a partition is the whole parameter: no gather is called, the hooks still fetch each
        gathers = calls = 0
        whole = []
    return [entry("_allgather_base_", gathers * size, num_micro_batches * calls + len(whole), "forward",
                  "parameters", "compute", tensors=num_micro_batches * len(parted) + len(whole)),
            entry("_reduce_scatter_base_", num_micro_batches * padded_grads,
                  num_micro_batches * bucket_calls(reduced, bucket), "backward", "gradients", "compute",
                  tensors=num_micro_batches * len(trainable)), checks]


def bucket_calls(numels: list[int], bucket: int) -> int:
    """DeepSpeed's gradient buckets (stage 1-2's reduce_independent_p_g_buckets_and_remove_grads, stage 3's): each
    gradient, in the order given, joins the bucket; one that would take a bucket holding some past `bucket`
    elements first reduces what it holds, one call; so a gradient larger than a bucket goes alone. The last
    bucket's call at backward's (stage 1: the step's) end."""
    calls = held = 0
    for numel in numels:
        if held and held + numel > bucket:
            calls, held = calls + 1, 0
        held += numel
    return calls + (1 if held else 0)


def prefetch_calls(groups: list[list[int]], bucket: int) -> int:
    """ZeRO-3's gathers (partitioned_param_coordinator.fetch_sub_module, a step after the first, whose trace it
    replays): every module's forward hook takes the next parameters of the trace not yet gathered until they hold
    `bucket` elements or more, and gathers their partitions in one call (all_gather_coalesced); so the
    parameters, in order, fall into runs of at least `bucket` elements, a call each. Without a prefetch bucket
    (0), each module gathers its own parameters, a call per module. `groups`: the parameters' elements, per
    module, in the order modules run (those kept whole left out)."""
    if bucket <= 0:
        return sum(1 for group in groups if group)
    calls = held = 0
    for numel in (n for group in groups for n in group):
        held += numel
        if held >= bucket:
            calls, held = calls + 1, 0
    return calls + (1 if held else 0)


def _released(groups: list[list[int]], *, kept: int) -> list[list[int]]:
    """The parameters DeepSpeed releases after its forward: all but the last `kept` elements' worth (per module)."""
    left, out = kept, []
    for group in reversed(groups):
        if left >= sum(group):
            left -= sum(group)
        else:
            out.append(group)
            left = 0
    return out[::-1]
