"""The Strategy protocol: everything the loop, the launcher and the report need from a parallel strategy.

The loop calls, per optimizer step:
    with strategy.accumulate(sync=is_last_micro_batch):
        with strategy.forward_context(): logits = strategy.model(**inputs)
        strategy.backward(loss_share)
    strategy.step(max_grad_norm=...)

`loss_share` is this micro-batch's share of the global-batch mean loss, already scaled by the loop for
the strategy's gradient reduction (see `StrategyInfo.averages_gradients`): whatever the strategy's
collective does, the gradient every rank ends up with is the gradient of the global-batch mean.

A strategy is one module in this package exposing `INFO` and `build()`, plus one line in the registry
(`toolkit/strategies/__init__.py`). Nothing outside this package compares strategy names.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Iterable, Iterator, Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from toolkit.dist import DistEnv
from toolkit.precision import StepResult
from toolkit.recipe import Recipe

class OptimizerFactory(Protocol):
    def __call__(self, model: nn.Module, *, fused_ok: bool = True) -> torch.optim.Optimizer:
        """The recipe's AdamW over `model`; fused_ok=False where the strategy's step cannot drive a fused one."""


SchedulerFactory = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]


@dataclass(frozen=True, kw_only=True)
class StrategyInfo:
    """What a strategy is, for `toolkit strategies`, recipe checks and `toolkit compare`."""

    name: str
    summary: str  # what each rank holds and what it trades, one line
    options: tuple[str, ...] = ()  # the strategy.<option> recipe keys it reads
    arms: dict[str, tuple[str, ...]] = field(default_factory=dict)  # compare arm name -> recipe overrides
    one_process: bool = False  # runs in exactly one process (a compare arm of it gets 1 rank)
    averages_gradients: bool = False  # its reduction averages over ranks: the loop scales the loss by the world size
    accelerate_plugin: str | None = None  # the `accelerate launch` plugin it runs (fsdp, deepspeed)


@dataclass(frozen=True, kw_only=True)
class SetupArgs:
    recipe: Recipe
    env: DistEnv
    grad_accum_steps: int
    total_steps: int
    build_optimizer: OptimizerFactory  # the recipe's AdamW (groups, implementation): every strategy uses it
    build_scheduler: SchedulerFactory  # the recipe's warm-up + decay schedule, stepped once per optimizer step


@dataclass(frozen=True, kw_only=True)
class Replicas:
    """Tensors that several ranks hold identical copies of, and the group of ranks that hold them."""

    named: list[tuple[str, torch.Tensor]]
    group: object | None  # a torch.distributed ProcessGroup; None = every rank
    description: str  # e.g. "2 ranks hold full replicas"


class Strategy(Protocol):
    info: StrategyInfo

    def validate(self, recipe: Recipe, *, world_size: int) -> None:
        """Raise RecipeError for a recipe this strategy cannot run at this world size. No process group
        exists yet: the launcher runs it before any rank starts, and every rank again before setup."""

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

    def replicas(self) -> Replicas | None:
        """What ranks hold identical copies of (the replica consistency check compares them); None when
        nothing is replicated (one process, or every rank holds a different shard)."""

    def gradient_abs_max(self) -> dict[str, float] | None:
        """Collective, after the last backward of a step and before step(): per parameter name, the largest
        |element| of its full gradient over all ranks. None where this strategy cannot read full gradients."""

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


def optimizer_label(optimizer: torch.optim.Optimizer) -> str:
    """"torch AdamW (fused)": the class and the implementation that runs its step."""
    defaults = optimizer.defaults
    impl = "fused" if defaults.get("fused") else "foreach" if defaults.get("foreach") else "loop"
    return f"torch {type(optimizer).__name__} ({impl})"


def first_dtype(tensors: Iterator[torch.Tensor] | Iterable[torch.Tensor]) -> torch.dtype | None:
    return next((t.dtype for t in tensors if t is not None and t.is_floating_point()), None)


def no_context() -> ContextManager:
    return contextlib.nullcontext()


def cpu_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}


def local_abs_max(named_grads: Iterable[tuple[str, torch.Tensor | None]]) -> dict[str, float]:
    """Largest |element| per named gradient (DTensor: this rank's shard); one device sync for all."""
    names, maxima = [], []
    for name, grad in named_grads:
        if grad is None:
            continue
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        names.append(name)
        maxima.append(local.detach().abs().max().float() if local.numel() else local.new_zeros((), dtype=torch.float32))
    if not names:
        return {}
    values = torch.stack(maxima).double().cpu().tolist()  # device sync: only on steps that record it
    return dict(zip(names, values))
