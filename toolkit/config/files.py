"""Reading and writing recipes: the YAML file, `--set key.path=value` overrides (values parsed as YAML), the
typed Recipe built from them (toolkit/config/typed.py), and back to plain data."""

from __future__ import annotations

import dataclasses
import os
import typing
from pathlib import Path
from typing import Any

import yaml

from toolkit.config.recipe import Recipe
from toolkit.config.typed import from_plain, recipe_key
from toolkit.config.yaml_files import load_yaml, read_yaml_mapping, yaml_problem
from toolkit.errors import RecipeError


def load_recipe(path: str | os.PathLike, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Read a YAML recipe, apply `a.b=c` overrides, validate, return a frozen Recipe."""
    return recipe_from_dict(read_recipe_dict(path, overrides))


def read_recipe_dict(path: str | os.PathLike, overrides: list[str] | tuple[str, ...] = ()) -> dict:
    """The recipe file as a plain dict with the overrides applied, not yet validated."""
    path = Path(path)
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "not found"
        raise RecipeError(f"recipe {path} {what}{_nearby(path)}; pass a YAML file (see `toolkit --help` for the "
                          "shipped recipes)")
    raw = read_yaml_mapping(path, what="recipe", holds="sections (model, data, ...)")
    if not raw and not overrides:  # else "recipe key 'model' is required", as if one section were missing
        raise RecipeError(f"recipe {path} is empty; it needs at least a model and a data section (see recipes/)")
    for item in overrides:
        apply_override(raw, item)
    return raw


def _nearby(path: Path) -> str:
    """' (did you mean DIR/NAME?)' for a YAML file in the same folder whose name is close to a missing one's."""
    import difflib

    folder = path.parent
    try:
        names = sorted(p.name for p in folder.iterdir() if p.suffix in (".yaml", ".yml") and p.is_file())
    except OSError:
        return ""
    close = difflib.get_close_matches(path.name, names, n=1, cutoff=0.7)
    return f" (did you mean {folder / close[0]}?)" if close and not path.is_dir() else ""


def apply_override(raw: dict, item: str) -> None:
    """Apply one `a.b=c` override in place; the value is parsed as YAML, as in a recipe file (true, null, [a, b];
    1e-4, which YAML 1.1 reads as text, is a number where the key takes one: typed.yaml_number)."""
    if "=" not in item:
        raise RecipeError(f"--set {item!r}: expected key.path=value, e.g. --set optim.lr=1e-4")
    key, _, text = item.partition("=")
    try:
        value = load_yaml(text) if text != "" else ""
    except yaml.YAMLError as exc:
        raise RecipeError(f"--set {item!r}: the value is not valid YAML ({yaml_problem(exc)}); a string with "
                          "YAML's special characters goes in quotes: --set KEY='\"...\"'") from None
    parts = key.strip().split(".")
    node = raw
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise RecipeError(f"--set {key}: {part} is not a section")
        node = child
    node[parts[-1]] = value


def replaced_overrides(common: list[str] | tuple[str, ...], own: list[str] | tuple[str, ...], *,
                       then: list[str] | tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """The items of `common` that `own`, applied after them, would replace by another value: (common's item, own's
    item) per key (each list's last item of a key; values compared as parsed, so `true` and `True` agree). Keys
    that `then`, applied after both, sets are left out: it replaces both."""
    def last(items) -> dict[str, str]:
        return {item.partition("=")[0].strip(): item for item in items}

    def parsed(item: str) -> Any:
        text = item.partition("=")[2]
        try:
            return load_yaml(text) if text != "" else ""
        except yaml.YAMLError:
            return text
    theirs = last(own)
    later = last(then)
    return [(item, theirs[key]) for key, item in last(common).items()
            if key in theirs and key not in later and parsed(item) != parsed(theirs[key])]


def override_value(value: Any) -> str:
    """A recipe value as `--set key=value` writes it (null, true, ['a', 'b'], 0.001)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(list(value)) if isinstance(value, tuple) else str(value)


def recipe_from_dict(raw: dict) -> Recipe:
    return from_plain(Recipe, raw)


def recipe_to_dict(recipe: Recipe) -> dict:
    def plain(value: Any) -> Any:
        if isinstance(value, tuple):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if dataclasses.is_dataclass(value):
            return {recipe_key(f): plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return value

    return plain(recipe)


def path_keys(cls: type = Recipe, prefix: str = "") -> list[str]:
    """The dotted keys marked PATH (model.path, data.train, output_dir, ...)."""
    keys = []
    for f in dataclasses.fields(cls):
        hint = typing.get_type_hints(cls)[f.name]
        inner = [h for h in (hint, *typing.get_args(hint)) if isinstance(h, type) and dataclasses.is_dataclass(h)]
        if f.metadata.get("path"):
            keys.append(prefix + recipe_key(f))
        elif inner:
            keys += path_keys(inner[0], prefix + recipe_key(f) + ".")
    return keys


def dump_recipe(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False)
