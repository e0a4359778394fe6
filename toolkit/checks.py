"""Checks of a recipe that need no process group: run by `validate` and by `launch` before any rank starts,
so a user's mistake is one line from the launcher, not a failure inside every rank."""

from __future__ import annotations

from pathlib import Path

from toolkit.errors import RecipeError
from toolkit.recipe import BatchPlan, Recipe
from toolkit.strategies import validate_strategy


def check_paths(recipe: Recipe) -> None:
    from toolkit.model import resolve_path

    if recipe.model.path is not None:
        path = resolve_path(recipe.model.path)
        if not (path / "config.json").is_file():
            raise RecipeError(f"model.path: {path} is not a saved model (no config.json); "
                              "point it at a folder written by save_pretrained")
    if recipe.model.tokenizer is not None and not resolve_path(recipe.model.tokenizer).is_dir():
        raise RecipeError(f"model.tokenizer: {recipe.model.tokenizer} does not exist")
    for key in ("train", "eval"):
        value = getattr(recipe.data, key)
        if value is not None and not Path(value).is_file():
            raise RecipeError(f"data.{key}: {value} not found; give a local json/jsonl/csv/parquet/txt file")


def check_columns(recipe: Recipe) -> None:
    """Reads the data files' column names (not the data) and checks the named columns exist."""
    import datasets

    from toolkit.data import FORMATS

    datasets.disable_progress_bars()
    wanted = [recipe.data.text_column]
    if recipe.model.task == "sequence-classification" and recipe.data.label_column:
        wanted.append(recipe.data.label_column)
    for key in ("train", "eval"):
        value = getattr(recipe.data, key)
        if value is None:
            continue
        fmt = FORMATS.get(Path(value).suffix)
        if fmt is None:
            raise RecipeError(f"data.{key}: {value}: unknown format; use one of {', '.join(FORMATS)}")
        columns = datasets.load_dataset(fmt, data_files=value, split="train").column_names
        for column in wanted:
            if column not in columns:
                raise RecipeError(f"data.{key}: {value} has no column {column!r} (it has {', '.join(columns)}); "
                                  "set data.text_column / data.label_column to one of those")


def check_recipe(recipe: Recipe, *, world_size: int) -> BatchPlan:
    plan = validate_strategy(recipe, world_size=world_size)
    check_paths(recipe)
    check_columns(recipe)
    return plan
