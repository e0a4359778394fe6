"""What DeepSpeed would ignore or fail on in a JSON, found before training starts: a top-level key it does not read
(a typo of one it does), one it has removed, and an optimizer type its accelerator has no op for. Imports DeepSpeed
(zero_config.check_with_deepspeed calls these for a JSON only)."""

from __future__ import annotations

import difflib
import functools
from pathlib import Path

from toolkit.errors import RecipeError, first_line


def check_top_level_keys(config: dict, path: Path) -> None:
    """DeepSpeed ignores a top-level key it does not read without a word, so one a typo away from a key it reads is
    refused (a "zero_optimisation" block ran DeepSpeed's default, stage 0, while the toolkit reported its own stage);
    another unknown key passes through. A key DeepSpeed has removed is refused here as each rank would refuse it."""
    from deepspeed.runtime import config as ds_config

    reject = getattr(ds_config, "_reject_removed_config_keys", None)  # DeepSpeed's own, private: where it exists
    try:
        if reject is not None:
            reject(config)
    except ds_config.DeepSpeedConfigError as exc:
        raise RecipeError(f"{path}: DeepSpeed refuses it ({first_line(exc)}); remove that key") from None
    known = deepspeed_config_keys()
    if not known:  # another DeepSpeed whose reader could not be asked: no typo check rather than a failure
        return
    for key in config:
        # 0.85: zero_optimisation (0.94), gradient_clip (0.87) and fp_16 (0.89) are typos; "comment" (0.83 to comet)
        # is a note to pass through
        near = [] if key in known else difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.85)
        if near:
            raise RecipeError(f"{path}: {key!r} is no key DeepSpeed reads (it would be ignored); did you mean "
                              f"{near[0]!r}? Rename it in the JSON")


@functools.cache
def deepspeed_config_keys() -> frozenset[str]:
    """The top-level keys DeepSpeed's config reads: those its DeepSpeedConfig._initialize_params asks an empty config
    for, recorded, so that the set is the installed DeepSpeed's. Its constants modules are no such list: they mix
    top-level keys with nested ones ("enabled", "loss_scale") and leave out blocks other modules read
    (zero_optimization, tensorboard)."""
    from deepspeed.runtime.config import DeepSpeedConfig

    asked: set[str] = set()

    class Recorder(dict):
        def get(self, key, default=None):
            asked.add(key)
            return super().get(key, default)

        def __getitem__(self, key):
            asked.add(key)
            return super().__getitem__(key)

        def __contains__(self, key):
            asked.add(key)
            return super().__contains__(key)

        def keys(self):  # type: ignore[override]  # `KEY in config.keys()`, as some of its readers ask
            return self

    reader = DeepSpeedConfig.__new__(DeepSpeedConfig)  # without __init__, which asks torch.distributed for the world
    reader.world_size, reader.global_rank = 1, 0
    try:  # a private method: a DeepSpeed that reads its config otherwise leaves the set empty (no check)
        reader._initialize_params(Recorder())
    except Exception:  # noqa: BLE001 - whatever another version raises on an empty config
        return frozenset()
    return frozenset(asked)


# The op each of DeepSpeed's own optimizer types loads in its engine (_configure_basic_optimizer): without, and
# with, an offloaded optimizer. None: a torch optimizer (adagrad), or an adam whose params set torch_adam.
OPTIMIZER_OPS = {"adam": ("FusedAdamBuilder", "CPUAdamBuilder"), "adamw": ("FusedAdamBuilder", "CPUAdamBuilder"),
                 "adagrad": (None, "CPUAdagradBuilder"), "lamb": ("FusedLambBuilder", "FusedLambBuilder"),
                 "lion": ("FusedLionBuilder", "CPULionBuilder")}
MUP_OPTIMIZERS = ("muadam", "muadamw", "musgd")  # the engine imports them from the mup package


def check_optimizer_ops(config: dict, path: Path, *, offloaded: bool) -> None:
    """An optimizer block whose type DeepSpeed's accelerator has no op for (FusedLion on CPU) raised "This op had
    not been implemented" on every rank; a mup type without mup, a NameError. Both are known before ranks start."""
    import importlib.util

    name = config.get("optimizer", {}).get("type", "").lower()  # a dict with a str type: _check_block_types
    if name in MUP_OPTIMIZERS and importlib.util.find_spec("mup") is None:
        raise RecipeError(f"{path}: optimizer.type {config['optimizer']['type']!r} needs the mup package, which is "
                          "not installed; install it, or use another type")
    if name not in OPTIMIZER_OPS or config["optimizer"].get("params", {}).get("torch_adam"):
        return
    missing = op_missing(OPTIMIZER_OPS[name][offloaded])
    if missing is None:
        return
    works = [kind for kind, ops in OPTIMIZER_OPS.items() if op_missing(ops[offloaded]) is None]
    raise RecipeError(f"{path}: optimizer.type {config['optimizer']['type']!r} has no implementation on DeepSpeed's "
                      f"{missing} accelerator{' with an offloaded optimizer' if offloaded else ''}; use one of "
                      f"{', '.join(works)}, or a class name in torch.optim")


def op_missing(builder_name: str | None) -> str | None:
    """The accelerator's name where it has no op `builder_name` (its NotImplementedBuilder stands in), else None."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    builder = accelerator.get_op_builder(builder_name) if builder_name else None
    stand_in = builder is not None and any(cls.__name__ == "NotImplementedBuilder" for cls in builder.__mro__)
    return accelerator.device_name() if stand_in or (builder_name and builder is None) else None
