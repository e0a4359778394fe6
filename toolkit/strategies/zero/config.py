"""The DeepSpeed config of a recipe: generated from it, or an existing JSON with its "auto" values filled
from it the way Accelerate/HF do. Where the JSON and the recipe disagree it is a RecipeError naming both.
The recipe's checks (train/checks.py) check this before training starts. DeepSpeed is imported there only for a precision other than
fp32 (its accelerator) and for a JSON (its own config model checks the JSON's settings): importing any part of
DeepSpeed runs its package __init__, ~0.9 s on top of torch and transformers (measured, CPU)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from toolkit.config.recipe import BatchPlan, Recipe
from toolkit.errors import RecipeError
from toolkit.strategies.zero.json_checks import check_optimizer_ops, check_top_level_keys

# where neither strategy.stage nor the JSON names one: reported, planned and written into the config DeepSpeed
# gets (DeepSpeed's own default is stage 0)
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
        # strategy.reduce_dtype: DeepSpeed's dtype names are the recipe's (fp32, bf16)
        **({"communication_data_type": recipe.strategy.reduce_dtype} if recipe.strategy.reduce_dtype else {}),
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
        **({"communication_data_type": values["communication_data_type"]} if "communication_data_type" in values
           else {}),
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,  # the client optimizer is torch AdamW
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }


def block_values(recipe: Recipe, total_steps: int | None) -> dict[str, tuple[object, bool]]:
    """What an "auto" in a JSON optimizer or scheduler block becomes, the way transformers' DeepSpeed integration
    fills it: dotted key -> (value, whether a number the JSON gives must equal it). A scheduler's own parameters
    the recipe has no value for (warmup_min_lr) are filled, never checked."""
    optim = recipe.optim
    values: dict[str, tuple[object, bool]] = {
        "optimizer.params.lr": (optim.lr, True), "optimizer.params.betas": (list(optim.betas), True),
        "optimizer.params.eps": (optim.eps, True), "optimizer.params.weight_decay": (optim.weight_decay, True),
        "scheduler.params.warmup_min_lr": (0.0, False), "scheduler.params.warmup_max_lr": (optim.lr, True),
        "scheduler.params.warmup_num_steps": (optim.warmup_steps, True),
        "scheduler.params.warmup_min_ratio": (0.0, False), "scheduler.params.cos_min_ratio": (optim.min_lr_ratio, True),
    }
    if total_steps is not None:  # known once the data is read (train.epochs); the launcher's check goes without
        values["scheduler.params.total_num_steps"] = (total_steps, True)
    return values


class _RepeatedKey(ValueError):
    """A key written twice in one JSON object of a ds_config."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    """json's object_pairs_hook: the object, or _RepeatedKey (DeepSpeed refuses such a file given by path, but
    the toolkit hands it a dict, so the check is here)."""
    keys = [key for key, _ in pairs]
    for key in keys:
        if keys.count(key) > 1:
            raise _RepeatedKey(key)
    return dict(pairs)


def resolve_ds_config(recipe: Recipe, plan: BatchPlan, *, hidden_size: int | None = None,
                      total_steps: int | None = None) -> dict:
    """The config deepspeed.initialize gets; checks the JSON passthrough against the recipe. With the model's
    `hidden_size`, bucket sizes are set (generated) or filled where the JSON says "auto". An optimizer or
    scheduler block is DeepSpeed's to build: its "auto" values come from the recipe (block_values)."""
    if recipe.strategy.ds_config is None:
        return generated_config(recipe, plan, hidden_size=hidden_size)
    path = Path(recipe.strategy.ds_config)
    if not path.is_file():
        raise RecipeError(f"strategy.ds_config: {path} not found; give a DeepSpeed JSON (see ds_configs/)")
    try:
        config = json.loads(path.read_text(), object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as exc:
        raise RecipeError(f"strategy.ds_config: {path} is not valid JSON ({exc})") from None
    except _RepeatedKey as exc:
        raise RecipeError(f"strategy.ds_config: {path} has the key {exc.args[0]!r} twice in one object (JSON "
                          "keeps the last without a word); keep one") from None
    if not isinstance(config, dict):
        raise RecipeError(f"strategy.ds_config: {path} holds {type(config).__name__}, not a JSON object of "
                          "DeepSpeed settings")
    for key, wanted in recipe_values(recipe, plan).items():
        _fill_or_check(config, key, wanted, path)
    for key, (wanted, checked) in block_values(recipe, total_steps).items():
        block = config.get(key.split(".")[0])
        if isinstance(block, dict):
            _fill_or_check(config, key, wanted, path, check=checked, fill_missing=False)
    zero = _section(config.setdefault("zero_optimization", {}), "zero_optimization", path)
    if zero.get("stage", "auto") == "auto":  # written: left out, DeepSpeed would run its own default, stage 0
        zero["stage"] = DEFAULT_STAGE if recipe.strategy.stage is None else recipe.strategy.stage
    stage = zero["stage"]
    if not isinstance(stage, int) or isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise RecipeError(f"{path}: zero_optimization.stage must be 0, 1, 2 or 3, not {stage!r}; fix it in the "
                          "JSON or leave it out (strategy.stage, else 2)")
    if recipe.strategy.stage is not None and recipe.strategy.stage != stage:
        raise RecipeError(f"strategy.stage is {recipe.strategy.stage} but {path} has zero_optimization.stage "
                          f"{stage}; drop strategy.stage or make them equal")
    for key, size in (bucket_sizes(hidden_size, stage=stage) if hidden_size else {}).items():
        if zero.get(key) == "auto":
            zero[key] = size
    for option, section in (("offload_optimizer", "offload_optimizer"), ("offload_param", "offload_param")):
        in_json = _section(zero.get(section, {}), f"zero_optimization.{section}", path).get("device", "none") \
            not in ("none", None)
        if getattr(recipe.strategy, option) and not in_json:
            raise RecipeError(f"strategy.{option} is true but {path} has no zero_optimization.{section}; "
                              "add it to the JSON or drop the recipe option")
    if "fp16" in config and _section(config["fp16"], "fp16", path).get("enabled"):
        config["fp16"].setdefault("loss_scale", 0)
    config.setdefault("zero_allow_untested_optimizer", True)
    config.setdefault("steps_per_print", 10 ** 9)
    if zero.get("stage3_gather_16bit_weights_on_model_save") == "auto":  # DeepSpeed's own model save: unused
        zero["stage3_gather_16bit_weights_on_model_save"] = False         # (the toolkit gathers its export)
    # filled at setup, once the model (bucket sizes) and the data (total steps) are known
    later = {f"zero_optimization.{key}" for key in bucket_sizes(1, stage=3)} if hidden_size is None else set()
    later |= {"scheduler.params.total_num_steps"} if total_steps is None else set()
    for key in _autos(config):
        if key not in later:
            raise RecipeError(f"{path}: {key} is \"auto\", which the toolkit cannot fill from the recipe; give it "
                              "a value in the JSON")
    return config


def check_with_deepspeed(config: dict, path: Path) -> None:
    """What deepspeed.initialize would refuse in a JSON, found before training starts: DeepSpeed's own model of
    zero_optimization (a stage outside 0-3, a size that is no number, a key it does not know), an nvme offload
    without its nvme_path (a TypeError in a path join otherwise), an optimizer or scheduler type that its
    engine does not build (an AssertionError otherwise), and what zero_json finds: a top-level key that is a typo
    of one DeepSpeed reads, or one it removed, and an optimizer type with no op on this accelerator."""
    import pydantic
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    check_top_level_keys(config, path)
    later = {key: value for key, value in config.get("zero_optimization", {}).items() if value != "auto"}
    try:  # the "auto" bucket sizes left are filled at setup, from the model
        zero = DeepSpeedZeroConfig(**later)
    except pydantic.ValidationError as exc:
        error = exc.errors()[0]
        key = ".".join(["zero_optimization", *map(str, error["loc"])])
        raise RecipeError(f"{path}: {key} {error.get('input')!r} is refused by DeepSpeed ({error['msg']}); fix it "
                          "in the JSON") from None
    for section in ("offload_optimizer", "offload_param"):
        offload = getattr(zero, section)
        if offload is not None and offload.device == "nvme" and offload.nvme_path is None:
            raise RecipeError(f"{path}: zero_optimization.{section}.nvme_path is missing (device nvme needs it); "
                              "give a folder on an NVMe drive, or use device cpu")
    _check_block_types(config, path)
    _check_warmup(config, path)
    check_optimizer_ops(config, path, offloaded=offloads(config)[0])


WARMUP_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")  # DeepSpeed's, with a warmup_num_steps


def _check_warmup(config: dict, path: Path) -> None:
    """DeepSpeed's warm-up schedulers refuse a warmup_num_steps below 1 (a ValueError in every rank at set-up):
    the recipe's default optim.warmup_steps, 0, filled into the "auto" of transformers' documented JSON was one."""
    scheduler = config.get("scheduler")
    if not isinstance(scheduler, dict) or scheduler.get("type") not in WARMUP_SCHEDULERS:
        return
    steps = _section(scheduler.get("params", {}), "scheduler.params", path).get("warmup_num_steps", 1000)
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise RecipeError(f"{path}: DeepSpeed's {scheduler['type']} needs scheduler.params.warmup_num_steps of 1 or "
                          f"more (it warms up over at least 2 steps), not {steps!r}; set optim.warmup_steps to 1 or "
                          "more (\"auto\" takes it), or drop the JSON's scheduler block to run the recipe's "
                          "optim.schedule, which can start without warm-up")


def _check_block_types(config: dict, path: Path) -> None:
    """The optimizer and scheduler types DeepSpeed's engine builds (engine._is_supported_optimizer and
    _scheduler_from_config): its own, by name, or a torch class of that name."""
    import torch
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS
    from deepspeed.runtime.lr_schedules import VALID_LR_SCHEDULES

    builds = {"optimizer": (lambda name: name.lower() in DEEPSPEED_OPTIMIZERS or hasattr(torch.optim, name),
                            DEEPSPEED_OPTIMIZERS, "torch.optim"),
              "scheduler": (lambda name: name in VALID_LR_SCHEDULES or hasattr(torch.optim.lr_scheduler, name),
                            VALID_LR_SCHEDULES, "torch.optim.lr_scheduler")}
    for block, (built, own, torch_module) in builds.items():
        if block not in config:
            continue
        name = _section(config[block], block, path).get("type")
        if not isinstance(name, str) or not built(name):
            raise RecipeError(f"{path}: {block}.type {name!r} is not one DeepSpeed builds; use one of "
                              f"{', '.join(own)}, or a class name in {torch_module}")


def _section(value, name: str, path: Path) -> dict:
    if not isinstance(value, dict):
        raise RecipeError(f"{path}: {name} must be a JSON object, not {value!r}")
    return value


def _autos(node, prefix: str = "") -> list[str]:
    """The dotted keys still "auto" anywhere in a config."""
    if isinstance(node, dict):
        return [k for key, value in node.items() for k in _autos(value, f"{prefix}{key}.")]
    return [prefix[:-1]] if node == "auto" else []


def _fill_or_check(config: dict, dotted: str, wanted, path: Path, *, check: bool = True,
                   fill_missing: bool = True) -> None:
    """An "auto" (or, with `fill_missing`, a missing key) takes the recipe's value; with `check` a value the JSON
    gives must equal it."""
    *parents, leaf = dotted.split(".")
    node = config
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise RecipeError(f"{path}: {part} must be a JSON object, not {child!r}")
        node = child
    if leaf not in node and not fill_missing:
        return
    present = node.get(leaf, "auto")  # a key the JSON leaves out is filled like "auto"
    if present == "auto":
        node[leaf] = wanted
        return
    if _is_count(wanted) and not _is_count(present) or isinstance(wanted, float) and not _is_number(present):
        kind = "a whole number" if _is_count(wanted) else "a number"
        raise RecipeError(f"{path}: {dotted} is {present!r}, which DeepSpeed cannot compute with: it must be "
                          f"{kind}; write {wanted!r} (the recipe's) or \"auto\"")
    if check and not _same(present, wanted):
        raise RecipeError(f"{path}: {dotted} is {present!r} but the recipe gives {wanted!r}; "
                          f"set it to \"auto\" in the JSON or change the recipe")


def _same(present, wanted) -> bool:
    if isinstance(wanted, list):
        return isinstance(present, list) and len(present) == len(wanted) and all(map(_same, present, wanted))
    if isinstance(wanted, bool) or not isinstance(wanted, (int, float)):
        return present == wanted
    # a JSON string is no number: DeepSpeed's batch assertions and optimizers compare and multiply it (a TypeError
    # on every rank)
    return _is_number(present) and float(present) == float(wanted)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def configured_stage(recipe: Recipe) -> int:
    """The stage a recipe runs: strategy.stage, else its ds_config's, else the default (no batch plan needed)."""
    if recipe.strategy.stage is not None:
        return recipe.strategy.stage
    if recipe.strategy.ds_config is not None:
        return _read_json(recipe.strategy.ds_config, stage_of, malformed=DEFAULT_STAGE)
    return DEFAULT_STAGE


def _read_json(path: str, read, *, malformed):
    """`read` of the DeepSpeed JSON at `path`; `malformed` where it cannot be read or has the wrong shape
    (resolve_ds_config says what is wrong with it, in one line)."""
    try:
        return read(json.loads(Path(path).read_text()))
    except (OSError, ValueError, AttributeError, TypeError):
        return malformed


def frees_gradients(recipe: Recipe) -> bool:
    """Whether the recipe's ZeRO gives its gradients back after each step (measured in tests/test_plan.py).
    Stages 1 and 2 without an offloaded optimizer do: DeepSpeed's stage_1_and_2.py step() drops the averaged
    gradients and the parameters' grads, the contiguous partition buffer with them. Stage 0 does too: torch's
    optimizer inside DeepSpeed's engine, whose step sets every .grad to None (fp32), or its FP16_UnfusedOptimizer
    wrapper for bf16, which drops the fp32 masters' grads and the bf16 ones. Stage 3 keeps its flat gradient
    buffer, an offloaded optimizer a pinned fp32 gradient per partition, and a JSON that sets
    data_types.grad_accum_dtype may run DeepSpeed's BF16_Optimizer, whose flat fp32 gradients stay."""
    if configured_stage(recipe) not in (0, 1, 2) or recipe.strategy.offload_optimizer:
        return False
    if recipe.strategy.ds_config is None:
        return True
    return _read_json(recipe.strategy.ds_config, malformed=False, read=lambda config: not offloads(config)[0]
                      and "grad_accum_dtype" not in config.get("data_types", {}))


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
    from deepspeed.accelerator import get_accelerator  # DS_ACCELERATOR: see toolkit.launch.launcher.prepare_environment

    accelerator = get_accelerator()
    supported = accelerator.is_fp16_supported() if precision == "fp16" else accelerator.is_bf16_supported()
    if not supported:
        other = "bf16" if precision == "fp16" else "fp32"
        raise RecipeError(f"precision {precision} is not supported by DeepSpeed's {accelerator.device_name()} "
                          f"accelerator; use precision: {other} with strategy zero, or strategy fsdp/ddp "
                          f"for {precision}")
