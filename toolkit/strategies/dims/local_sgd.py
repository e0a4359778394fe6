"""Local SGD and DiLoCo (strategy.sync_every) for DDP's replicas, a pipeline's stage replicas and HSDP's replica
groups: the replicas step alone on their own gradients (DDP's reduction off; HSDP: the reduce-scatter within a
replica group, no all-reduce across them) and average their parameters every `sync_every` steps and at the run's
last step, as torch's `model_averaging.utils.average_parameters` (what its PeriodicModelAverager calls) does it;
HSDP's ranks average their own shards with the ranks holding the same shards in the other replica groups. `outer_optimizer: nesterov` is
DiLoCo's outer step: the average's distance from the parameters of the last sync is an outer gradient, which SGD
with Nesterov momentum (`outer_lr`, `outer_momentum`) applies to those parameters; every replica then starts from
the result.

Between syncs the replicas differ by design: the replica check measures how far (observe/consistency.drift) instead
of stopping the run, and at a sync step it still demands identical parameters. Each rank's own parameters and
optimizer state differ too, so they go into the checkpoint per rank (CommunicationState): a run resumed mid-window
continues as the uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import io
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from toolkit.cost.collectives import Collective
from toolkit.memory.state_bytes import ADAM_MOMENTS, StateBytes
from toolkit.checkpoint.verify import load_blob
from toolkit.errors import RecipeError

OUTER_OPTIMIZERS = ("average", "nesterov")
DILOCO_OUTER_LR = 0.7  # DiLoCo's (Douillard et al. 2023) outer learning rate, with momentum 0.9


@dataclass(frozen=True, kw_only=True)
class LocalSgdConfig:
    every: int = 1
    outer: str = "average"
    outer_lr: float | None = None
    outer_momentum: float = 0.9

    @property
    def on(self) -> bool:
        return self.every > 1

    def check(self, *, compression: str, precision: str) -> None:
        if self.every < 1:
            raise RecipeError(f"strategy.sync_every must be >= 1 (1: every step, plain DDP), got {self.every}")
        if self.outer not in OUTER_OPTIMIZERS:
            raise RecipeError(f"strategy.outer_optimizer must be one of {', '.join(OUTER_OPTIMIZERS)}, got "
                              f"{self.outer!r}")
        if self.outer_lr is not None and self.outer != "nesterov":
            raise RecipeError("strategy.outer_lr is the Nesterov outer step's rate: set "
                              "strategy.outer_optimizer=nesterov, or drop strategy.outer_lr")
        if self.outer != "average" and not self.on:
            raise RecipeError(f"strategy.outer_optimizer={self.outer} needs strategy.sync_every > 1 (the outer step "
                              "runs at each sync)")
        if self.on and precision == "fp16":  # each rank's scaler would skip its own steps: syncs out of step
            raise RecipeError("strategy.sync_every > 1 is not available with precision fp16: each replica's loss "
                              "scaler would skip other steps; use precision bf16 or fp32")
        if self.on and compression != "none":
            raise RecipeError("strategy.sync_every > 1 reduces no gradients, so strategy.gradient_compression has "
                              "nothing to compress; drop one of them")

    def describe(self) -> str:
        if self.outer == "nesterov":
            return (f"local SGD, parameters synced every {self.every} steps by DiLoCo's Nesterov outer step (lr "
                    f"{self.outer_lr or DILOCO_OUTER_LR:g}, momentum {self.outer_momentum:g})")
        return f"local SGD, parameters averaged every {self.every} steps"


OUTER_COPIES = 2  # DiLoCo's anchor (the parameters at the last sync) and its outer momentum buffer


def outer_state(states: list[StateBytes], config: LocalSgdConfig) -> list[StateBytes]:
    """Each rank's model states with what DiLoCo's outer step keeps beside the inner AdamW: the anchor and the
    momentum buffer, each as big as the rank's trained parameters, which AdamW's moments are too (ADAM_MOMENTS of
    them, in the same dtype and layout: HSDP's unpadded shards, a pipeline rank's stages). Nothing for plain
    averaging."""
    if not (config.on and config.outer == "nesterov"):
        return states
    return [dataclasses.replace(s, optim_bytes=s.optim_bytes + OUTER_COPIES * s.optim_bytes // ADAM_MOMENTS)
            for s in states]


def local_sgd_collectives(param_bytes: int, config: LocalSgdConfig, *, group_size: int) -> list[Collective]:
    """What a rank's replicas send at a sync (the step the counter counts; none between syncs): its `param_bytes`
    of parameters averaged in one all-reduce, and the float64 sum of their squared norms (the drift before it).
    Each runs every `config.every` steps: the step-time model charges a step 1/every of them."""
    return [Collective(op="allreduce_", payload_bytes=param_bytes, calls=1, group="dp_replicate",
                       group_size=group_size, phase="step", what=f"parameters averaged (every {config.every} steps)",
                       every=config.every),
            Collective(op="allreduce_", payload_bytes=8, calls=1, group="dp_replicate", group_size=group_size,
                       phase="step", what="the replicas' squared norms (their drift before the sync)",
                       every=config.every)]


def average(tensors: list[torch.Tensor], group) -> None:
    """The tensors averaged over `group` in one all-reduce, in place: torch's average_parameters' arithmetic (one flat
    buffer divided by the group's size, then summed), copied back into each tensor. torch's rebinds each one's
    .data instead, which leaves a DTensor's parameter as it was where the tensor is its local part (HSDP: measured,
    the replica groups apart after a sync)."""
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    flat /= dist.get_world_size(group)
    dist.all_reduce(flat, group=group)
    offset = 0
    with torch.no_grad():
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


class LocalSgd:
    """A rank's side of local SGD (see the module's doc). `optimizer`: the inner one, whose state is per rank."""

    def __init__(self, module: nn.Module, config: LocalSgdConfig, *, optimizer: torch.optim.Optimizer,
                 total_steps: int, group=None, across=None,
                 local: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """`group`: the replicas of `module` (default every rank); `across`: the ranks holding the model's other
        parts (a pipeline replica's stages, an HSDP replica group's other shards), over which the drift is added
        up, or None where `module` is whole. `local`: a parameter (and an optimizer state tensor) -> the part this
        rank holds, which is averaged, saved and loaded (HSDP's DTensor -> its shard, taken afresh each time:
        FSDP2 may re-point a parameter's shard at its first forward); None: the tensor itself."""
        self.config, self.optimizer, self.total_steps, self.group = config, optimizer, total_steps, group
        self.across, self.local = across, local
        self.named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.steps = 0  # optimizer steps taken
        self.synced = True  # whether the replicas were made equal after the last step
        self.anchor: list[torch.Tensor] = []
        self.outer: torch.optim.SGD | None = None
        if config.outer == "nesterov":
            self.anchor = [p.detach().clone() for p in self._params()]
            self.outer = torch.optim.SGD(self.anchor, lr=config.outer_lr or DILOCO_OUTER_LR,
                                         momentum=config.outer_momentum, nesterov=True)
            # made now, not at the first sync: the memory the run holds from its start (as toolkit plan counts it).
            # SGD's first step then makes it 0·momentum + gradient, the gradient itself: what it would have cloned
            for anchor in self.anchor:
                self.outer.state[anchor]["momentum_buffer"] = torch.zeros_like(anchor)

    def _params(self) -> list[torch.Tensor]:
        """What this rank holds of each trained parameter (the parameter itself, or its local part)."""
        return [self._held(p) for _, p in self.named]

    def state_tensors(self) -> list[torch.Tensor]:
        """What this lever keeps beside the inner optimizer: DiLoCo's anchor and outer momentum (outer_state)."""
        if self.outer is None:
            return []
        buffers = [self.outer.state.get(a, {}).get("momentum_buffer") for a in self.anchor]
        return self.anchor + [b for b in buffers if b is not None]  # (a checkpoint from before the first sync of
        # an older toolkit has none: SGD then makes each at the first sync)

    def sync_due(self, step: int) -> bool:
        return step % self.config.every == 0 or step == self.total_steps

    def after_step(self) -> float | None:
        """After the inner optimizer's step: average (and the outer step) where a sync is due. Returns, at a sync,
        how far the replicas were apart just before it: rms over ranks of ‖replica − mean‖ / ‖mean‖, from
        Σ_ranks ‖replica‖² − W·‖mean‖² (one float64 all-reduce beside the average's, no copy of the
        model)."""
        self.steps += 1
        self.synced = self.sync_due(self.steps)
        if not self.synced:
            return None
        params = self._params()
        squares = torch.zeros(1, dtype=torch.float64, device=params[0].device)
        for p in params:
            squares += p.detach().double().pow(2).sum()
        average(params, self.group)
        dist.all_reduce(squares, group=self.group)
        world = dist.get_world_size(self.group)
        mean_squared = sum(float(p.detach().double().pow(2).sum()) for p in params)
        parts = torch.tensor([max(float(squares[0]) / world - mean_squared, 0.0), mean_squared], dtype=torch.float64,
                             device=squares.device)
        if self.across is not None:  # the whole model's: every part's sums added up
            dist.all_reduce(parts, group=self.across)
        spread, mean_squared = float(parts[0]), float(parts[1])
        drift = spread ** 0.5 / mean_squared ** 0.5 if mean_squared else 0.0
        if self.outer is not None:
            self._outer_step(params)
        return drift

    def _outer_step(self, params: list[torch.Tensor]) -> None:
        assert self.outer is not None
        with torch.no_grad():
            for anchor, param in zip(self.anchor, params):
                anchor.grad = anchor - param  # the outer gradient: where the average went, reversed
            self.outer.step()
            for anchor, param in zip(self.anchor, params):
                param.copy_(anchor)

    def state_bytes(self) -> bytes:
        buffer = io.BytesIO()
        torch.save({"steps": self.steps, "synced": self.synced,
                    "params": {n: p.detach().cpu() for (n, _), p in zip(self.named, self._params())},
                    "optimizer": self._optimizer_state(),
                    "anchor": [a.cpu() for a in self.anchor],
                    "outer": self.outer.state_dict() if self.outer is not None else None}, buffer)
        return buffer.getvalue()

    def load_bytes(self, blob: bytes) -> None:
        saved: dict[str, Any] = load_blob(blob)  # written by state_bytes
        self.steps, self.synced = saved["steps"], saved["synced"]
        with torch.no_grad():
            for (name, _), param in zip(self.named, self._params()):
                param.copy_(saved["params"][name])
            for anchor, value in zip(self.anchor, saved["anchor"]):
                anchor.copy_(value)
        self._load_optimizer_state(saved["optimizer"])
        if self.outer is not None and saved["outer"] is not None:
            load_keeping_settings(self.outer, saved["outer"])

    def _optimizer_state(self) -> dict:
        """The inner optimizer's state, this rank's own: its state dict, or where parameters have a local part (HSDP)
        each trained parameter's state tensors as this rank holds them (a DTensor state dict would name the mesh)."""
        if self.local is None:
            return self.optimizer.state_dict()
        return {"local": [{key: self._held(value).detach().cpu().clone() if isinstance(value, torch.Tensor) else value
                           for key, value in self.optimizer.state.get(p, {}).items()} for _, p in self.named]}

    def _load_optimizer_state(self, saved: dict) -> None:
        if self.local is None:
            load_keeping_settings(self.optimizer, saved)
            return
        # the checkpoint's optimizer state was loaded first (DCP: one replica group's, the others' shards deduplicated
        # away): each state tensor is there to be overwritten with this rank's own
        for (name, p), held in zip(self.named, saved["local"]):
            state = self.optimizer.state[p]
            if set(state) != set(held):
                raise RuntimeError(f"local SGD's saved optimizer state of {name} holds {sorted(held)}, the loaded "
                                   f"one {sorted(state)}")
            for key, value in held.items():
                if isinstance(value, torch.Tensor):
                    with torch.no_grad():
                        self._held(state[key]).copy_(value)
                else:
                    state[key] = value

    def _held(self, value: torch.Tensor) -> torch.Tensor:
        """What this rank holds of `value`: a DTensor's local part where the parameters have one, else itself."""
        return self.local(value) if self.local is not None and isinstance(value, DTensor) else value


def load_keeping_settings(optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """`saved`'s state into `optimizer`, its parameter groups' settings (lr where the resumed schedule set it,
    weight decay, betas: this recipe's) kept: torch's load_state_dict takes the saved run's, so a resumed local
    SGD run ignored a changed weight_decay or betas, and its first step ran at the saved lr."""
    settings = [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
    optimizer.load_state_dict(saved)
    for group, kept in zip(optimizer.param_groups, settings):
        group.update(kept)
