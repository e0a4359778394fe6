"""What every torch-native strategy (single, dp, ddp, model parallel, fsdp, tp, pipeline) shares, as components
it holds (composition, not a base class):
- TorchOptim: the recipe's AdamW, its lr schedule and the fp16 loss scaler, stepped, skipped and checkpointed the
  same way; what differs is passed in: how a step computes the global norm (sharded, split or staged) and each
  parameter's name in the shared checkpoint layout;
- TorchState: the checkpoint and export state of one whose one module holds every parameter of the rank.
DeepSpeed ZeRO owns its optimizer and uses neither."""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

import torch
from torch import nn

from toolkit.checkpoint.state import (Read, load_optimizer_tensors, load_schedule_state, model_tensors,
                                      optimizer_tensors, schedule_state)
from toolkit.data.losses import vocab_parallel
from toolkit.model.precision import Amp, StepResult, dtype_name
from toolkit.process.dist import DistEnv
from toolkit.strategies.base import (Replicas, cpu_state_dict, first_dtype, gathered_state_dict, optimizer_label,
                                     optimizer_state_tensors)

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


class TrainsOneModule:
    """backward, step, discard_step and lr of a strategy whose one module (`model`) trains with a TorchOptim
    (`optim`) and an Amp (`amp`): every parameter that got a gradient steps (fsdp, tp, hf_native)."""

    optim: TorchOptim
    amp: Amp
    loss_parallel: bool = False  # the logits a DTensor split over the vocabulary (strategy.loss_parallel: tp, fsdp)

    @property
    def model(self) -> nn.Module:
        raise NotImplementedError

    def backward(self, loss_share: torch.Tensor) -> None:
        with vocab_parallel(self.loss_parallel):  # the loss's backward over vocabulary-sharded logits
            self.amp.backward(loss_share)

    def step(self, *, max_grad_norm: float | None) -> StepResult:
        params = [p for p in self.model.parameters() if p.grad is not None]
        return self.optim.step(params, max_grad_norm=max_grad_norm)

    def discard_step(self) -> StepResult:
        self.optim.discard_step()
        return StepResult.dropped()

    def lr(self) -> float:
        return self.optim.lr()


class CommunicationState(Protocol):
    """State a communication lever keeps across steps (dims/compression.PowerSgd and HookStates,
    dims/local_sgd.LocalSgd): its checkpoint blob, and the tensors the memory plan counts with the optimizer's state
    (PowerSGD's error and factors, DiLoCo's anchor and outer momentum)."""

    def state_bytes(self) -> bytes: ...

    def load_bytes(self, blob: bytes) -> None: ...

    def state_tensors(self) -> list[torch.Tensor]: ...


def lever_state_tensors(communication: CommunicationState | None) -> list[torch.Tensor]:
    """The tensors a lever keeps beside the optimizer's state, which the memory plan counts with it; none without
    a lever."""
    return list(communication.state_tensors()) if communication is not None else []


class TorchState:
    """Checkpoint and export state of a torch-native strategy whose one module holds this rank's parameters
    (single, dp, ddp, model parallel, fsdp, tp): the module's state dict in the shared layout and its TorchOptim's.
    What differs between them is passed in: whether the full weights are gathered to rank 0 (DTensor shards) or
    read where they are (a replica on CPU), what is replicated, the gradients' maxima and the precision audit."""

    def __init__(self, module: nn.Module, optim: TorchOptim, *, env: DistEnv, gathered: bool,
                 replicas: Callable[[], list[Replicas]], gradient_abs_max: Callable[[], dict[str, float] | None],
                 audit: Callable[[], dict[str, str]], communication: CommunicationState | None = None) -> None:
        self.module, self.optim, self.env, self.gathered = module, optim, env, gathered
        self.communication = communication
        self.replicas, self.gradient_abs_max, self.precision_audit = replicas, gradient_abs_max, audit

    def checkpoint_tensors(self) -> dict[str, dict[str, Any]]:
        return {"model": model_tensors(self.module), "optim": self.optim.checkpoint_tensors()}

    def load_optimizer_state(self, read: Read) -> None:
        self.optim.load_state(read)

    def checkpoint_extra(self) -> dict[str, Any]:
        return self.optim.checkpoint_extra()

    def load_checkpoint_extra(self, extra: dict[str, Any]) -> None:
        self.optim.load_checkpoint_extra(extra)

    def communication_state(self) -> bytes | None:
        return self.communication.state_bytes() if self.communication is not None else None

    def load_communication_state(self, read: Callable[[], bytes | None]) -> None:
        blob = read() if self.communication is not None else None
        if self.communication is not None and blob is not None:
            self.communication.load_bytes(blob)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        if self.gathered:
            return gathered_state_dict(self.module, self.env)  # collective
        return cpu_state_dict(self.module) if self.env.is_main else None

    def export_module(self) -> nn.Module:
        return self.module

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        return live_state_tensors(self.module, self.optim, communication=self.communication)


def live_state_tensors(module: nn.Module, optim: TorchOptim, *,
                       communication: CommunicationState | None = None) -> dict[str, list[torch.Tensor]]:
    """A rank's parameters, gradients and optimizer state (StrategyState.state_tensors) where `module` holds
    every parameter `optim` steps; the optimizer's state with what a lever keeps beside it (lever_state_tensors)."""
    params: list[torch.Tensor] = list(module.parameters())
    return {"params": params, "grads": [p.grad for p in params if p.grad is not None],
            "optim": optim.state_tensors() + lever_state_tensors(communication)}
