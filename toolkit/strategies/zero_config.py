"""The DeepSpeed config of a recipe: generated from it, or an existing JSON with its "auto" values filled
from it the way Accelerate/HF do. Where the JSON and the recipe disagree it is a RecipeError naming both.
The launcher checks this before any rank starts; only the precision check imports (a part of) DeepSpeed."""

from __future__ import annotations

import json
from pathlib import Path

from toolkit.errors import RecipeError
from toolkit.recipe import BatchPlan, Recipe

DEFAULT_STAGE = 2


def recipe_values(recipe: Recipe, plan: BatchPlan) -> dict[str, object]:
    """Dotted DeepSpeed keys -> the value the recipe implies."""
    clip = recipe.optim.max_grad_norm or 0.0
    return {
        "train_micro_batch_size_per_gpu": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.grad_accum_steps,
        "train_batch_size": plan.global_batch_size,
        "gradient_clipping": clip,
        "bf16.enabled": recipe.precision == "bf16",
        "fp16.enabled": recipe.precision == "fp16",
    }


def bucket_sizes(hidden_size: int, *, stage: int) -> dict[str, int]:
    """zero_optimization buckets sized to the model, as transformers and Accelerate fill their "auto": DeepSpeed's
    own defaults (5e8 elements) make ZeRO-3 allocate a 1 GB bf16 gradient bucket per rank whatever the model
    (measured: llama-tiny, 4.6M parameters, held a 1,000,000,000-byte buffer on each rank)."""
    sizes = {"reduce_bucket_size": hidden_size * hidden_size}
    if stage == 3:
        sizes["stage3_prefetch_bucket_size"] = int(0.9 * hidden_size * hidden_size)
        sizes["stage3_param_persistence_threshold"] = 10 * hidden_size  # smaller tensors stay whole on every rank
    return sizes


def hidden_size_of(config) -> int | None:
    """The width buckets are sized by: hidden_size, else the largest of hidden_sizes (as transformers does)."""
    if isinstance(getattr(config, "hidden_size", None), int):
        return config.hidden_size
    sizes = getattr(config, "hidden_sizes", None)
    return max(sizes) if sizes else None


def generated_config(recipe: Recipe, plan: BatchPlan, *, hidden_size: int | None = None) -> dict:
    options = recipe.strategy
    stage = DEFAULT_STAGE if options.stage is None else options.stage
    zero: dict = {"stage": stage, **(bucket_sizes(hidden_size, stage=stage) if hidden_size else {})}
    if options.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    if options.offload_param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": False}
    values = recipe_values(recipe, plan)
    return {
        "train_micro_batch_size_per_gpu": values["train_micro_batch_size_per_gpu"],
        "gradient_accumulation_steps": values["gradient_accumulation_steps"],
        "train_batch_size": values["train_batch_size"],
        "gradient_clipping": values["gradient_clipping"],
        "bf16": {"enabled": values["bf16.enabled"]},
        "fp16": {"enabled": values["fp16.enabled"], "loss_scale": 0, "initial_scale_power": 16},  # 0: dynamic
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,  # the client optimizer is torch AdamW
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }


def resolve_ds_config(recipe: Recipe, plan: BatchPlan, *, hidden_size: int | None = None) -> dict:
    """The config deepspeed.initialize gets; checks the JSON passthrough against the recipe. With the model's
    `hidden_size`, bucket sizes are set (generated) or filled where the JSON says "auto"."""
    if recipe.strategy.ds_config is None:
        return generated_config(recipe, plan, hidden_size=hidden_size)
    path = Path(recipe.strategy.ds_config)
    if not path.is_file():
        raise RecipeError(f"strategy.ds_config: {path} not found; give a DeepSpeed JSON (see ds_configs/)")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise RecipeError(f"strategy.ds_config: {path} is not valid JSON ({exc})") from None
    for key, wanted in recipe_values(recipe, plan).items():
        _fill_or_check(config, key, wanted, path)
    zero = config.setdefault("zero_optimization", {})
    stage = zero.get("stage", DEFAULT_STAGE)
    if recipe.strategy.stage is not None and recipe.strategy.stage != stage:
        raise RecipeError(f"strategy.stage is {recipe.strategy.stage} but {path} has zero_optimization.stage "
                          f"{stage}; drop strategy.stage or make them equal")
    for key, size in (bucket_sizes(hidden_size, stage=stage) if hidden_size else {}).items():
        if zero.get(key) == "auto":
            zero[key] = size
    for option, section in (("offload_optimizer", "offload_optimizer"), ("offload_param", "offload_param")):
        in_json = zero.get(section, {}).get("device", "none") not in ("none", None)
        if getattr(recipe.strategy, option) and not in_json:
            raise RecipeError(f"strategy.{option} is true but {path} has no zero_optimization.{section}; "
                              "add it to the JSON or drop the recipe option")
    if "fp16" in config and config["fp16"].get("enabled"):
        config["fp16"].setdefault("loss_scale", 0)
    config.setdefault("zero_allow_untested_optimizer", True)
    config.setdefault("steps_per_print", 10 ** 9)
    return config


def _fill_or_check(config: dict, dotted: str, wanted, path: Path) -> None:
    *parents, leaf = dotted.split(".")
    node = config
    for part in parents:
        node = node.setdefault(part, {})
    present = node.get(leaf, "auto")  # a key the JSON leaves out is filled like "auto"
    if present == "auto":
        node[leaf] = wanted
        return
    same = float(present) == float(wanted) if isinstance(wanted, (int, float)) else present == wanted
    if not same:
        raise RecipeError(f"{path}: {dotted} is {present!r} but the recipe gives {wanted!r}; "
                          f"set it to \"auto\" in the JSON or change the recipe")


def configured_stage(recipe: Recipe) -> int:
    """The stage a recipe runs: strategy.stage, else its ds_config's, else the default (no batch plan needed)."""
    if recipe.strategy.stage is not None:
        return recipe.strategy.stage
    if recipe.strategy.ds_config is not None:
        try:
            return stage_of(json.loads(Path(recipe.strategy.ds_config).read_text()))
        except (OSError, ValueError):
            return DEFAULT_STAGE  # resolve_ds_config says what is wrong with the file
    return DEFAULT_STAGE


def stage_of(config: dict) -> int:
    return int(config.get("zero_optimization", {}).get("stage", DEFAULT_STAGE))


def offloads(config: dict) -> tuple[bool, bool]:
    zero = config.get("zero_optimization", {})
    return (zero.get("offload_optimizer", {}).get("device", "none") not in ("none", None),
            zero.get("offload_param", {}).get("device", "none") not in ("none", None))


def check_deepspeed_precision(precision: str) -> None:
    """DeepSpeed refuses a dtype its accelerator lacks (fp16 on its CPU accelerator) with a traceback
    from every rank; say it once, with the way out. Imports DeepSpeed's accelerator module only."""
    if precision == "fp32":
        return
    from deepspeed.accelerator import get_accelerator  # DS_ACCELERATOR: see toolkit.launch.prepare_environment

    accelerator = get_accelerator()
    supported = accelerator.is_fp16_supported() if precision == "fp16" else accelerator.is_bf16_supported()
    if not supported:
        other = "bf16" if precision == "fp16" else "fp32"
        raise RecipeError(f"precision {precision} is not supported by DeepSpeed's {accelerator.device_name()} "
                          f"accelerator; use precision: {other} with strategy zero, or strategy fsdp/ddp "
                          f"for {precision}")
