"""`dp`: torch.nn.DataParallel, one process driving every visible GPU.

DataParallel splits each micro-batch over the GPUs and sums gradients onto the first one, so the
loss needs no rescaling: the process sees one batch and one loss. Over fewer than 2 GPUs (on CPU) it
is the plain module: the run is strategy single's, and says so (the warning at start, the precision
audit, run.json's `fallback`).
"""

from __future__ import annotations

import torch
from torch import nn

from toolkit.config.parallel import Degrees
from toolkit.config.recipe import Recipe
from toolkit.config.strategy_options import NoOptions, option_names
from toolkit.strategies.base import SetupArgs, StrategyInfo
from toolkit.strategies.replicated import ReplicatedRules, ReplicatedStrategy, Replication

OPTIONS = NoOptions  # reads no strategy.<option> key

INFO = StrategyInfo(
    name="dp", one_process=True, holds_gradients=False, tied_gradients=2, exports_in_place=True, options=option_names(OPTIONS),
    summary="torch.nn.DataParallel: one process splits each batch over the visible GPUs; full model on GPU 0",
    arms={"dp": ("strategy.name=dp",)})


def runs_as_single() -> str | None:
    """Why this machine runs dp as strategy single, in one line; None where DataParallel splits batches (2+ GPUs)."""
    gpus = torch.cuda.device_count()
    if gpus > 1:
        return None
    where = "one GPU" if gpus == 1 else "the CPU (no CUDA device)"
    return (f"strategy dp needs 2+ CUDA devices; this machine has {gpus}, so it runs as one process on {where}, "
            "like strategy single")


def wrap_data_parallel(module: nn.Module, args: SetupArgs) -> nn.Module:
    # DataParallel over one device is the plain module: the run says so (run.json's `fallback`, a warning)
    return nn.DataParallel(module) if runs_as_single() is None else module


DP = Replication(info=INFO, wrap=wrap_data_parallel, reduce_desc="sum onto GPU 0 ({dtype})",
                 runs_as_single=runs_as_single,
                 single_reduce_desc="none: one process; dp without 2+ CUDA devices runs as single")


RULES = ReplicatedRules(DP)


def build(recipe: Recipe) -> ReplicatedStrategy:
    return ReplicatedStrategy(DP)


def degrees(recipe: Recipe, *, world_size: int) -> Degrees:
    return Degrees()  # one process: its replicas are devices of the process, not ranks of a mesh
