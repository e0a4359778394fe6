"""Runs under `accelerate launch`: map its FSDP / DeepSpeed plugin settings (environment variables the
launcher sets from its config file) onto recipe keys. A value the recipe sets differently is an error.

Honoured: ACCELERATE_MIXED_PRECISION; ACCELERATE_USE_FSDP with FSDP_VERSION; version 2: FSDP_RESHARD_AFTER_FORWARD;
version 1 (or none: Accelerate's own example configs), each key mapped onto FSDP2 and said in one line:
FSDP_SHARDING_STRATEGY (FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD, HYBRID_SHARD_ZERO2, NO_SHARD → ddp),
FSDP_ACTIVATION_CHECKPOINTING, FSDP_STATE_DICT_TYPE and FSDP_AUTO_WRAP_POLICY (said, nothing to set), and the
keys FSDP2 has no use for (prefetching, use_orig_params, sync_module_states, cpu_ram_efficient_loading),
said to be not applicable; both versions: FSDP_OFFLOAD_PARAMS, FSDP_TRANSFORMER_CLS_TO_WRAP.
ACCELERATE_USE_DEEPSPEED with ACCELERATE_DEEPSPEED_ZERO_STAGE, ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE,
ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE, ACCELERATE_DEEPSPEED_CONFIG_FILE, ACCELERATE_GRADIENT_ACCUMULATION_STEPS,
ACCELERATE_GRADIENT_CLIPPING (these two "auto", Accelerate's default for both, leave the recipe's value). A value
that is no number where one is needed (ACCELERATE_DEEPSPEED_ZERO_STAGE=three) is a RecipeError naming the variable.

Accelerate exports every FSDP variable, with its own default where the config file says nothing (for example
FSDP_RESHARD_AFTER_FORWARD=true beside FSDP_SHARDING_STRATEGY=SHARD_GRAD_OP in a version-1 config): a switch
that is off (activation checkpointing) sets nothing, and only the keys that mean something for the file's
version are read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from dataclasses import dataclass
from typing import Iterator

from toolkit.config.strategy_options import StrategyConfig
from toolkit.config.recipe import BatchMismatch
from toolkit.config.typed import yaml_number
from toolkit.errors import RecipeError
from toolkit.strategies import strategy_for_plugin

DEFAULT_STRATEGY = next(f.default for f in dataclasses.fields(StrategyConfig) if f.name == "name")

PRECISION = {"no": "fp32", "fp32": "fp32", "bf16": "bf16", "fp16": "fp16"}

# FSDP1 sharding strategies (by name, or Accelerate's 1-based number) -> (reshard after forward, hybrid)
SHARDING = {"FULL_SHARD": (True, False), "SHARD_GRAD_OP": (False, False), "NO_SHARD": (None, False),
            "HYBRID_SHARD": (True, True), "HYBRID_SHARD_ZERO2": (False, True)}
# FSDP1 settings FSDP2 has no counterpart for: accepted and said to be not applicable
NOT_APPLICABLE = {
    "FSDP_BACKWARD_PREFETCH": "FSDP2 prefetches the next block's all-gather itself",
    "FSDP_FORWARD_PREFETCH": "FSDP2 prefetches the next block's all-gather itself",
    "FSDP_USE_ORIG_PARAMS": "FSDP2 always keeps the original parameters, as DTensors",
    "FSDP_SYNC_MODULE_STATES": "every rank starts from the same weights (the layout line says how they came)",
    "FSDP_CPU_RAM_EFFICIENT_LOADING": "that is model.low_memory_loading, on by default",
}


@dataclass(frozen=True)
class Setting:
    key: str  # the recipe key, or "" for a setting that only gets its line
    value: object
    source: str  # the environment variable (and value) it came from
    note: str = ""  # the line said for a version-1 mapping (rank 0, at start)


# settings Accelerate's DeepSpeedPlugin takes as "auto": the training script's value, here the recipe's
AUTO = {"ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "ACCELERATE_GRADIENT_CLIPPING"}
EXPECTED = {int: "a whole number", float: "a number"}


def _converted(var: str, value: str, convert):
    try:
        return convert(value)
    except ValueError:  # int("three"), float("lots"): the config file's value, not the toolkit's
        auto = ' or "auto"' if var in AUTO else ""
        raise RecipeError(f"accelerate launch sets {var}={value!r}, which is not {EXPECTED.get(convert, 'valid')}"
                          f"{auto}; fix it in the accelerate config file (accelerate config) or the environment") \
            from None


# Accelerate's own spellings of a switch (accelerate.utils.environment.str_to_bool, which its plugins read the
# variables with); anything else it refuses, and so does the toolkit, rather than read it as false
TRUE = ("y", "yes", "t", "true", "on", "1")
FALSE = ("n", "no", "f", "false", "off", "0")


def _flag(value: str, var: str = "") -> bool:
    """`var`'s value as Accelerate reads a switch; another spelling (ture, maybe) is a RecipeError naming it."""
    word = value.strip().lower()
    if word not in TRUE + FALSE:
        raise RecipeError(f"accelerate launch sets {var}={value!r}, which is not true or false (Accelerate reads "
                          f"{', '.join(TRUE)} / {', '.join(FALSE)}); fix it in the accelerate config file or the "
                          "environment")
    return word in TRUE


def _offload_device(value: str, var: str) -> bool:
    """Accelerate's offload devices: none, cpu, nvme. The recipe's offload switches offload to CPU; NVMe is a
    DeepSpeed JSON's offload block with its nvme_path (strategy.ds_config), not a device to guess a folder for."""
    word = value.strip().lower()
    if word == "nvme":
        raise RecipeError(f"accelerate launch sets {var}=nvme, but the recipe's offload switches offload to CPU only; "
                          "for NVMe give a DeepSpeed JSON (deepspeed_config_file) whose offload block names device "
                          "nvme and its nvme_path, or offload to cpu")
    if word not in ("none", "cpu", ""):
        raise RecipeError(f"accelerate launch sets {var}={value!r}, which is not none, cpu or nvme; fix it in the "
                          "accelerate config file or the environment")
    return word == "cpu"


def launcher_settings(environ) -> list[Setting]:
    """Every Accelerate setting present in `environ`, as recipe keys (and lines to say)."""
    out: list[Setting] = []

    def take(var: str, key: str, convert=str):
        value = environ.get(var)
        if value in (None, "", "None") or (var in AUTO and value == "auto"):
            return
        if convert in (_flag, _offload_device):  # they name the variable in their own message
            out.append(Setting(key, convert(value, var), var))
        else:
            out.append(Setting(key, _converted(var, value, convert), var))

    if "ACCELERATE_MIXED_PRECISION" in environ:
        value = environ["ACCELERATE_MIXED_PRECISION"].lower()
        if value not in PRECISION:
            raise RecipeError(f"accelerate mixed_precision {value!r} is not supported; use no, bf16 or fp16")
        out.append(Setting("precision", PRECISION[value], "ACCELERATE_MIXED_PRECISION"))
    use_fsdp, use_deepspeed = (_flag(environ.get(var) or "false", var)
                               for var in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"))
    if use_fsdp and use_deepspeed:
        raise RecipeError("accelerate launch sets both ACCELERATE_USE_FSDP and ACCELERATE_USE_DEEPSPEED; keep one "
                          "(distributed_type in the accelerate config file, or unset the other variable)")
    if use_fsdp:
        version = environ.get("FSDP_VERSION", "1").strip()
        if version not in ("1", "2"):  # Accelerate's two plugin versions; a third is no version-1 file
            raise RecipeError(f"accelerate launch sets FSDP_VERSION={version!r}; Accelerate has FSDP versions 1 and "
                              "2: set fsdp_version to one of them in the accelerate config file")
        if version == "2":
            out.append(Setting("strategy.name", strategy_for_plugin("fsdp"), "ACCELERATE_USE_FSDP"))
            take("FSDP_RESHARD_AFTER_FORWARD", "strategy.reshard_after_forward", _flag)
        else:
            out += fsdp1_settings(environ)
        if not any(s.key == "strategy.name" and s.value != "fsdp" for s in out):  # NO_SHARD runs ddp
            take("FSDP_OFFLOAD_PARAMS", "strategy.cpu_offload", _flag)
            take("FSDP_TRANSFORMER_CLS_TO_WRAP", "strategy.blocks",
                 lambda v: [name.strip() for name in v.split(",") if name.strip()])
    if use_deepspeed:
        out.append(Setting("strategy.name", strategy_for_plugin("deepspeed"), "ACCELERATE_USE_DEEPSPEED"))
        take("ACCELERATE_DEEPSPEED_ZERO_STAGE", "strategy.stage", int)
        take("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "strategy.offload_optimizer", _offload_device)
        take("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "strategy.offload_param", _offload_device)
        take("ACCELERATE_DEEPSPEED_CONFIG_FILE", "strategy.ds_config")
        take("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "batch.grad_accum_steps", int)
        take("ACCELERATE_GRADIENT_CLIPPING", "optim.max_grad_norm", float)
    return out


def fsdp1_settings(environ) -> list[Setting]:
    """A version-1 FSDP config (FSDP.__init__'s keys) on FSDP2, one line per key."""
    raw = environ.get("FSDP_SHARDING_STRATEGY", "FULL_SHARD").strip().upper()
    name = list(SHARDING)[int(raw) - 1] if raw.isdigit() and 1 <= int(raw) <= len(SHARDING) else raw
    if name not in SHARDING:
        raise RecipeError(f"accelerate fsdp_sharding_strategy {raw!r} is not one of {', '.join(SHARDING)}; fix the "
                          "accelerate config file")
    reshard, hybrid = SHARDING[name]
    source = f"fsdp_sharding_strategy {name}"
    if reshard is None:
        out = [Setting("strategy.name", "ddp", source, f"{source} → strategy.name=ddp (nothing sharded: every rank "
                                                       "holds the whole model, DDP's all-reduce)")]
    else:
        out = [Setting("strategy.name", strategy_for_plugin("fsdp"), source, ""),
               Setting("strategy.reshard_after_forward", reshard, source,
                       f"{source} → FSDP2 with strategy.reshard_after_forward={str(reshard).lower()}")]
    if hybrid:  # FSDP1's hybrid: shard inside a node, replicate across nodes
        nodes = int(environ.get("WORLD_SIZE", "1")) // max(int(environ.get("LOCAL_WORLD_SIZE", "1")), 1)
        out.append(Setting("strategy.replicate_degree", nodes, source,
                           f"{source} → HSDP: shards inside each node, strategy.replicate_degree={nodes} (nodes)"))
    if _flag(environ.get("FSDP_ACTIVATION_CHECKPOINTING") or "false", "FSDP_ACTIVATION_CHECKPOINTING"):
        out.append(Setting("train.activation_checkpointing", True, "fsdp_activation_checkpointing true",
                           "fsdp_activation_checkpointing true → train.activation_checkpointing=true"))
    policy = environ.get("FSDP_AUTO_WRAP_POLICY")
    if policy:
        size = f" (fsdp_min_num_params {environ['FSDP_MIN_NUM_PARAMS']} not used)" \
            if policy == "SIZE_BASED_WRAP" and environ.get("FSDP_MIN_NUM_PARAMS") else ""
        out.append(Setting("", policy, "fsdp_auto_wrap_policy", f"fsdp_auto_wrap_policy {policy} → one FSDP2 unit "
                           f"per transformer block (strategy.blocks), then the root{size}"))
    state_dict = environ.get("FSDP_STATE_DICT_TYPE")
    if state_dict:
        out.append(Setting("", state_dict, "fsdp_state_dict_type", f"fsdp_state_dict_type {state_dict} → affects "
                           "checkpoints only: the toolkit's are sharded (DCP), its model export consolidated"))
    return out + _not_applicable(environ)


def _not_applicable(environ) -> list[Setting]:
    """Said for a setting that is on (Accelerate exports the ones that are off too, as its defaults)."""
    return [Setting("", environ[var], var.lower(), f"{var.lower()} {environ[var]}: not applicable ({why})")
            for var, why in NOT_APPLICABLE.items() if environ.get(var, "").lower() not in ("", "none", "false")]


def apply_launcher_settings(raw: dict, settings: list[Setting]) -> list[str]:
    """Fill keys the recipe leaves out; a key the recipe sets to another value is a RecipeError. Returns a line for
    each value of the recipe's that a setting replaced (its default strategy, which the config file chooses)."""
    replaced = []
    for setting in settings:
        if not setting.key:
            continue
        *parents, leaf = setting.key.split(".")
        node = raw
        for part in parents:
            node = node.setdefault(part, {}) if isinstance(node.get(part, {}), dict) else {}
        present = node.get(leaf)
        # a recipe that leaves the strategy at its default lets the launcher's config file choose it
        replaceable = present is None or (setting.key == "strategy.name" and present == DEFAULT_STRATEGY)
        if not replaceable and yaml_number(present) != setting.value:  # clipping: 1e0 in the file is 1.0
            raise RecipeError(f"accelerate launch sets {setting.key}={setting.value!r} ({setting.source}) but the "
                              f"recipe has {setting.key}={present!r}; change the recipe or the accelerate config file")
        if present is not None and yaml_number(present) != setting.value:
            replaced.append(f"{setting.key}={setting.value} ({setting.source}) replaces the recipe's "
                            f"{setting.key}={present} (a config file without a plugin, such as ddp.yaml, leaves it)")
        node[leaf] = setting.value
    return replaced


@contextlib.contextmanager
def named_source(settings: list[Setting]) -> Iterator[None]:
    """A recipe check that refuses a value Accelerate supplied (ACCELERATE_DEEPSPEED_ZERO_STAGE=5, accumulation 0,
    clipping inf) names the variable it came from: the recipe the user reads does not hold it."""
    try:
        yield
    except BatchMismatch as exc:
        source = next((s.source for s in settings if s.key == "batch.grad_accum_steps"), None)
        if source is None:
            raise
        fits = f" (or set it to {exc.wanted // exc.per_step})" if exc.wanted % exc.per_step == 0 else ""
        raise RecipeError(f"{str(exc).split(';')[0]}: the accumulation is accelerate launch's ({source}); remove "
                          f"gradient_accumulation_steps from the accelerate config file or command{fits}, and the "
                          f"recipe's global batch sets it, or make batch.global_batch_size {exc.total}") from None
    except RecipeError as exc:
        # its subject: the message starts with the key, not with a longer one it prefixes (stage, stages_per_rank)
        source = next((s.source for s in settings if s.key and re.match(re.escape(s.key) + r"(?![\w.])", str(exc))),
                      None)
        if source is None:
            raise
        raise RecipeError(f"{exc} (the value comes from accelerate launch: {source}; fix it in the accelerate "
                          "config file or the environment)") from None
