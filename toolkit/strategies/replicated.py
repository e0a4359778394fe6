"""What single, dp and ddp share: full fp32 weights on every rank, autocast, torch AdamW, GradScaler.

A composed helper, not a base class: each of those strategies holds one `Replicated`.
"""

from __future__ import annotations

import torch
from torch import nn

from toolkit.precision import Amp, StepResult
from toolkit.strategies.base import (SetupArgs, cpu_state_dict, dtype_name, first_dtype,
                                     optimizer_state_tensors)


class Replicated:
    def __init__(self, module: nn.Module, args: SetupArgs, *, reduce_desc: str):
        self.module = module  # the unwrapped model, already on its device
        self.amp = Amp(args.recipe.precision, args.env.device)
        self.optimizer = args.build_optimizer(module)
        self.scheduler = args.build_scheduler(self.optimizer)
        self.reduce_desc = reduce_desc

    def step(self, *, max_grad_norm: float | None) -> StepResult:
        result = self.amp.step(self.optimizer, list(self.module.parameters()), max_grad_norm=max_grad_norm)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return result

    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def full_state_dict(self, *, is_main: bool) -> dict | None:
        return cpu_state_dict(self.module) if is_main else None

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        params = list(self.module.parameters())
        return {"params": params, "grads": [p.grad for p in params if p.grad is not None],
                "optim": optimizer_state_tensors(self.optimizer)}

    def precision_audit(self) -> dict[str, str]:
        params = list(self.module.parameters())
        master = dtype_name(first_dtype(params))
        compute = master if self.amp.precision == "fp32" else f"{self.amp.precision} (autocast)"
        grads = [p.grad for p in params if p.grad is not None]
        return {
            "forward_params": compute,
            "master_weights": master,
            "gradients": dtype_name(first_dtype(grads)) if grads else master,
            "grad_reduction": self.reduce_desc.format(dtype=dtype_name(first_dtype(grads)) if grads else master),
            "optimizer_state": dtype_name(first_dtype(optimizer_state_tensors(self.optimizer))) or master,
            "loss_scaling": (f"dynamic (GradScaler, init {self.amp.scaler.get_scale():g})"
                             if self.amp.scaler else "off"),
            "optimizer": f"torch {type(self.optimizer).__name__}",
        }
