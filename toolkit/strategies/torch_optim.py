"""The optimizer side of every torch-native strategy (single, dp, ddp, model parallel, fsdp, tp, pipeline): the
recipe's AdamW, its lr schedule and the fp16 loss scaler, stepped, skipped and checkpointed the same way.

Each of those strategies holds one (composition, not a base class); what differs between them is passed in: the
parameters a step clips, how it computes the global norm (sharded, split or staged), and each parameter's name in
the shared checkpoint layout. DeepSpeed ZeRO owns its optimizer and does not use this."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from toolkit.checkpoint.state import (Read, load_optimizer_tensors, load_schedule_state, optimizer_tensors,
                                      schedule_state)
from toolkit.model.precision import Amp, StepResult, dtype_name
from toolkit.strategies.base import first_dtype, optimizer_label, optimizer_state_tensors

Clip = Callable[[list[torch.Tensor], float], torch.Tensor]  # (parameters, max norm) -> the total norm


class TorchOptim:
    def __init__(self, optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler, *,
                 amp: Amp, names: Callable[[], dict[int, str]], clip: Clip | None = None) -> None:
        """`names()`: id(parameter) -> its name in the checkpoint (a tied weight's first name); `clip`: the
        global-norm clip over this rank's parameters (default: torch's, for whole parameters on one rank)."""
        self.optimizer, self.scheduler, self.amp = optimizer, scheduler, amp
        self.names, self.clip = names, clip

    def step(self, parameters: Sequence[torch.Tensor], *, max_grad_norm: float | None) -> StepResult:
        """Unscale (fp16), clip, step, schedule, zero the gradients."""
        result = self.amp.step(self.optimizer, parameters, max_grad_norm=max_grad_norm, clip=self.clip)
        if result.advances_schedule:  # held after an fp16 overflow, as DeepSpeed holds it
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return result

    def discard_step(self) -> None:
        """No update; the schedule advances, as it does for a step fp16 loss scaling skips."""
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()

    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def checkpoint_tensors(self) -> dict[str, Any]:
        """The optimizer's state in the shared layout (`state.<name>.<key>`)."""
        return optimizer_tensors(self.optimizer, self.names())

    def load_state(self, read: Read) -> None:
        load_optimizer_tensors(self.optimizer, self.names(), read)

    def checkpoint_extra(self) -> dict[str, Any]:
        return schedule_state(self.scheduler, self.amp.scaler)

    def load_checkpoint_extra(self, extra: dict[str, Any]) -> None:
        load_schedule_state(self.scheduler, self.amp.scaler, extra)

    def state_tensors(self) -> list[torch.Tensor]:
        return optimizer_state_tensors(self.optimizer)

    def audit(self, *, before_state: torch.dtype | None = None, scaler: str = "GradScaler") -> dict[str, str]:
        """The precision audit's optimizer rows, read from the live objects; `before_state`: the dtype the state
        row names before the first step made any state (n/a where None); `scaler`: the loss scaler's name."""
        return {
            "optimizer_state": dtype_name(first_dtype(self.state_tensors()) or before_state),
            "loss_scaling": f"dynamic ({scaler}, init {self.amp.scaler.get_scale():g})" if self.amp.scaler else "off",
            "optimizer": optimizer_label(self.optimizer),
        }
