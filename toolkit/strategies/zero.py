"""`zero`: DeepSpeed ZeRO stages 0-3 (+ CPU offload) through `deepspeed.initialize`.

Stage 1 shards optimizer state, 2 also gradients, 3 also parameters. DeepSpeed keeps fp32 master
weights whatever the compute dtype (unlike FSDP, which updates the load dtype). Backward and step
go through the engine, so DeepSpeed's own accumulation boundary decides when gradients are reduced
and the optimizer steps; the loop's micro-batch count is only checked against it.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from toolkit.dist import ensure_process_group
from toolkit.optim import param_groups
from toolkit.precision import StepResult
from toolkit.recipe import plan_batch
from toolkit.strategies.base import SetupArgs, dtype_name, first_dtype, no_context, optimizer_state_tensors
from toolkit.strategies.zero_config import check_deepspeed_precision, offloads, resolve_ds_config, stage_of


class ZeroStrategy:
    name = "zero"

    def setup(self, model: nn.Module, args: SetupArgs) -> None:
        os.environ.setdefault("DS_ACCELERATOR", "cpu" if args.env.device.type == "cpu" else "cuda")
        import deepspeed

        self.env, recipe = args.env, args.recipe
        check_deepspeed_precision(recipe.precision)  # again in the rank: torchrun/accelerate skip the launcher
        ensure_process_group(args.env)  # DeepSpeed needs one even for a plain one-process `toolkit train`
        self.config = resolve_ds_config(recipe, plan_batch(recipe.batch, world_size=args.env.world_size))
        self.stage = stage_of(self.config)
        self.offload_optimizer, self.offload_param = offloads(self.config)
        optimizer = None if "optimizer" in self.config else self._client_optimizer(model, recipe)
        scheduler = None if "scheduler" in self.config else args.build_scheduler
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=self.config,
            model_parameters=None if optimizer is not None else param_groups(model, recipe.optim))
        self.module = self.engine.module

    @staticmethod
    def _client_optimizer(model: nn.Module, recipe):
        groups, optim = param_groups(model, recipe.optim), recipe.optim
        if recipe.strategy.offload_optimizer or _json_offloads_optimizer(recipe):
            # the optimizer step runs on CPU: DeepSpeed's vectorised CPU Adam (JIT-built once)
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            return DeepSpeedCPUAdam(groups, lr=optim.lr, betas=optim.betas, eps=optim.eps, adamw_mode=True)
        return torch.optim.AdamW(groups, lr=optim.lr, betas=optim.betas, eps=optim.eps, foreach=False)

    @property
    def model(self) -> nn.Module:
        return self.engine

    def forward_context(self):
        return no_context()  # the engine holds the params in the compute dtype already

    def accumulate(self, *, sync: bool):
        # DeepSpeed counts micro-steps itself; the loop's idea of the boundary must agree with it
        assert sync == self.engine.is_gradient_accumulation_boundary(), "accumulation boundary mismatch"
        return no_context()

    def backward(self, loss_share: torch.Tensor) -> None:
        # the engine averages gradients over ranks; scale_wrt_gas=False: loss_share is already normalised
        # over every micro-batch of the step, so DeepSpeed must not divide by the accumulation steps again
        self.engine.backward(loss_share * self.env.world_size, scale_wrt_gas=False)
        if not self.engine.is_gradient_accumulation_boundary():
            self.engine.step()  # off the boundary this only advances DeepSpeed's micro-step counter

    def step(self, *, max_grad_norm: float | None) -> StepResult:
        assert self.engine.is_gradient_accumulation_boundary()
        skipped_before = self.engine.skipped_steps
        self.engine.step()  # reduce (stage 0/1), clip at gradient_clipping, optimizer + lr schedule step
        norm = self.engine.get_global_grad_norm()
        scale = self.engine._get_optimizer_loss_scale() if self.engine.fp16_enabled() else None
        return StepResult(grad_norm=float(norm) if norm is not None else float("nan"),
                          skipped=self.engine.skipped_steps > skipped_before,
                          loss_scale=float(scale) if scale is not None else None)

    def lr(self) -> float:
        return self.engine.get_lr()[0]

    def replicated_parameters(self):
        if self.stage == 3:
            return []  # each rank holds a partition
        return list(self.module.named_parameters())

    def full_state_dict(self):
        """fp32 master weights, gathered (a collective under ZeRO-3), plus buffers."""
        from deepspeed.utils import safe_get_full_fp32_param

        state, gathered = {}, {}
        for name, param in self.module.named_parameters(remove_duplicate=False):  # tied weights: every name
            if id(param) not in gathered:
                full = safe_get_full_fp32_param(param)  # every rank calls it: stage 3 all-gathers
                gathered[id(param)] = (full if full is not None else param.detach()).to("cpu", torch.float32,
                                                                                         copy=True)
            state[name] = gathered[id(param)]
        persistent = set(self.module.state_dict().keys())  # non-persistent buffers are not saved
        for name, buffer in self.module.named_buffers():
            if name in persistent:
                state[name] = buffer.detach().to("cpu", copy=True)
        return state if self.env.is_main else None

    def export_module(self) -> nn.Module:
        return self.module

    def close(self) -> None:
        self.engine.destroy()  # removes ZeRO-3's hooks and the optimizer's buffers
        del self.engine, self.optimizer, self.scheduler, self.module

    def _inner_optimizer(self):
        return getattr(self.optimizer, "optimizer", self.optimizer)

    def _master_tensors(self) -> list[torch.Tensor]:
        """The fp32 weights the optimizer updates: ZeRO's partitions where it keeps them, else its params."""
        for attr in ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups"):
            found = [t for t in getattr(self.optimizer, attr, None) or [] if torch.is_tensor(t)]
            if found:
                return found
        inner = self._inner_optimizer()
        return [p for group in inner.param_groups for p in group["params"]]

    def state_tensors(self):
        params = list(self.module.parameters())
        if self.stage == 3:
            params = [p.ds_tensor for p in params]  # this rank's partition; p itself is an empty placeholder
        masters = self._master_tensors()
        model_ptrs = {t.untyped_storage().data_ptr() for t in params}
        masters = [m for m in masters if m.untyped_storage().data_ptr() not in model_ptrs]
        grads = [m.grad for m in self._master_tensors() if m.grad is not None]
        grads += [g for group in getattr(self.optimizer, "averaged_gradients", {}).values() for g in group or []]
        grads += [p.grad for p in self.module.parameters() if p.grad is not None]
        return {"params": params, "grads": grads,
                "optim": masters + optimizer_state_tensors(self._inner_optimizer())}

    def precision_audit(self) -> dict[str, str]:
        params = list(self.module.parameters())
        forward = first_dtype(p.ds_tensor if self.stage == 3 else p for p in params)
        masters = first_dtype(self._master_tensors())
        inner = self._inner_optimizer()
        grads = [p.grad for p in params if p.grad is not None] or [m.grad for m in self._master_tensors()
                                                                   if m.grad is not None]
        scaling = "off"
        if self.engine.fp16_enabled():
            scale = self.engine._get_optimizer_loss_scale()
            scaling = f"dynamic (DeepSpeed, init {scale:g})" if scale is not None else "dynamic (DeepSpeed)"
        where = "cpu" if self.offload_optimizer else self.env.device.type
        return {
            "forward_params": dtype_name(forward),
            "master_weights": f"{dtype_name(masters)} (ZeRO-{self.stage}, {where})",
            "gradients": dtype_name(first_dtype(grads)) if grads else dtype_name(forward),
            "grad_reduction": f"{'reduce-scatter' if self.stage >= 2 else 'all-reduce'} mean "
                              f"({dtype_name(self.engine.communication_data_type)})",
            "optimizer_state": dtype_name(first_dtype(optimizer_state_tensors(inner)) or masters),
            "loss_scaling": scaling,
            "optimizer": _optimizer_label(inner) + (" (offloaded)" if self.offload_optimizer else ""),
        }


def _optimizer_label(optimizer) -> str:
    name = type(optimizer).__name__
    return f"torch {name}" if type(optimizer).__module__.startswith("torch.optim") else f"DeepSpeed {name}"


def _json_offloads_optimizer(recipe) -> bool:
    if recipe.strategy.ds_config is None:
        return False
    import json

    config = json.loads(open(recipe.strategy.ds_config).read())
    return offloads(config)[0]
