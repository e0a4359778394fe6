"""`single`: one process, one device, no parallelism. The reference every other strategy is checked against."""

from __future__ import annotations

from torch import nn

from toolkit.strategies.base import SetupArgs, no_context
from toolkit.strategies.replicated import Replicated


class SingleStrategy:
    name = "single"

    def setup(self, model: nn.Module, args: SetupArgs) -> None:
        self.env = args.env
        self._model = model.to(args.env.device)
        self.core = Replicated(self._model, args, reduce_desc="none (one process)")

    @property
    def model(self) -> nn.Module:
        return self._model

    def forward_context(self):
        return self.core.amp.autocast()

    def accumulate(self, *, sync: bool):
        return no_context()

    def backward(self, loss_share) -> None:
        self.core.amp.backward(loss_share)

    def step(self, *, max_grad_norm):
        return self.core.step(max_grad_norm=max_grad_norm)

    def lr(self) -> float:
        return self.core.lr()

    def replicated_parameters(self):
        return []

    def full_state_dict(self):
        return self.core.full_state_dict(is_main=True)

    def export_module(self) -> nn.Module:
        return self._model

    def state_tensors(self):
        return self.core.state_tensors()

    def precision_audit(self):
        return self.core.precision_audit()
