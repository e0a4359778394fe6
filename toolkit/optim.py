"""AdamW with decay/no-decay groups, and the warm-up + cosine/linear/constant schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from toolkit.recipe import OptimConfig


def param_groups(model: nn.Module, config: OptimConfig) -> list[dict]:
    """Weight decay on matrices only: biases and norm weights (1-D) are not decayed."""
    decay, no_decay = [], []
    for _, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (decay if param.dim() >= 2 else no_decay).append(param)
    return [{"params": decay, "weight_decay": config.weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_adamw(model: nn.Module, config: OptimConfig) -> torch.optim.Optimizer:
    # foreach=False: the same per-tensor arithmetic for plain, DTensor and offloaded params,
    # so strategies can be compared bit for bit in fp32
    return torch.optim.AdamW(param_groups(model, config), lr=config.lr, betas=config.betas, eps=config.eps,
                             foreach=False)


def lr_factor(step: int, *, config: OptimConfig, total_steps: int) -> float:
    """Multiplier of optim.lr at optimizer step `step` (0-based)."""
    if step < config.warmup_steps:
        return (step + 1) / (config.warmup_steps + 1)
    if config.schedule == "constant":
        return 1.0
    span = max(1, total_steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / span)
    shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if config.schedule == "cosine" else 1.0 - progress
    return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * shape


def build_scheduler(optimizer: torch.optim.Optimizer, *, config: OptimConfig, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, config=config, total_steps=total_steps))
