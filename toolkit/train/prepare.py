"""Everything a run needs before its model is built, and everything in it that can fail on a user's input:
checked and loaded before any output is written (the strategy's checks, the output folder, the data)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from toolkit.checkpoint.store import check_creatable
from toolkit.config.recipe import BatchPlan, Recipe, check_profile_window
from toolkit.data.instruct import adopt_chat_template
from toolkit.data.labels import label_note
from toolkit.data.splits import (DataLayout, GlobalBatchSampler, SplitCounts, check_one_batch, data_note, data_record,
                                 load_split, tokenizer_identity)
from toolkit.model.build import load_tokenizer, saved_label_names
from toolkit.model.precision import check_precision_supported
from toolkit.process.dist import DistEnv
from toolkit.strategies import data_layout, make_strategy, validate_strategy
from toolkit.strategies.base import Strategy
from toolkit.train import tracking_checks
from toolkit.train.checks import check_experts, check_position_limit, check_tiled_loss
from toolkit.train.notes import recipe_notes


@dataclass(frozen=True, kw_only=True)
class Prepared:
    """A rank's run before its model: the batch arithmetic, its data shard and splits, its strategy (made once
    per rank, not yet set up) and what the run will say once it goes ahead."""

    plan: BatchPlan
    layout: DataLayout  # which shard of every global batch this rank reads
    strategy: Strategy
    tokenizer: Any
    train_ds: Any  # the tokenized train split (a datasets.Dataset)
    eval_ds: Any | None  # the tokenized eval split, None without data.eval
    sampler: GlobalBatchSampler
    total_steps: int
    label_names: list[str] | None  # named class labels (a name's position is its class id), None for ids
    notes: list[str]  # one line each, said once the run goes ahead
    data_info: dict[str, Any]  # run.json's data record


def prepare(recipe: Recipe, env: DistEnv) -> Prepared:
    """Everything that can fail on user input, before any output is written."""
    strategy = make_strategy(recipe)  # the one strategy object of this rank
    # again: torchrun/accelerate skip `toolkit launch`
    plan = validate_strategy(recipe, world_size=env.world_size)
    check_creatable(Path(recipe.output_dir))  # before the data is read and the model built, not at the first write
    layout = data_layout(recipe, world_size=env.world_size, rank=env.rank)
    check_precision_supported(recipe.precision, env.device)
    check_position_limit(recipe)
    check_tiled_loss(recipe)
    check_experts(recipe)
    tracking_checks.check_trackers(recipe)
    tokenizer = load_tokenizer(recipe.model)
    adopt_chat_template(tokenizer, recipe.data)  # the template trained with is the one saved with the model
    kwargs = dict(data=recipe.data, task=recipe.model.task, num_labels=recipe.model.num_labels, tokenizer=tokenizer,
                  env=env, identity=tokenizer_identity(tokenizer))  # one digest of the tokenizer for both splits
    model_names = saved_label_names(recipe.model)  # a pretrained head's own mapping, kept where the data fits it
    train_ds, names, train_counts = load_split("data.train", **kwargs, model_names=model_names)
    eval_ds, _, eval_counts = load_split("data.eval", **kwargs, names=names) if recipe.data.eval else \
        (None, None, SplitCounts())
    sampler = GlobalBatchSampler(num_samples=len(train_ds), plan=plan, rank=layout.rank, seed=recipe.seed)
    check_one_batch(len(train_ds), global_batch_size=plan.global_batch_size, num_left_out=train_counts.num_left_out)
    notes = [note for note in (data_note("data.train", train_counts, recipe.data),
                               data_note("data.eval", eval_counts, recipe.data),
                               label_note(names, model_names)) if note]
    epochs = recipe.train.epochs or 0.0  # TrainConfig: exactly one of max_steps and epochs
    wanted_steps = epochs * sampler.steps_per_epoch
    total_steps = recipe.train.max_steps or max(1, int(wanted_steps))
    if not recipe.train.max_steps and wanted_steps < 1:
        notes.append(f"[toolkit] train.epochs {epochs:g} is under one step ({sampler.steps_per_epoch} step(s) of "
                     f"{plan.global_batch_size} samples an epoch): training 1 step, "
                     f"{1 / sampler.steps_per_epoch:g} epoch(s)")
    # epochs as train.epochs counts them (each drops its last partial batch): not the samples read over the
    # dataset's size, which falls short of train.epochs wherever an epoch leaves samples unread
    data_info = {"train": {**data_record(train_counts, num_samples=len(train_ds), data=recipe.data),
                           "steps_per_epoch": sampler.steps_per_epoch,
                           "epochs": round(total_steps / sampler.steps_per_epoch, 4),
                           "samples_unread_per_epoch": len(train_ds) % plan.global_batch_size}}
    if eval_ds is not None:
        data_info["eval"] = data_record(eval_counts, num_samples=len(eval_ds), data=recipe.data)
    check_profile_window(recipe.train.profile_steps, last_step=total_steps)
    notes += recipe_notes(recipe, tokenizer, total_steps=total_steps, world_size=plan.world_size)
    return Prepared(plan=plan, layout=layout, strategy=strategy, tokenizer=tokenizer, train_ds=train_ds,
                    eval_ds=eval_ds, sampler=sampler, total_steps=total_steps, label_names=names, notes=notes,
                    data_info=data_info)
