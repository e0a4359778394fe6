"""`dp`: torch.nn.DataParallel, one process driving every visible GPU (on CPU it runs the module as is).

DataParallel splits each micro-batch over the GPUs and sums gradients onto the first one, so the
loss needs no rescaling: the process sees one batch and one loss.
"""

from __future__ import annotations

import torch
from torch import nn

from toolkit.strategies.base import SetupArgs
from toolkit.strategies.replicated import Replication, ReplicatedStrategy


def wrap_data_parallel(module: nn.Module, args: SetupArgs) -> nn.Module:
    assert args.env.world_size == 1, "dp is single-process; the launcher refuses nproc > 1"
    return nn.DataParallel(module) if torch.cuda.device_count() > 1 else module


DP = Replication(name="dp", wrap=wrap_data_parallel, reduce_desc="sum onto GPU 0 ({dtype})")


def build() -> ReplicatedStrategy:
    return ReplicatedStrategy(DP)
