"""`dp`: torch.nn.DataParallel, one process driving every visible GPU (on CPU it runs the module as is).

DataParallel splits each micro-batch over the GPUs and sums gradients onto the first one, so the
loss needs no rescaling: the process sees one batch and one loss.
"""

from __future__ import annotations

import torch
from torch import nn

from toolkit.strategies.base import SetupArgs, no_context
from toolkit.strategies.replicated import Replicated


class DataParallelStrategy:
    name = "dp"

    def setup(self, model: nn.Module, args: SetupArgs) -> None:
        assert args.env.world_size == 1, "dp is single-process; the launcher refuses nproc > 1"
        self.module = model.to(args.env.device)
        self._model = nn.DataParallel(self.module) if torch.cuda.device_count() > 1 else self.module
        self.core = Replicated(self.module, args, reduce_desc="sum onto GPU 0 ({dtype})")

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
        return self.module

    def state_tensors(self):
        return self.core.state_tensors()

    def precision_audit(self):
        return self.core.precision_audit()
