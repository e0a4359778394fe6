"""Runs under `accelerate launch`: map its FSDP / DeepSpeed plugin settings (environment variables the
launcher sets from its config file) onto recipe keys. A value the recipe sets differently is an error.

Honoured: ACCELERATE_MIXED_PRECISION; ACCELERATE_USE_FSDP with FSDP_VERSION (must be 2),
FSDP_RESHARD_AFTER_FORWARD, FSDP_OFFLOAD_PARAMS, FSDP_TRANSFORMER_CLS_TO_WRAP; ACCELERATE_USE_DEEPSPEED
with ACCELERATE_DEEPSPEED_ZERO_STAGE, ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE,
ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE, ACCELERATE_DEEPSPEED_CONFIG_FILE,
ACCELERATE_GRADIENT_ACCUMULATION_STEPS, ACCELERATE_GRADIENT_CLIPPING.
"""

from __future__ import annotations

import dataclasses

from toolkit.errors import RecipeError
from toolkit.recipe import StrategyConfig
from toolkit.strategies import strategy_for_plugin

DEFAULT_STRATEGY = next(f.default for f in dataclasses.fields(StrategyConfig) if f.name == "name")

PRECISION = {"no": "fp32", "fp32": "fp32", "bf16": "bf16", "fp16": "fp16"}


def _flag(value: str) -> bool:
    return value.strip().lower() in ("1", "true", "yes")


def _device_flag(value: str) -> bool:
    return value.strip().lower() not in ("none", "", "false")


def launcher_settings(environ) -> list[tuple[str, object, str]]:
    """(recipe key, value, where it came from) for every Accelerate setting present in `environ`."""
    out: list[tuple[str, object, str]] = []

    def take(var: str, key: str, convert=str):
        if environ.get(var) not in (None, "", "None"):
            out.append((key, convert(environ[var]), var))

    if "ACCELERATE_MIXED_PRECISION" in environ:
        value = environ["ACCELERATE_MIXED_PRECISION"].lower()
        if value not in PRECISION:
            raise RecipeError(f"accelerate mixed_precision {value!r} is not supported; use no, bf16 or fp16")
        out.append(("precision", PRECISION[value], "ACCELERATE_MIXED_PRECISION"))
    if _flag(environ.get("ACCELERATE_USE_FSDP", "")):
        if environ.get("FSDP_VERSION", "2") != "2":
            raise RecipeError("the accelerate config asks for FSDP version 1; the toolkit runs FSDP2 "
                              "(fully_shard): set fsdp_version: 2 in the config file")
        out.append(("strategy.name", strategy_for_plugin("fsdp"), "ACCELERATE_USE_FSDP"))
        take("FSDP_RESHARD_AFTER_FORWARD", "strategy.reshard_after_forward", _flag)
        take("FSDP_OFFLOAD_PARAMS", "strategy.cpu_offload", _flag)
        take("FSDP_TRANSFORMER_CLS_TO_WRAP", "strategy.blocks",
             lambda v: [name.strip() for name in v.split(",") if name.strip()])
    if _flag(environ.get("ACCELERATE_USE_DEEPSPEED", "")):
        out.append(("strategy.name", strategy_for_plugin("deepspeed"), "ACCELERATE_USE_DEEPSPEED"))
        take("ACCELERATE_DEEPSPEED_ZERO_STAGE", "strategy.stage", int)
        take("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "strategy.offload_optimizer", _device_flag)
        take("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "strategy.offload_param", _device_flag)
        take("ACCELERATE_DEEPSPEED_CONFIG_FILE", "strategy.ds_config")
        take("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "batch.grad_accum_steps", int)
        take("ACCELERATE_GRADIENT_CLIPPING", "optim.max_grad_norm", float)
    return out


def apply_launcher_settings(raw: dict, settings: list[tuple[str, object, str]]) -> None:
    """Fill keys the recipe leaves out; a key the recipe sets to another value is a RecipeError."""
    for key, value, source in settings:
        *parents, leaf = key.split(".")
        node = raw
        for part in parents:
            node = node.setdefault(part, {}) if isinstance(node.get(part, {}), dict) else {}
        present = node.get(leaf)
        # a recipe that leaves the strategy at its default lets the launcher's config file choose it
        replaceable = present is None or (key == "strategy.name" and present == DEFAULT_STRATEGY)
        if not replaceable and present != value:
            raise RecipeError(f"accelerate launch sets {key}={value!r} ({source}) but the recipe has "
                              f"{key}={present!r}; change the recipe or the accelerate config file")
        node[leaf] = value
