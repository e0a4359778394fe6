"""Strategy names and which recipe options each one reads (no torch import: the recipe uses this)."""

from __future__ import annotations

import dataclasses

from toolkit.errors import RecipeError

STRATEGY_NAMES = ("single", "dp", "ddp", "fsdp", "zero")
ONE_PROCESS = ("single", "dp")  # strategies that run in exactly one process

# what each strategy holds per rank and what it trades (`toolkit strategies` prints this)
SUMMARIES = {
    "single": "one process, full model; the reference every other strategy is checked against",
    "dp": "torch.nn.DataParallel: one process splits each batch over the visible GPUs; full model on GPU 0",
    "ddp": "DistributedDataParallel: a full replica per rank, gradients all-reduced; fastest when the model fits",
    "fsdp": "FSDP2 fully_shard per block: params, grads, optimizer state sharded 1/N; all-gathers per block",
    "zero": "DeepSpeed ZeRO: stage 1 shards optimizer state, 2 + gradients, 3 + parameters; optional CPU offload",
}

# strategy.<option> -> the strategies that read it
OPTION_OWNERS = {
    "find_unused_parameters": ("ddp",),
    "bucket_cap_mb": ("ddp",),
    "reshard_after_forward": ("fsdp",),
    "cpu_offload": ("fsdp",),
    "replicate_degree": ("fsdp",),
    "blocks": ("fsdp",),
    "stage": ("zero",),
    "offload_optimizer": ("zero",),
    "offload_param": ("zero",),
    "ds_config": ("zero",),
}

# Short arm names for `toolkit compare --strategies`: name -> recipe overrides.
ARM_ALIASES = {
    "single": ("strategy.name=single",),
    "dp": ("strategy.name=dp",),
    "ddp": ("strategy.name=ddp",),
    "fsdp": ("strategy.name=fsdp",),
    "fsdp-noreshard": ("strategy.name=fsdp", "strategy.reshard_after_forward=false"),
    "fsdp-offload": ("strategy.name=fsdp", "strategy.cpu_offload=true"),
    "zero0": ("strategy.name=zero", "strategy.stage=0"),
    "zero1": ("strategy.name=zero", "strategy.stage=1"),
    "zero2": ("strategy.name=zero", "strategy.stage=2"),
    "zero3": ("strategy.name=zero", "strategy.stage=3"),
    "zero2-offload": ("strategy.name=zero", "strategy.stage=2", "strategy.offload_optimizer=true"),
    "zero3-offload": ("strategy.name=zero", "strategy.stage=3", "strategy.offload_optimizer=true",
                      "strategy.offload_param=true"),
}


def check_strategy_options(config) -> None:
    """An option set away from its default for a strategy that ignores it is a mistake, not a no-op."""
    for f in dataclasses.fields(config):
        owners = OPTION_OWNERS.get(f.name)
        if owners is None or config.name in owners:
            continue
        if getattr(config, f.name) != f.default:
            raise RecipeError(
                f"strategy.{f.name} applies to {'/'.join(owners)} only, but strategy.name is {config.name}; "
                f"remove it or set strategy.name={owners[0]}")
    if config.name == "zero":
        if config.stage is not None and config.stage not in (0, 1, 2, 3):
            raise RecipeError(f"strategy.stage must be 0, 1, 2 or 3, got {config.stage}")
        if config.offload_param and config.stage not in (3, None):
            raise RecipeError("strategy.offload_param needs strategy.stage=3; DeepSpeed offloads parameters only under ZeRO-3")
        if config.offload_optimizer and config.stage == 0:  # stage None: the ds_config's or 2
            raise RecipeError("strategy.offload_optimizer needs strategy.stage >= 1")
    if config.name == "fsdp" and config.replicate_degree < 1:
        raise RecipeError("strategy.replicate_degree must be >= 1")
