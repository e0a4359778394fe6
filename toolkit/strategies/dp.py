"""`dp`: torch.nn.DataParallel, one process driving every visible GPU (on CPU it runs the module as is).

DataParallel splits each micro-batch over the GPUs and sums gradients onto the first one, so the
loss needs no rescaling: the process sees one batch and one loss.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from toolkit.strategies.base import SetupArgs, StrategyInfo
from toolkit.recipe import Recipe
from toolkit.strategies.replicated import Replication, ReplicatedStrategy

INFO = StrategyInfo(
    name="dp", one_process=True, holds_gradients=False, tied_gradients=2, exports_in_place=True,
    summary="torch.nn.DataParallel: one process splits each batch over the visible GPUs; full model on GPU 0",
    arms={"dp": ("strategy.name=dp",)})


def wrap_data_parallel(module: nn.Module, args: SetupArgs) -> nn.Module:
    gpus = torch.cuda.device_count()
    if gpus > 1:
        return nn.DataParallel(module)
    if args.env.is_main:  # DataParallel over one device is the plain module: say so rather than pretend
        where = "one GPU" if gpus == 1 else "the CPU (no CUDA device)"
        print(f"[toolkit] warning: strategy dp needs 2+ CUDA devices; this machine has {gpus}, so it runs as "
              f"one process on {where}, like strategy single", file=sys.stderr, flush=True)
    return module


DP = Replication(info=INFO, wrap=wrap_data_parallel, reduce_desc="sum onto GPU 0 ({dtype})")


def build(recipe: Recipe) -> ReplicatedStrategy:
    return ReplicatedStrategy(DP)
