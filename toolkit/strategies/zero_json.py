"""What DeepSpeed would ignore or refuse in a JSON, found before any rank starts: a top-level key it does not read
(a typo of one it does), or one it has removed. Imports DeepSpeed (zero_config.check_with_deepspeed calls these for
a JSON only)."""

from __future__ import annotations

import difflib
import functools
from pathlib import Path

from toolkit.errors import RecipeError, first_line


def check_top_level_keys(config: dict, path: Path) -> None:
    """DeepSpeed ignores a top-level key it does not read without a word, so one a typo away from a key it reads is
    refused (a "zero_optimisation" block ran DeepSpeed's default, stage 0, while the toolkit reported its own stage);
    another unknown key passes through. A key DeepSpeed has removed is refused here as each rank would refuse it."""
    from deepspeed.runtime.config import DeepSpeedConfigError, _reject_removed_config_keys

    try:
        _reject_removed_config_keys(config)
    except DeepSpeedConfigError as exc:
        raise RecipeError(f"{path}: DeepSpeed refuses it ({first_line(exc)}); remove that key") from None
    known = deepspeed_config_keys()
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
    top-level keys with nested ones ("enabled", "loss_scale") and leave out blocks other modules read (zero_optimization,
    tensorboard)."""
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
    reader._initialize_params(Recorder())
    return frozenset(asked)
