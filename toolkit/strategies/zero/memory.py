"""DeepSpeed ZeRO's model-state bytes per rank, from the model's shapes and DeepSpeed's own partitioning
(deepspeed 0.19, runtime/zero/stage_1_and_2.py and stage3.py), checked against runs byte for byte.

Stages 1 and 2 flatten each optimizer param group (with padding to a multiple of 2 × world elements) and cut
it into N equal partitions; a rank keeps the fp32 master and AdamW moments of its partition. Its gradients
after the backward are those of every parameter that *overlaps* its partition, whole: a parameter cut by a
partition boundary is held entire by both ranks. So ZeRO-1 and ZeRO-2 end the backward with the same
gradient bytes (ZeRO-1 holds all gradients during the backward, ZeRO-2 only one bucket), and a model whose
bytes sit in one big tensor (llama-tiny's tied 30522 × 128 embedding: 84 % of it) keeps most gradients on
every rank, not the 1/N of the ZeRO paper's accounting, which assumes many small tensors.

Stage 3 partitions every parameter on its own (ceil(numel / N) elements per rank), keeps one reduce bucket of
`reduce_bucket_size` elements for the run, and a flat buffer of its gradient partitions; with the optimizer
offloaded the fp32 masters' gradients are a second copy on the CPU.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from toolkit.config.recipe import Recipe, plan_batch
from toolkit.memory.state_bytes import ADAM_MOMENTS, StateBytes, element_bytes, largest_block_bytes
from toolkit.model.precision import DTYPES
from toolkit.strategies.optim.adamw import param_groups
from toolkit.strategies.zero.config import hidden_size_of, offloads, resolve_ds_config, stage_of

FP32 = 4
ALIGNMENT = 2  # DeepSpeed's nccl_start_alignment_factor: partitions start 4-byte aligned for 16-bit data
DEFAULT_REDUCE_BUCKET = 500_000_000
ALLREDUCE_BUCKET = 500_000_000  # stage 0's all-reduce buckets (engine.py, MEMORY_OPT_ALLREDUCE_SIZE; no setting)
DEFAULT_MAX_LIVE = DEFAULT_REUSE_DISTANCE = 1_000_000_000  # stage3_max_live_parameters, stage3_max_reuse_distance
DEFAULT_SUB_GROUP = 1_000_000_000  # stage 3's sub_group_size
NORM = 8  # the gradient norm's float64 copy (zero/utils.py, get_norm_dtype)


def param_dtype(recipe: Recipe) -> torch.dtype:
    """What DeepSpeed keeps its (partitioned or gathered) parameters in: the 16-bit precision, else the load dtype."""
    return DTYPES[recipe.precision] if recipe.precision != "fp32" else DTYPES[recipe.model.load_dtype]


def planned_config(model: nn.Module, recipe: Recipe, *, world_size: int) -> dict:
    """The DeepSpeed config a run of `recipe` at `world_size` would get (its buckets sized to the model)."""
    return resolve_ds_config(recipe, plan_batch(recipe.batch, world_size=world_size),
                             hidden_size=hidden_size_of(model.config))


def predict(model: nn.Module, recipe: Recipe, *, world_size: int) -> list[StateBytes]:
    config = planned_config(model, recipe, world_size=world_size)
    stage, (offload_optimizer, _) = stage_of(config), offloads(config)
    dtype = param_dtype(recipe)
    size = element_bytes(dtype)
    groups = [[p.numel() for p in g["params"]] for g in param_groups(model, recipe.optim)]
    groups = [g for g in groups if g]
    everything = sum(p.numel() for p in model.parameters())
    if stage == 0:
        masters = sum(map(sum, groups)) * FP32 if dtype != torch.float32 else 0  # 16-bit: fp32 masters, whole
        state = StateBytes(params_bytes=everything * size, grads_bytes=sum(map(sum, groups)) * size,
                           optim_bytes=masters + ADAM_MOMENTS * FP32 * sum(map(sum, groups)))
        return [state] * world_size
    if stage == 3:
        return [_stage3(model, groups, config, size=size, offload=offload_optimizer, world_size=world_size)] * world_size
    return [_stage12(groups, rank, size=size, everything=everything, offload=offload_optimizer, world_size=world_size)
            for rank in range(world_size)]


def _stage12(groups: list[list[int]], rank: int, *, size: int, everything: int, offload: bool,
             world_size: int) -> StateBytes:
    partition_total = grads = 0
    for numels in groups:
        partition = partition_numel(numels, world_size)
        partition_total += partition
        grads += sum(whole for whole, _ in partition_overlaps(numels, rank, world_size))
    # with the optimizer offloaded, gradients go straight into the fp32 partition's .grad on the CPU
    grads_bytes = partition_total * FP32 if offload else grads * size
    return StateBytes(params_bytes=everything * size, grads_bytes=grads_bytes,
                      optim_bytes=(1 + ADAM_MOMENTS) * FP32 * partition_total)  # fp32 master + moments


def partition_numel(numels: list[int], world_size: int) -> int:
    """Elements of one rank's partition of a param group, flattened and padded to a multiple of 2 × world."""
    align = ALIGNMENT * world_size
    return math.ceil(sum(numels) / align) * align // world_size


def _stage3(model: nn.Module, groups: list[list[int]], config: dict, *, size: int, offload: bool,
            world_size: int) -> StateBytes:
    def share(numel: int) -> int:
        return math.ceil(numel / world_size)

    params = sum(share(p.numel()) for p in model.parameters())
    trainable = sum(share(n) for numels in groups for n in numels)
    zero = config.get("zero_optimization", {})
    bucket = int(zero.get("reduce_bucket_size", DEFAULT_REDUCE_BUCKET)) if zero.get("contiguous_gradients", True) else 0
    # the flat buffer of gradient partitions, plus, offloaded, the fp32 masters' own .grad beside it
    grads_bytes = trainable * size + (trainable * FP32 if offload else 0) + bucket * size
    return StateBytes(params_bytes=params * size, grads_bytes=grads_bytes,
                      optim_bytes=(1 + ADAM_MOMENTS) * FP32 * trainable)


def step_bytes(model: nn.Module, recipe: Recipe, *, world_size: int, device_type: str) -> list[int]:
    """Per rank, what the end of backward and the step copy beside the model states, one after the other: the
    largest gradient being reduced whole (`reduce_bytes`, stage 3), the gradient norm's copies (`norm_bytes`),
    then the flat gradient partition the update reads (`flat_gradient_bytes`)."""
    flat = flat_gradient_bytes(model, recipe, world_size=world_size)
    reduced = reduce_bytes(model, recipe, world_size=world_size, device_type=device_type)
    return [max(flat, norm, reduced) for norm in norm_bytes(model, recipe, world_size=world_size)]


def reduce_bytes(model: nn.Module, recipe: Recipe, *, world_size: int, device_type: str) -> int:
    """Stage 3: the reduce-scatter of the largest gradient at once. Autograd gives a gathered parameter its whole
    gradient, in the parameters' dtype; DeepSpeed reduce-scatters a gradient larger than the reduce bucket alone,
    in place where the ranks divide its elements, else through a padded flat copy, and a bucket of smaller ones
    through a flat copy of the bucket (comm/coalesced_collectives.py, reduce_scatter_coalesced); on CPU gloo's
    reduce-scatter copies its input once more (measured: +46 MiB beside a 44.7 MiB input, at 2 ranks). The largest
    parameter is most often the first layer's embedding, reduced last, once the activations are gone (minilm-sst
    zero3 at 2 ranks: its 11,720,448-element word embedding, 89 MiB beyond the model states and the parameters
    kept gathered, at the end of backward). Not counted: an untied head at least as large as every other
    parameter is reduced first, beside the activations; strategy.reduce_dtype's cast copy of a gradient
    (stage3.py, __avg_scatter_grads)."""
    config = planned_config(model, recipe, world_size=world_size)
    if stage_of(config) != 3:
        return 0
    bucket = int(config.get("zero_optimization", {}).get("reduce_bucket_size", DEFAULT_REDUCE_BUCKET))
    trainable = [p.numel() for p in model.parameters() if p.requires_grad]
    largest, size, gloo = max(trainable, default=0), element_bytes(param_dtype(recipe)), device_type != "cuda"
    if largest > bucket:  # alone
        return largest * size * (1 + (largest % world_size != 0) + gloo)
    return min(bucket, sum(trainable)) * size * (1 + gloo)  # a bucket of them, flattened


def flat_gradient_bytes(model: nn.Module, recipe: Recipe, *, world_size: int) -> int:
    """What the step flattens its gradients into.

    Stages 1 and 2 (optimizer not offloaded): the step flattens the rank's averaged gradients of one param group
    at a time into one tensor of its partition, cast to fp32 (a second one where the gradients are 16-bit),
    before freeing them (stage_1_and_2.py, step()): the largest group's. Measured: zero2 302M, 2 ranks, fp32: the
    step's peak 576 MiB (the partition) above the model states, beside the process's own growth.
    Stage 3 (optimizer not offloaded) does the same per sub-group of at most `sub_group_size` partition elements
    (stage3.py, _prepare_fp32_grad_for_sub_group), beside the flat gradient buffer it keeps.
    Stage 0: the engine's all-reduce at the end of backward flattens the gradients into buckets of 5e8 elements
    (engine.py, buffered_allreduce_fallback / allreduce_no_retain: a bucket is sent once it passes that), the
    largest bucket a copy beside every gradient; in 16-bit, the step then gives every gradient an fp32 copy on
    its master (FP16_UnfusedOptimizer) before the update. Measured: zero0 302M, 2 ranks, fp32: +16.3 % peak
    without the bucket, +1.5 % with it (benchmarks/memory_scaling.py --arms zero0).
    Offloaded, the gradients go to the CPU partition's own .grad: nothing."""
    config = planned_config(model, recipe, world_size=world_size)
    size = element_bytes(param_dtype(recipe))
    cast = FP32 + (size if size != FP32 else 0)  # the flat 16-bit gradients and their fp32 copy
    groups = [g["params"] for g in param_groups(model, recipe.optim) if g["params"]]
    if stage_of(config) == 0:
        trainable = [p.numel() for p in model.parameters() if p.requires_grad]
        whole = sum(trainable) * FP32 if size != FP32 else 0
        return max(largest_allreduce_bucket(trainable) * size, whole)
    if offloads(config)[0]:
        return 0
    if stage_of(config) == 3:
        limit = int(config.get("zero_optimization", {}).get("sub_group_size", DEFAULT_SUB_GROUP))
        shares = [[math.ceil(p.numel() / world_size) for p in params] for params in groups]
        return max((max(sub_group_numels(numels, limit)) for numels in shares), default=0) * cast
    return max((partition_numel([p.numel() for p in params], world_size) for params in groups), default=0) * cast


def sub_group_numels(shares: list[int], limit: int) -> list[int]:
    """Stage 3's optimizer sub-groups of one param group: partition elements in parameter order, a sub-group
    closed once it holds `limit` (stage3.py, _create_fp16_sub_groups); one sub-group where the group is smaller."""
    if sum(shares) <= limit:
        return [sum(shares)]
    sizes: list[int] = []
    current = 0
    for share in shares:
        current += share
        if current >= limit:
            sizes, current = sizes + [current], 0
    return sizes + [current] if current else sizes


def norm_bytes(model: nn.Module, recipe: Recipe, *, world_size: int) -> list[int]:
    """Per rank, the gradient norm's copy at the start of the step (stages 1-3, optimizer not offloaded): DeepSpeed
    takes each gradient piece of the rank's partition to the norm dtype (float64 where the device has it, CPU and
    CUDA: zero/utils.py get_norm_dtype) one at a time before its norm (stage_1_and_2.py and stage3.py,
    get_grad_norm_direct), beside every model state: the largest piece's 8 bytes an element. A piece is the part of
    a parameter inside the rank's partition of its flattened group (stages 1, 2: a 30522-row embedding larger
    than the partition is all of rank 0's), or the parameter's own share (stage 3). Measured: minilm-sst zero2 at 2
    ranks, rank 0's piece 11,341,440 elements (its whole partition, inside the embedding), 87 MiB above the
    model states at the norm; rank 1's largest 589,824. Not counted: with the optimizer offloaded DeepSpeed takes
    the same pieces to float64 in its reduce hook during backward instead (stage_1_and_2.py,
    set_norm_for_param_grad_in_gpu; stage3.py, _constant_buffered_norm2, in chunks), beside the activations."""
    config = planned_config(model, recipe, world_size=world_size)
    stage = stage_of(config)
    if stage == 0 or offloads(config)[0]:
        return [0] * world_size
    groups = [[p.numel() for p in g["params"]] for g in param_groups(model, recipe.optim) if g["params"]]
    if stage == 3:
        return [max((math.ceil(n / world_size) for numels in groups for n in numels), default=0) * NORM] * world_size
    return [max((inside for numels in groups for _, inside in partition_overlaps(numels, rank, world_size)),
                default=0) * NORM for rank in range(world_size)]


def partition_overlaps(numels: list[int], rank: int, world_size: int) -> list[tuple[int, int]]:
    """(elements, elements inside the partition) of each parameter overlapping `rank`'s partition of a flattened
    group, stages 1 and 2 (DeepSpeed's get_partition_info): the rank keeps such a gradient whole, and its norm
    reads the part inside."""
    partition = partition_numel(numels, world_size)
    start, end, offset, overlaps = partition * rank, partition * (rank + 1), 0, []
    for numel in numels:
        inside = min(end, offset + numel) - max(start, offset)
        if inside > 0:
            overlaps.append((numel, inside))
        offset += numel
    return overlaps


def largest_allreduce_bucket(numels: list[int], limit: int = ALLREDUCE_BUCKET) -> int:
    """Elements of the largest bucket DeepSpeed's stage-0 all-reduce flattens: gradients in parameter order,
    a bucket sent as soon as it holds more than `limit` (engine.py, allreduce_no_retain)."""
    largest = bucket = 0
    for numel in numels:
        bucket += numel
        if bucket > limit:
            largest, bucket = max(largest, bucket), 0
    return max(largest, bucket)


def gathered_bytes(model: nn.Module, recipe: Recipe, *, world_size: int) -> int:
    """Stage 3: the parameters DeepSpeed keeps gathered. Once the first step has traced the module order, a
    parameter is not released after its use while it recurs within `stage3_max_reuse_distance` elements of the
    trace (deepspeed 0.19, runtime/zero/partitioned_param_coordinator.py, `__params_to_release`). A block's
    backward use comes about twice the elements after its forward one that lie between, so the blocks within
    half that distance of the forward's end stay gathered until backward, up to `stage3_max_live_parameters`.
    DeepSpeed's defaults (1e9 each; transformers' documented configs set the same) keep every parameter of a
    model under 500M gathered from the end of the forward (measured on the 302M benchmark: RSS rose by the
    whole model's fp32 bytes from the second step on, not by one block). Stages 1 and 2 gather nothing."""
    config = planned_config(model, recipe, world_size=world_size)
    if stage_of(config) != 3:
        return 0
    kept = kept_gathered_numel(model, recipe, world_size=world_size)
    return max(kept * element_bytes(param_dtype(recipe)), largest_block_bytes(model, recipe))


def kept_gathered_numel(model: nn.Module, recipe: Recipe, *, world_size: int) -> int:
    """Stage 3: the elements DeepSpeed keeps gathered from the end of the forward to their backward use (see
    gathered_bytes); the rest it gathers again in backward."""
    config = planned_config(model, recipe, world_size=world_size)
    return min(sum(p.numel() for p in model.parameters()), kept_gathered_limit(config.get("zero_optimization", {})))


def kept_gathered_limit(zero: dict) -> int:
    """The most elements a ZeRO-3 step keeps gathered from the end of its forward (`zero`: the config's
    zero_optimization): half the reuse distance, at most the live limit (see gathered_bytes)."""
    return min(int(zero.get("stage3_max_reuse_distance", DEFAULT_REUSE_DISTANCE)) // 2,
               int(zero.get("stage3_max_live_parameters", DEFAULT_MAX_LIVE)))
