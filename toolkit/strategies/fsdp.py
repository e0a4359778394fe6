"""`fsdp`: FSDP2 (`fully_shard`, DTensor parameters). Each transformer block is one shard unit, then the root.

Memory vs speed knobs (recipe `strategy.*`):
  reshard_after_forward  True: free gathered block params after forward, gather again in backward
                         (ZeRO-3-like); False: keep them until backward (ZeRO-2-like, more memory)
  cpu_offload            sharded params, grads and optimizer step on CPU
  replicate_degree       >1: HSDP, a 2-D mesh (replicate × shard): shard within a group, all-reduce across

Precision: parameters are stored (and updated) in the load dtype; `precision: bf16|fp16` sets
MixedPrecisionPolicy.param_dtype for compute and reduces gradients in fp32.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from toolkit.model import transformer_blocks
from toolkit.precision import DTYPES, StepResult
from toolkit.strategies.base import (SetupArgs, dtype_name, first_dtype, no_context, optimizer_state_tensors)


class FsdpStrategy:
    name = "fsdp"

    def setup(self, model: nn.Module, args: SetupArgs) -> None:
        options, env = args.recipe.strategy, args.env
        self.env, self.precision = env, args.recipe.precision
        self.mesh = build_mesh(env.device.type, world_size=env.world_size, replicate=options.replicate_degree)
        compute = None if self.precision == "fp32" else DTYPES[self.precision]
        # reduce in fp32: a bf16 reduce-scatter keeps ~3 significant digits of the summed gradient
        self.mp_policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32 if compute else None)
        offload = CPUOffloadPolicy(pin_memory=env.device.type == "cuda") if options.cpu_offload else OffloadPolicy()
        if not options.cpu_offload:
            model.to(env.device)
        shard = dict(mesh=self.mesh, reshard_after_forward=options.reshard_after_forward, mp_policy=self.mp_policy,
                     offload_policy=offload)
        for block in transformer_blocks(model, options.blocks):
            fully_shard(block, **shard)
        fully_shard(model, **shard)
        self._model = model
        self.optimizer = args.build_optimizer(model)
        self.scheduler = args.build_scheduler(self.optimizer)
        # fp16: one found-inf verdict for all ranks (each sees only its shard of the gradients)
        self.scaler = ShardedScaler(env.device) if self.precision == "fp16" else None

    @property
    def model(self) -> nn.Module:
        return self._model

    def forward_context(self):
        return no_context()  # MixedPrecisionPolicy casts parameters inside each shard unit

    def accumulate(self, *, sync: bool):
        # no reduce-scatter on non-final micro-batches: unsharded grads accumulate locally
        self._model.set_requires_gradient_sync(sync)
        return no_context()

    def backward(self, loss_share: torch.Tensor) -> None:
        loss = loss_share * self.env.world_size  # FSDP's reduce-scatter averages over ranks
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def step(self, *, max_grad_norm: float | None) -> StepResult:
        params = [p for p in self._model.parameters() if p.grad is not None]
        if self.scaler:
            self.scaler.unscale_(self.optimizer, params)
        norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm else math.inf)
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # collective + sync
        skipped, scale = False, None
        if self.scaler:
            skipped, scale = self.scaler.step(self.optimizer)
        else:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(grad_norm=grad_norm, skipped=skipped, loss_scale=scale)

    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def replicated_parameters(self):
        return []  # every rank holds a different shard

    def full_state_dict(self):
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # rank 0 gets it, on CPU
        state = get_model_state_dict(self._model, options=options)
        return state if self.env.is_main else None

    def export_module(self) -> nn.Module:
        return self._model

    def state_tensors(self):
        params = list(self._model.parameters())
        return {"params": params, "grads": [p.grad for p in params if p.grad is not None],
                "optim": optimizer_state_tensors(self.optimizer)}

    def precision_audit(self) -> dict[str, str]:
        params = list(self._model.parameters())
        stored = first_dtype(p.to_local() if hasattr(p, "to_local") else p for p in params)
        grads = [p.grad for p in params if p.grad is not None]
        reduce = self.mp_policy.reduce_dtype or self.mp_policy.param_dtype or stored
        return {
            "forward_params": dtype_name(self.mp_policy.param_dtype or stored),
            "master_weights": dtype_name(stored) + " (sharded, = load dtype)",
            "gradients": dtype_name(first_dtype(grads)) if grads else dtype_name(stored),
            "grad_reduction": f"reduce-scatter mean ({dtype_name(reduce)})",
            "optimizer_state": dtype_name(first_dtype(optimizer_state_tensors(self.optimizer)) or stored),
            "loss_scaling": f"dynamic (sharded, init {self.scaler.scale_value:g})" if self.scaler else "off",
            "optimizer": f"torch {type(self.optimizer).__name__}",
        }


def build_mesh(device_type: str, *, world_size: int, replicate: int):
    """The DeviceMesh, built once: 1-D (shard) or 2-D (replicate × shard) for HSDP."""
    if replicate > 1:
        return init_device_mesh(device_type, (replicate, world_size // replicate),
                                mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device_type, (world_size,), mesh_dim_names=("shard",))


class ShardedScaler:
    """Dynamic fp16 loss scaling for sharded gradients: the inf/nan check is all-reduced over ranks,
    so every rank skips (or takes) the same steps. Same schedule as torch.amp.GradScaler."""

    def __init__(self, device: torch.device, *, init_scale: float = 2.0 ** 16, growth_interval: int = 2000):
        self.device, self.scale_value, self.growth_interval = device, init_scale, growth_interval
        self.good_steps, self.found_inf = 0, False

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale_value

    def unscale_(self, optimizer, params) -> None:
        inv = 1.0 / self.scale_value
        local_bad = torch.zeros(1, device=self.device)
        for param in params:
            grad = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
            grad.mul_(inv)
            if not torch.isfinite(grad).all():
                local_bad.fill_(1.0)
        if dist.is_initialized():
            dist.all_reduce(local_bad, op=dist.ReduceOp.MAX)
        self.found_inf = bool(local_bad.item())

    def step(self, optimizer) -> tuple[bool, float]:
        if self.found_inf:
            self.scale_value /= 2.0
            self.good_steps = 0
        else:
            optimizer.step()
            self.good_steps += 1
            if self.good_steps % self.growth_interval == 0:
                self.scale_value *= 2.0
        return self.found_inf, self.scale_value
