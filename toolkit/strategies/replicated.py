"""What single, dp and ddp share: full fp32 weights on every rank, autocast, torch AdamW, GradScaler.

Each of those strategies is this one class composed with its own `Replication` (how it wraps the module,
how it reduces gradients): composition, not a base class, so each strategy's module says only what is its own.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import torch
from torch import nn

from toolkit.checkpoint.loading import ModelSource
from toolkit.config.recipe import Recipe
from toolkit.cost.collectives import Collective
from toolkit.errors import RecipeError, ranks_option
from toolkit.memory.state_bytes import StateBytes, adam_state
from toolkit.model.precision import DTYPES, Amp, StepResult, dtype_name
from toolkit.model.tied import first_names
from toolkit.process.dist import DistEnv
from toolkit.strategies.base import (DataLayout, LossSum, Replicas, SetupArgs, Share, StrategyInfo, StrategyReport,
                                     each_micro_batch, every_rank_a_shard, first_dtype, forward_once, local_abs_max,
                                     no_context, whole_stack_activations)
from toolkit.strategies.dims import compression
from toolkit.strategies.dims.compression import Compression, powersgd_state_bytes
from toolkit.strategies.dims.local_sgd import LocalSgd, LocalSgdConfig, outer_state
from toolkit.strategies.optim.torch_optim import CommunicationState, TorchOptim, TorchState


def on_rank_device(module: nn.Module, args: SetupArgs) -> tuple[nn.Module, torch.device, str]:
    """The whole model on this rank's device, which is also where its inputs go."""
    return module.to(args.env.device), args.env.device, f"the whole model on {args.env.device}"


@dataclass(frozen=True, kw_only=True)
class Replication:
    info: StrategyInfo
    wrap: Callable[[nn.Module, SetupArgs], nn.Module]  # the unwrapped module (placed) -> what forward calls
    # the model (on CPU) -> (placed model, where inputs go, where it lives in words): one device, or split
    # over several (model parallel)
    place: Callable[[nn.Module, SetupArgs], tuple[nn.Module, torch.device, str]] = on_rank_device
    reduce_desc: str  # for the precision audit; "{dtype}" becomes the gradients' dtype
    skip_sync: Callable[[nn.Module], ContextManager] | None = None  # wrapped -> context without gradient reduction
    check: Callable[[Recipe, int], None] | None = None  # (recipe, world size) -> RecipeError for what it cannot run
    # () -> why this machine runs the strategy as `single` (one process, one device, nothing reduced), in one line,
    # or None where it runs as itself (dp over fewer than 2 GPUs): run.json's `fallback`
    runs_as_single: Callable[[], str | None] | None = None
    single_reduce_desc: str = "none: one process"  # the audit's reduction row when it runs as single
    # (setup's args) -> why what ran is not what the strategy is for, though its code ran as written (a model split
    # whose parts all share one device), or None: run.json's `fallback` too
    one_device: Callable[[SetupArgs], str | None] | None = None
    # (the model on the meta device, the recipe, world size) -> the gradient reduction's collectives in one step
    # (toolkit plan; none in one process)
    collectives: Callable[[nn.Module, Recipe, int], list[Collective]] | None = None
    # the recipe -> the gradient compression its all-reduce runs under (a hook on the wrapped DDP module)
    compression: Callable[[Recipe], Compression] | None = None
    # the recipe -> its local SGD (strategy.sync_every): replicas step alone, parameters averaged every H steps
    local_sgd: Callable[[Recipe], LocalSgdConfig] | None = None


class ReplicatedRules:
    """What a replicated strategy (single, dp, ddp, model parallel) is before any process group: its checks,
    data layout and memory rules (toolkit plan)."""

    def __init__(self, replication: Replication) -> None:
        self.replication = replication

    def info(self, recipe: Recipe) -> StrategyInfo:
        return self.replication.info

    def validate(self, recipe: Recipe, *, world_size: int) -> None:
        info = self.replication.info
        if info.one_process and world_size > 1:
            raise RecipeError(f"strategy {info.name} runs in one process, but {world_size} were asked for; "
                              f"use {ranks_option(1)} or strategy.name=ddp")
        if self.replication.check is not None:
            self.replication.check(recipe, world_size)

    def data_layout(self, recipe: Recipe, *, world_size: int, rank: int) -> DataLayout:
        return every_rank_a_shard(world_size=world_size, rank=rank)

    def predict_state_bytes(self, model: nn.Module, recipe: Recipe, *, world_size: int) -> list[StateBytes]:
        # every process holds the whole model in its load dtype (autocast computes in 16-bit on the side)
        states = [adam_state(model.named_parameters(), dtype=DTYPES[recipe.model.load_dtype])] * world_size
        local = self.replication.local_sgd(recipe) if self.replication.local_sgd and world_size > 1 else None
        if self.replication.compression is not None and world_size > 1:  # PowerSGD's error and factors
            kept = powersgd_state_bytes(model.parameters(), self.replication.compression(recipe),
                                        dtype=DTYPES[recipe.model.load_dtype], steps=recipe.train.max_steps)
            states = [dataclasses.replace(s, optim_bytes=s.optim_bytes + kept) for s in states]
        return outer_state(states, local) if local is not None else states  # DiLoCo's anchor and momentum

    def predict_load_bytes(self, model: nn.Module, recipe: Recipe, *, world_size: int,
                           resuming: bool = False) -> list[int]:
        # every rank builds the whole model, and the weights it built are its parameters (in the load dtype,
        # where they stay): nothing beyond its model states
        return [0] * world_size

    def predict_step_bytes(self, model: nn.Module, recipe: Recipe, *, world_size: int,
                           device_type: str) -> list[int]:
        # the recipe's AdamW; fused (what auto resolves to) makes no copy, the per-tensor loop's temporaries
        # (about 2 x the largest parameter) are not counted
        return [0] * world_size

    def predict_gathered_bytes(self, model: nn.Module, recipe: Recipe, *, world_size: int) -> list[int]:
        return [0] * world_size  # every rank holds every parameter

    def predict_collectives(self, model: nn.Module, recipe: Recipe, *, world_size: int, rank: int,
                            shapes: list[tuple[int, int]]) -> list[Collective]:
        reduce = self.replication.collectives
        return reduce(model, recipe, world_size) if reduce is not None and world_size > 1 else []

    def predict_activation_bytes(self, model: nn.Module, recipe: Recipe, *, world_size: int,
                                 how: dict[str, Any]) -> list[int]:
        return whole_stack_activations(model, recipe, world_size=world_size, how=how)


class ReplicatedStrategy:
    def __init__(self, replication: Replication) -> None:
        self.replication = replication
        self.info = replication.info

    def forward_backward(self, micro_batches: list[dict], *, loss_sum: LossSum, share: Share) -> torch.Tensor:
        return each_micro_batch(self, micro_batches, loss_sum=loss_sum, share=share, device=self.input_device)

    def forward_only(self, micro_batches: list[dict], *, loss_sum: LossSum) -> tuple[torch.Tensor, int]:
        return forward_once(self, micro_batches, loss_sum=loss_sum, device=self.input_device)


    def build_model(self, source: ModelSource, *, env: DistEnv) -> nn.Module:
        return source.whole()

    def setup(self, model: nn.Module, args: SetupArgs) -> None:
        self.env = args.env
        self.module, self.input_device, self.placed = self.replication.place(model, args)  # unwrapped, placed
        self.as_single = self.replication.runs_as_single() if self.replication.runs_as_single else None
        self.one_device = self.replication.one_device(args) if self.replication.one_device else None
        self._model = self.replication.wrap(self.module, args)
        self.compression = self.replication.compression(args.recipe) if self.replication.compression else None
        hook: CommunicationState | None = None
        if self.compression is not None and self.compression.on and not self.as_single:
            hook = compression.register(self._model, self.compression,
                                        names={id(p): n for n, p in self.module.named_parameters()})
            compression.warn_if_never(self.compression, total_steps=args.total_steps, is_main=args.env.is_main)
        self.amp = Amp(args.recipe.precision, args.env.device)
        optimizer = args.build_optimizer(self.module)
        self.optim = TorchOptim(optimizer, args.build_scheduler(optimizer), amp=self.amp,
                                names=lambda: first_names(self.module))
        local = self.replication.local_sgd(args.recipe) if self.replication.local_sgd else None
        self.local = LocalSgd(self.module, local, optimizer=optimizer, total_steps=args.total_steps) \
            if local is not None and local.on and args.env.world_size > 1 else None
        if self.local is not None:
            hook = self.local
        self.state = TorchState(self.module, self.optim, env=args.env, gathered=False,
                                replicas=self._replicas, gradient_abs_max=self._gradient_abs_max,
                                audit=self._precision_audit, communication=hook)

    @property
    def model(self) -> nn.Module:
        return self._model

    def report(self) -> StrategyReport:
        return StrategyReport(layout=self._layout(), fallback=self._fallback(), measurements=self._measurements())

    def forward_context(self) -> ContextManager:
        return self.amp.autocast()

    def accumulate(self, *, sync: bool) -> ContextManager:
        if self.local is not None and self.replication.skip_sync is not None:
            return self.replication.skip_sync(self._model)  # local SGD: no gradient is reduced, ever
        if sync or self.replication.skip_sync is None:
            return no_context()
        return self.replication.skip_sync(self._model)

    def backward(self, loss_share) -> None:
        self.amp.backward(loss_share)

    def step(self, *, max_grad_norm: float | None) -> StepResult:
        result = self.optim.step(list(self.module.parameters()), max_grad_norm=max_grad_norm)
        if self.local is not None:
            drift = self.local.after_step()
            return dataclasses.replace(result, drift_before_sync=drift) if drift is not None else result
        return result

    def discard_step(self) -> StepResult:
        self.optim.discard_step()
        # a dropped step still counts toward local SGD's syncs (the last step's is the one that leaves the replicas
        # equal for the export), and a sync on it measures the drift it ended, as any sync does
        drift = self.local.after_step() if self.local is not None else None
        return StepResult.dropped(drift_before_sync=drift)

    def lr(self) -> float:
        return self.optim.lr()

    def _replicas(self) -> list[Replicas]:
        if self.env.world_size == 1:
            return []
        local = self.local
        return [Replicas(named=list(self.module.named_parameters()), group=None,
                         description=f"{self.env.world_size} ranks hold full replicas"
                         + (f", equal after each sync (every {local.config.every} steps)" if local else ""),
                         synced=(lambda: local.synced) if local is not None else None)]

    def _gradient_abs_max(self) -> dict[str, float] | None:
        # after the synced backward every rank holds the full reduced gradient; fp16 grads are still scaled
        maxima = local_abs_max((n, p.grad) for n, p in self.module.named_parameters())
        scale = self.amp.scaler.get_scale() if self.amp.scaler else 1.0
        return {name: value / scale for name, value in maxima.items()}

    def _measurements(self) -> dict:
        return {}

    def _layout(self) -> str:
        world = self.env.world_size
        return self.placed + (f"; a replica on each of {world} ranks" if world > 1 else "")

    def _fallback(self) -> str | None:
        return self.as_single or self.one_device

    def _sent_as(self) -> str:
        if self.local is not None:
            return f", {self.local.config.describe()}"
        return f", {self.compression.describe()}" if self.compression is not None and self.compression.on else ""

    def close(self) -> None:
        del self._model, self.module, self.optim, self.state  # DDP's reducer holds the process group

    def _precision_audit(self) -> dict[str, str]:
        params = list(self.module.parameters())
        master = dtype_name(first_dtype(params))
        compute = master if self.amp.precision == "fp32" else f"{self.amp.precision} (autocast)"
        grads = [p.grad for p in params if p.grad is not None]
        grad_dtype = dtype_name(first_dtype(grads)) if grads else master
        return {
            "forward_params": compute,
            "master_weights": master,
            "gradients": grad_dtype,
            "grad_reduction": (self.replication.single_reduce_desc if self.as_single else
                               self.replication.reduce_desc.format(dtype=grad_dtype + self._sent_as())),
            **self.optim.audit(),
        }

