"""AdamW with decay/no-decay groups, and the warm-up + cosine/linear/constant schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from toolkit.config.recipe import OptimConfig
from toolkit.errors import RecipeError


def param_groups(model: nn.Module, config: OptimConfig) -> list[dict]:
    """Weight decay on matrices only: biases and norm weights (1-D) are not decayed. A parameter ZeRO-3 has
    partitioned as it was created is an empty 1-D placeholder: its own shape is in ds_shape. Each group holds one
    kind of tensor (`_one_kind_each`)."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for _, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (decay if len(getattr(param, "ds_shape", param.shape)) >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": config.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return [part for group in groups for part in _one_kind_each(group)]


def _one_kind_each(group: dict) -> list[dict]:
    """The group, split in two where it mixes DTensors and plain tensors (tp: split layers and replicated norms,
    embeddings, head). fused and foreach AdamW step a group's tensors in one call, which refuses the mix ("got
    mixed torch.Tensor and DTensor"); one group per kind lets every strategy run the same implementation."""
    from torch.distributed.tensor import DTensor

    kinds = [isinstance(p, DTensor) for p in group["params"]]
    if len(set(kinds)) <= 1:
        return [group]
    return [{**group, "params": [p for p, kind in zip(group["params"], kinds) if kind == want]}
            for want in (True, False)]


def build_adamw(model: nn.Module, config: OptimConfig, *, fused_ok: bool = True) -> torch.optim.Optimizer:
    """The recipe's AdamW over `model`; fused_ok=False: the strategy's step cannot drive a fused AdamW."""
    groups = param_groups(model, config)
    implementation = resolve_implementation(config.implementation, [g["params"] for g in groups], fused_ok=fused_ok)
    return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, eps=config.eps,
                             foreach=implementation == "foreach", fused=implementation == "fused" or None)


def resolve_implementation(requested: str, groups: list[list[torch.Tensor]], *, fused_ok: bool = True) -> str:
    """The AdamW implementation to run over the parameter `groups`: `requested`, or for auto the fastest that
    every parameter supports.

    fused (one kernel over a group's tensors) is the fastest on CPU and GPU and needs floating-point tensors of
    one kind per group (all DTensor or all plain: param_groups splits a group that mixes them) on one device type
    with fused kernels. Without it: foreach on GPUs (batched launches), the per-tensor loop on CPU (measured here:
    foreach 2.3× slower than the loop, fused 2× faster, on 60 tensors of 384k fp32 elements). So for one model
    and device every strategy resolves auto alike (fused), tp too (measured here, 2 gloo ranks, tiny Llama,
    5 steps: fused over tp's DTensor and plain groups within 1.2e-7 of the loop, as on a plain model; foreach
    bit-identical to it), except where the strategy's step cannot drive a fused kernel (fsdp and pipeline in
    fp16: `fused_ok`); the precision audit names what ran, and the compare's verdict lists an arm whose
    implementation differs from the reference's."""
    from torch.distributed.tensor import DTensor
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    params = [p for group in groups for p in group]
    devices = {p.device.type for p in params}
    one_kind = len(devices) <= 1 and all(len({isinstance(p, DTensor) for p in group}) <= 1 for group in groups)
    fused = fused_ok and one_kind and all(p.is_floating_point() for p in params) and \
        devices <= set(_get_fused_kernels_supported_devices())
    supported = {"fused": fused, "foreach": one_kind, "loop": True}
    if requested == "auto":
        order = ("fused", "loop") if devices <= {"cpu"} else ("fused", "foreach", "loop")
        return next(impl for impl in order if supported[impl])
    if not supported[requested]:
        why = "a parameter group mixes DTensor and plain tensors, or devices of several types" if not one_kind else \
            "the strategy's step cannot drive it" if not fused_ok else \
            f"no fused AdamW kernel for {', '.join(sorted(devices))} parameters of these dtypes"
        raise RecipeError(f"optim.implementation {requested} cannot run here ({why}); use auto or loop")
    return requested


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


def schedule_label(config: OptimConfig) -> str:
    """The recipe's schedule in words (the precision audit's scheduler row; a compare lists arms that differ)."""
    warmup = f"{config.warmup_steps} warm-up step{'s' if config.warmup_steps != 1 else ''}, then " \
        if config.warmup_steps else ""
    floor = f" to {config.min_lr_ratio:g}× lr" if config.schedule != "constant" and config.min_lr_ratio else ""
    return f"toolkit: {warmup}{config.schedule}{floor} (LambdaLR)"
