"""The layout's per-dimension functions, and the one fixed order that composes them (torchtitan's
`parallelize_llama`). Every torch-native preset (ddp, fsdp/HSDP, tp, fsdp × tp, the pipeline's stages and their
replicas) builds its model through `parallelize`; none wraps a module by hand.

    1. pipeline split   pipeline/strategy.py cuts the model into stages, then calls `parallelize` on each stage
    2. tensor parallel  `apply_tp` over the mesh's tp dimension: attention heads and MLP columns become DTensor
                        slices (model/tp_plan.py); first, so that FSDP then shards the slices, not whole weights
    3. expert parallel  `apply_ep` over the expert mesh's ep dimension (dims/expert.py): each rank keeps 1/ep of
                        every MoE layer's experts, tokens reach them by all-to-all; FSDP then shards the experts
                        over efsdp (the ranks holding the same ones) before it shards the rest over dp_shard
    4. data parallel    `apply_fsdp` over dp_shard (HSDP: the 2-D dp_replicate × dp_shard; with context parallel,
                        over dp_shard × cp flattened, as torchtitan's dp_shard_cp: the cp ranks hold different
                        tokens of the same samples, so their gradients are summed like those of data shards), or
                        `apply_ddp` over dp_replicate; last, because their gradient hooks must see the final
                        parameters. Context parallel's attention (dims/context.py) is the model's, set beside this.

The mesh is the run's one DeviceMesh (process.dist.world_mesh); each step takes the dimensions it spans by name.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from toolkit.model import tp_plan
from toolkit.model.precision import DTYPES
from toolkit.config.parallel import Degrees
from toolkit.process.dist import DistEnv, ensure_process_group, world_mesh
from toolkit.strategies.dims import expert

DATA_PARALLEL_DIMS = ("dp_replicate", "dp_shard", "cp")  # in mesh order: the dimensions gradients are reduced over


@dataclass(frozen=True, kw_only=True)
class FsdpWrap:
    """FSDP2 over the data-parallel dimensions: each shard unit (a transformer block), then the root."""

    precision: str  # fp32 | bf16 | fp16: what MixedPrecisionPolicy casts a unit's gathered parameters to
    reshard_after_forward: bool = True  # True frees gathered parameters after forward (one more all-gather in
    #   backward, less memory); False keeps them until backward
    cpu_offload: bool = False  # sharded parameters, gradients and the optimizer step on the CPU
    reduce_dtype: str | None = None  # fp32 | bf16: what gradients are reduce-scattered in (strategy.reduce_dtype)
    replicas_apart: bool = False  # True: each of HSDP's replica groups is an FSDP of its own over dp_shard, no
    #   gradient all-reduced across the groups (local SGD averages their parameters: dims/local_sgd.py).
    #   FSDP2's set_requires_all_reduce(False) would not serve: it holds the reduced shards back for a later
    #   all-reduce and leaves .grad unset (torch 2.13, _fsdp_collectives.foreach_reduce)

    @property
    def mp_policy(self) -> MixedPrecisionPolicy:
        compute = None if self.precision == "fp32" else DTYPES[self.precision]
        # unset: fp32 under a 16-bit precision (a bf16 reduce-scatter keeps ~3 significant digits of the summed
        # gradient; the reduce_dtype lever asks for it knowingly), else the parameters' own dtype (no cast)
        reduce = DTYPES[self.reduce_dtype] if self.reduce_dtype else (torch.float32 if compute else None)
        return MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=reduce)


@dataclass(frozen=True, kw_only=True)
class DdpWrap:
    """DDP over dp_replicate: a full replica per rank, gradients all-reduced (averaged) in buckets."""

    bucket_cap_mb: float = 25.0  # bigger buckets, fewer all-reduces, later overlap
    find_unused_parameters: bool = False  # needed when some parameters get no gradient
    one_device: bool = True  # False: the module spans several devices (a model split), so DDP takes no
    #   device_ids and reduces each parameter where it lives


def apply_tp(model: nn.Module, mesh, *, sequence_parallel: bool, loss_parallel: bool = False) -> None:
    """Tensor parallel over the 1-D `mesh`, in place (the plan: model/tp_plan.py; `loss_parallel`: the vocabulary
    split too)."""
    tp_plan.parallelize(model, mesh, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)


def apply_fsdp(model: nn.Module, mesh, *, units: list[nn.Module], wrap: FsdpWrap, device: torch.device,
               experts: list[nn.Module] | None = None, expert_mesh=None) -> None:
    """fully_shard each unit, then the root (what no unit holds: embeddings, final norm, an untied head), in
    place. A 2-D mesh (dp_replicate, dp_shard) is HSDP: shards within a replica group, all-reduce across.
    `experts` (expert parallel's experts modules) go first, over `expert_mesh`'s efsdp dimension."""
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if wrap.cpu_offload else OffloadPolicy()
    policy = dict(mp_policy=wrap.mp_policy, reshard_after_forward=wrap.reshard_after_forward, offload_policy=offload)
    if experts:
        expert.shard_experts(experts, expert_mesh, world_size=mesh.size(), **policy)
    shard = dict(mesh=mesh, **policy)
    for unit in units:
        fully_shard(unit, **shard)
    fully_shard(model, **shard)


def apply_ddp(model: nn.Module, *, group, wrap: DdpWrap, env: DistEnv) -> DistributedDataParallel:
    """DDP over `group`. gradient_as_bucket_view: .grad are views into DDP's all-reduce buckets; without it DDP
    keeps a second copy of every gradient (measured: 17.7 MiB beside llama-tiny's 17.7 MiB of gradients, found by
    the live-tensor census in run.json); the same reduction, the same numbers."""
    device_ids = [env.device.index] if wrap.one_device and env.device.type == "cuda" else None
    return DistributedDataParallel(model, process_group=group, device_ids=device_ids,
                                   bucket_cap_mb=wrap.bucket_cap_mb,
                                   find_unused_parameters=wrap.find_unused_parameters, gradient_as_bucket_view=True)


def replicate_over_world(model: nn.Module, *, env: DistEnv, strategy: str, wrap: DdpWrap) -> nn.Module:
    """DDP over every rank (dp_replicate = the world): the layout of ddp and of a model split × ddp. The 1-D mesh
    over the world reuses the default process group (no new group is made); DDP needs one even for one rank."""
    ensure_process_group(env, strategy=strategy)
    mesh = world_mesh(env, Degrees(dp_replicate=env.world_size), keep=("dp_replicate",))
    return parallelize(model, mesh=mesh, env=env, units=[], data_parallel=wrap)


def ddp_no_sync(wrapped: nn.Module) -> AbstractContextManager:
    """Gradients kept local on a non-final micro-batch; the last backward all-reduces their sum."""
    return cast(DistributedDataParallel, wrapped).no_sync()


def dimensions(mesh, names: tuple[str, ...]):
    """The sub-mesh of `names` (the mesh itself where they are all of its dimensions)."""
    return mesh if tuple(mesh.mesh_dim_names) == names else mesh[names if len(names) > 1 else names[0]]


def _shard_mesh(mesh, dp_dims: tuple[str, ...]):
    """What FSDP shards over: dp_shard, dp_replicate × dp_shard (HSDP), dp_shard × cp flattened into one dimension
    (dp_shard_cp), or HSDP over dp_replicate × dp_shard_cp (torchtitan's layout of the same degrees)."""
    if "cp" not in dp_dims:
        return dimensions(mesh, dp_dims)
    sharded = tuple(name for name in dp_dims if name != "dp_replicate")
    flat = dimensions(mesh, sharded)._flatten("dp_shard_cp")  # also a dimension the whole mesh can be sliced by
    if "dp_replicate" not in dp_dims:
        return flat
    return mesh["dp_replicate", "dp_shard_cp"]


def parallelize(model: nn.Module, *, mesh, env: DistEnv, units: list[nn.Module],
                data_parallel: FsdpWrap | DdpWrap | None, sequence_parallel: bool = False,
                loss_parallel: bool = False, expert_mesh=None) -> nn.Module:
    """Apply the mesh's dimensions to `model` (a whole model, or one pipeline stage) in the fixed order: tp, then
    the data-parallel wrap. Returns what forward calls: the model itself (tp, FSDP2 work in place) or its DDP
    wrapper. `units`: the shard units (transformer blocks) FSDP2 wraps one by one. pp is not applied here: the
    pipeline has split the model already, and `model` is one of its stages. `expert_mesh`: expert parallel's
    (efsdp, ep, batch) view of the same ranks (dims/expert.py), or None."""
    names = tuple(mesh.mesh_dim_names or ())
    if "tp" in names:
        apply_tp(model, dimensions(mesh, ("tp",)), sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    experts = expert.apply_ep(model, expert_mesh) if expert_mesh is not None else []
    dp_dims = tuple(name for name in DATA_PARALLEL_DIMS if name in names)
    if isinstance(data_parallel, FsdpWrap) and data_parallel.replicas_apart:
        dp_dims = tuple(name for name in dp_dims if name != "dp_replicate")
    if isinstance(data_parallel, FsdpWrap):
        apply_fsdp(model, _shard_mesh(mesh, dp_dims), units=units, wrap=data_parallel, device=env.device,
                   experts=experts, expert_mesh=expert_mesh)
    elif isinstance(data_parallel, DdpWrap):
        assert not experts, "expert parallel's experts are FSDP-sharded; DDP would all-reduce different experts"
        assert dp_dims == ("dp_replicate",), f"DDP replicates over dp_replicate alone, not {dp_dims}"
        return apply_ddp(model, group=mesh.get_group("dp_replicate"), wrap=data_parallel, env=env)
    return model
