"""Checks of a recipe that need no process group: run by `validate` and by `launch` before any rank starts,
so a user's mistake is one line from the launcher, not a failure inside every rank."""

from __future__ import annotations

from toolkit.errors import RecipeError
from toolkit.recipe import BatchPlan, Recipe
from toolkit.strategies import validate_strategy
from toolkit.tracking import check_trackers


def check_paths(recipe: Recipe) -> None:
    from toolkit.model import check_model_dir, resolve_path

    if recipe.model.path is not None:
        check_model_dir(resolve_path(recipe.model.path), "model.path")
    if recipe.model.tokenizer is not None:
        check_model_dir(resolve_path(recipe.model.tokenizer), "model.tokenizer")
    from toolkit.data_files import data_source

    for key in ("train", "eval"):
        value = getattr(recipe.data, key)
        if value is not None:
            data_source(f"data.{key}", value)


def check_position_limit(recipe: Recipe) -> None:
    """The model's config is one transformers accepts, and data.max_length is within its position embeddings
    (reads config.json only)."""
    from toolkit.model import hf_config, position_limit

    hf_config(recipe.model)
    limit = position_limit(recipe.model)
    if limit is not None and recipe.data.max_length > limit:
        raise RecipeError(f"data.max_length {recipe.data.max_length} is above the model's position limit {limit} "
                          f"(max_position_embeddings); set data.max_length <= {limit}")


def check_data(recipe: Recipe) -> None:
    """Reads the data files (not tokenized): they have rows, and the named columns hold what training needs; the
    tokenizer that will tokenize them loads."""
    from toolkit.data import check_rows
    from toolkit.data_files import data_source, read_rows

    names = None  # data.train's class names, which data.eval's labels must be among
    for key in ("data.train", "data.eval"):
        value = getattr(recipe.data, key.split(".")[1])
        if value is not None:
            source = data_source(key, value)
            names = check_rows(read_rows(source), source, data=recipe.data, task=recipe.model.task,
                               num_labels=recipe.model.num_labels, names=names)
    from toolkit.model import load_tokenizer

    tokenizer = load_tokenizer(recipe.model)  # its folder's files load (0.1 s for MiniLM's, measured)
    if recipe.data.format != "text":
        from toolkit.instruct import check_tokenizer

        check_tokenizer(recipe.data, tokenizer)


def check_model_toggles(recipe: Recipe) -> None:
    """LoRA targets that name layers of the model, and blocks to checkpoint: both on one meta-device copy of
    the model (its config and class only, no weights read), built only when a toggle asks for it."""
    if recipe.model.lora is None and not recipe.train.activation_checkpointing:
        return
    from toolkit.model import enable_activation_checkpointing
    from toolkit.plan import planned_model

    model = planned_model(recipe)  # applies the adapters: targets that match nothing are peft's one-line error
    if recipe.train.activation_checkpointing:
        enable_activation_checkpointing(model)  # a model without blocks: its one-line error


def check_recipe(recipe: Recipe, *, world_size: int) -> BatchPlan:
    plan = validate_strategy(recipe, world_size=world_size)
    check_trackers(recipe)  # train.report_to's packages, and where they write
    check_paths(recipe)
    check_model_toggles(recipe)
    check_position_limit(recipe)
    check_data(recipe)
    return plan
