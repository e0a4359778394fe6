"""A resumed run's lr schedule: the recipe's, at the position the checkpoint reached.

What a checkpoint gives back is the number of schedule steps taken; the schedule itself (optim.lr,
schedule, warm-up, floor, the run's total steps, or a ds_config's "scheduler" block) is the one this run
built from its recipe. So an unchanged recipe goes on exactly where it stopped, and a changed lr or
max_steps takes effect from the first resumed step; `schedule_changes` names what changed, so that it is
said once instead of happening silently.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Any

from toolkit.checkpoint import store
from toolkit.config.files import recipe_to_dict
from toolkit.config.recipe import Recipe
from toolkit.errors import RecipeError

# what sets a schedule besides the run's total steps and a ds_config's scheduler block
SCHEDULE_KEYS = ("optim.lr", "optim.schedule", "optim.warmup_steps", "optim.min_lr_ratio")


def schedule_steps(saved: dict[str, Any]) -> int:
    """The schedule steps a checkpoint's scheduler had taken (its state_dict, as the manifest keeps it).
    fp16 steps skipped on overflow do not count (DeepSpeed's engine and, since it held them too, the torch
    strategies; their earlier checkpoints counted them), so this is the scheduler's own count, not the
    checkpoint's step."""
    if "last_epoch" in saved:  # torch's LRScheduler: 0 once built, +1 per step()
        return int(saved["last_epoch"])
    if "last_batch_iteration" in saved:  # DeepSpeed's own schedulers: -1 once built
        return int(saved["last_batch_iteration"]) + 1
    raise RecipeError("the checkpoint's manifest.json holds no lr schedule position (extra.scheduler); it is "
                      "corrupted, use an earlier checkpoint")


def advance(scheduler, num_steps: int) -> None:
    """Step the freshly built `scheduler` `num_steps` times, as the optimizer steps before the checkpoint did.
    Stepping (rather than setting its counter and computing one lr) goes through the scheduler's own code,
    so any scheduler (DeepSpeed's, or a recursive torch one a ds_config names) lands on the lr an
    uninterrupted run had, bit for bit; it costs microseconds per step."""
    with warnings.catch_warnings():  # torch's "scheduler stepped before the optimizer": deliberate here
        warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))
        for _ in range(num_steps):
            scheduler.step()


def schedule_changes(recipe: Recipe, checkpoint_dir: Path, *, total_steps: int, saved_total_steps: int | None,
                     saved_state: dict[str, Any]) -> list[str]:
    """What sets the schedule and differs from the checkpoint's run: "optim.lr 0.005, was 0.001", ..."""
    # (no readable recipe.yaml: the manifest still says the total steps and which kind of scheduler ran)
    now, before = recipe_to_dict(recipe), store.saved_recipe(checkpoint_dir)
    changes: list[str] = []
    if before is not None:
        changes += [f"{key} {_shown(_dotted(now, key))}, was {_shown(_dotted(before, key))}"
                    for key in SCHEDULE_KEYS if _dotted(now, key) != _dotted(before, key)]
    if saved_total_steps is not None and saved_total_steps != total_steps:
        changes.append(f"total steps {total_steps}, was {saved_total_steps}")
    old_scheduler = _scheduler_named(before) if before is not None else None
    if old_scheduler is None:  # no readable recipe or ds_config: the saved state tells torch's from DeepSpeed's
        old_scheduler = "the recipe's" if "lr_lambdas" in saved_state else "a ds_config scheduler"
    new_scheduler = _scheduler_named(now) or "the recipe's"
    if old_scheduler != new_scheduler:
        changes.append(f"scheduler {new_scheduler}, was {old_scheduler}")
    return changes


def _scheduler_named(recipe: dict) -> str | None:
    """Who builds the schedule: "the recipe's", or "ds_config <type>" where the recipe's strategy.ds_config has
    a "scheduler" block (None: that file can no longer be read)."""
    path = _dotted(recipe, "strategy.ds_config")
    if not path:
        return "the recipe's"
    try:
        config = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    block = config.get("scheduler") if isinstance(config, dict) else None
    return f"ds_config {block.get('type')}" if isinstance(block, dict) else "the recipe's"


def _dotted(raw: dict, key: str) -> Any:
    value: Any = raw
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _shown(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def data_changes(manifest: dict, train_data: dict) -> str | None:
    """How the train split differs from the one the checkpoint's run read (its samples and tokens), or None. Step
    k reads positions [k·G, (k+1)·G) of a seeded permutation of the split's samples: another split (rows added
    or removed, another max_length or file) gives another permutation, so the steps from the checkpoint on read
    samples in another order than the interrupted run would have, some again and some not at all this epoch."""
    saved = manifest.get("train_data")
    if not isinstance(saved, dict):  # a checkpoint of an older toolkit: nothing to compare
        return None
    changed = [f"{key} {train_data.get(key):,}, was {saved.get(key):,}" for key in ("samples", "tokens")
               if isinstance(saved.get(key), int) and saved.get(key) != train_data.get(key)]
    return "; ".join(changed) or None

