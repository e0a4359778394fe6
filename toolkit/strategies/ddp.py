"""`ddp`: DistributedDataParallel, one process per device, full replicas, gradients all-reduced (averaged)."""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from toolkit.strategies.base import SetupArgs, no_context
from toolkit.strategies.replicated import Replicated


class DdpStrategy:
    name = "ddp"

    def setup(self, model: nn.Module, args: SetupArgs) -> None:
        self.env = args.env
        self.module = model.to(args.env.device)
        options = args.recipe.strategy
        device_ids = [args.env.device.index] if args.env.device.type == "cuda" else None
        self._model = DistributedDataParallel(
            self.module, device_ids=device_ids, find_unused_parameters=options.find_unused_parameters,
            bucket_cap_mb=options.bucket_cap_mb)
        self.core = Replicated(self.module, args, reduce_desc="all-reduce mean ({dtype})")

    @property
    def model(self) -> nn.Module:
        return self._model

    def forward_context(self):
        return self.core.amp.autocast()

    def accumulate(self, *, sync: bool):
        # no_sync: keep gradients local on non-final micro-batches; the last backward all-reduces the sum
        return no_context() if sync else self._model.no_sync()

    def backward(self, loss_share) -> None:
        # DDP averages gradients over ranks; loss_share sums to the global mean, so undo the average
        self.core.amp.backward(loss_share * self.env.world_size)

    def step(self, *, max_grad_norm):
        return self.core.step(max_grad_norm=max_grad_norm)

    def lr(self) -> float:
        return self.core.lr()

    def replicated_parameters(self):
        return list(self.module.named_parameters())

    def full_state_dict(self):
        return self.core.full_state_dict(is_main=self.env.is_main)

    def export_module(self) -> nn.Module:
        return self.module

    def state_tensors(self):
        return self.core.state_tensors()

    def precision_audit(self):
        return self.core.precision_audit()
