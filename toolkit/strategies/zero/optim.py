"""The optimizers a ZeRO run steps with: the recipe's AdamW handed to DeepSpeed as its client optimizer (as
DeepSpeed's CPU Adam when the optimizer is offloaded), or the one a ds_config block names, which DeepSpeed builds;
the name of whichever ran, for the precision audit; and the DeepSpeed op it loads, where DeepSpeed must compile it
first.

DeepSpeed compiles its ops with ninja the first time a process loads them (unless it was installed with them
built: DS_BUILD_OPS), into torch's extensions cache: CPU Adam for an offloaded optimizer, FusedAdam for a JSON's
Adam/AdamW block (measured on this 2-core machine: 40 s and 80 s). The first run on a machine then sat silent for
that long before its first step; engine.setup says so in one line first.
"""

from __future__ import annotations

from pathlib import Path

import torch

from toolkit.strategies.base import optimizer_label
from toolkit.strategies.zero.json_checks import OPTIMIZER_OPS, op_missing


def optimizer_label_of(optimizer) -> str:
    """What ran the step: torch's AdamW (and its implementation), or DeepSpeed's own optimizer by name."""
    if type(optimizer).__module__.startswith("torch.optim"):
        return optimizer_label(optimizer)
    names = {"DeepSpeedCPUAdam": "fused CPU Adam", "FusedAdam": "FusedAdam"}
    name = type(optimizer).__name__
    mode = getattr(optimizer, "adamw_mode", getattr(optimizer, "adam_w_mode", None))
    return f"DeepSpeed {names.get(name, name)}" + ("" if mode is None else " (AdamW)" if mode else " (Adam)")


def cpu_adam_like(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The recipe's AdamW (its parameter groups, lr, betas, eps, weight decay) as DeepSpeed's vectorised
    CPU Adam, which DeepSpeed requires for an offloaded optimizer step (JIT-built once)."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    defaults = optimizer.defaults
    groups = [{k: v for k, v in group.items() if k in ("params", "lr", "weight_decay", "betas", "eps")}
              for group in optimizer.param_groups]
    return DeepSpeedCPUAdam(groups, lr=defaults["lr"], betas=defaults["betas"], eps=defaults["eps"],
                            weight_decay=defaults["weight_decay"], adamw_mode=True)


def optimizer_op(config: dict, *, offload_optimizer: bool) -> str | None:
    """The op builder (DeepSpeed's class name) the run's optimizer loads: the JSON optimizer block's type's, or
    CPU Adam where the recipe's AdamW is offloaded (optim.cpu_adam_like); None for a torch optimizer."""
    block = config.get("optimizer")
    if block is None:
        return "CPUAdamBuilder" if offload_optimizer else None
    name = str(block.get("type", "")).lower()
    if name not in OPTIMIZER_OPS or block.get("params", {}).get("torch_adam"):
        return None
    return OPTIMIZER_OPS[name][offload_optimizer]


def to_compile(builder_name: str | None) -> tuple[str, Path] | None:
    """(the op's name, the folder it is compiled into) where loading it compiles it: neither installed with
    DeepSpeed nor in torch's extensions cache (TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions). None where it is
    built, or is no op of this accelerator (json_checks refuses that before ranks start)."""
    if builder_name is None or op_missing(builder_name) is not None:
        return None
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import installed_ops
    from torch.utils.cpp_extension import _get_build_directory

    builder = get_accelerator().get_op_builder(builder_name)
    name = getattr(builder, "NAME", None)
    if name is None or installed_ops.get(name):
        return None
    folder = Path(_get_build_directory(name, verbose=False))  # where torch's load builds it (it makes the folder)
    return None if (folder / f"{name}.so").exists() else (name, folder)
