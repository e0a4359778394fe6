"""The optimizers a ZeRO run steps with: the recipe's AdamW handed to DeepSpeed as its client optimizer (as
DeepSpeed's CPU Adam when the optimizer is offloaded), or the one a ds_config block names, which DeepSpeed builds;
and the name of whichever ran, for the precision audit."""

from __future__ import annotations

import torch

from toolkit.strategies.base import optimizer_label


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
