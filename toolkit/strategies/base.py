"""The Strategy protocol: everything the loop needs from a parallel strategy, and nothing more.

The loop calls, per optimizer step:
    with strategy.accumulate(sync=is_last_micro_batch):
        with strategy.forward_context(): logits = strategy.model(**inputs)
        strategy.backward(loss_share)
    strategy.step(max_grad_norm=...)

`loss_share` is this micro-batch's share of the global-batch mean loss: summed over every rank and
micro-batch it is the mean the step logs. A strategy whose gradient reduction averages over ranks
(DDP, FSDP, DeepSpeed) scales it by the world size before its backward.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager, Iterable, Iterator, Protocol

import torch
from torch import nn

from toolkit.dist import DistEnv
from toolkit.precision import StepResult
from toolkit.recipe import Recipe

OptimizerFactory = Callable[[nn.Module], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]


@dataclass(frozen=True, kw_only=True)
class SetupArgs:
    recipe: Recipe
    env: DistEnv
    grad_accum_steps: int
    total_steps: int
    build_optimizer: OptimizerFactory
    build_scheduler: SchedulerFactory


class Strategy(Protocol):
    name: str

    def setup(self, model: nn.Module, args: SetupArgs) -> None:
        """Wrap/shard the model (on CPU, in its load dtype), move it to the device, build optimizer + schedule."""

    @property
    def model(self) -> nn.Module:
        """The module the loop calls forward on."""

    def forward_context(self) -> ContextManager:
        """Around forward: autocast where this strategy uses it."""

    def accumulate(self, *, sync: bool) -> ContextManager:
        """Around forward+backward of one micro-batch; sync=False skips gradient reduction."""

    def backward(self, loss_share: torch.Tensor) -> None: ...

    def step(self, *, max_grad_norm: float | None) -> StepResult:
        """Clip, optimizer step, schedule step, zero grads."""

    def lr(self) -> float: ...

    def replicated_parameters(self) -> Iterable[tuple[str, torch.Tensor]]:
        """Parameters every rank holds a full identical copy of (for the replica consistency check)."""

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Collective: the full model weights on CPU on rank 0 (fp32 masters where kept), None elsewhere."""

    def export_module(self) -> nn.Module:
        """The unwrapped transformers model (its config and save_pretrained are used for export)."""

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """This rank's tensors holding parameters, gradients and optimizer state (for exact byte counts)."""

    def precision_audit(self) -> dict[str, str]:
        """Dtypes read from the live objects: forward params, master weights, grads, reduction, optimizer state."""

    def close(self) -> None:
        """After the last output is written: release the wrapped model, optimizer and engine, which hold
        the process group, so that destroy_process_group can free it."""


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one flat buffer count once)."""
    seen: dict[tuple, int] = {}
    for tensor in tensors:
        if tensor is None:
            continue
        local = getattr(tensor, "_local_tensor", tensor)  # DTensor: this rank's shard
        storage = local.untyped_storage()
        if storage.nbytes() == 0:
            continue
        seen[(local.device.type, storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values()
            if torch.is_tensor(v) and v.dim() > 0]


def dtype_name(dtype: torch.dtype | None) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", None: "n/a"}.get(
        dtype, str(dtype).replace("torch.", ""))


def first_dtype(tensors: Iterator[torch.Tensor] | Iterable[torch.Tensor]) -> torch.dtype | None:
    return next((t.dtype for t in tensors if t is not None and t.is_floating_point()), None)


def no_context() -> ContextManager:
    return contextlib.nullcontext()


def cpu_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}
