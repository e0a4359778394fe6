"""Plain values (parsed YAML, `--set` overrides) into typed, frozen dataclasses, by the fields' type hints:
an unknown key, a missing required one or a value of the wrong type is a RecipeError naming the key."""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import types
import typing
from typing import Any

from toolkit.errors import RecipeError

PATH = {"path": True}  # a recipe key's field metadata: the key names a file or folder (`~` expanded, empty refused)
# {"expected": words}: a field's metadata, what its wrong-type error says the key takes


def recipe_key(f: dataclasses.Field) -> str:
    """A field's recipe key: its name, or the key in its metadata where the name is a Python keyword."""
    return f.metadata.get("key", f.name)


def from_plain(cls: type, raw: Any, where: str = "") -> Any:
    """`cls` (a dataclass) from a plain mapping, every value checked against its field's type hint, nested
    dataclasses built the same way; `where` is the key path so far, for the errors."""
    if not isinstance(raw, dict):
        raise RecipeError(f"{where or 'recipe'}: expected a mapping, got {type(raw).__name__} {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {recipe_key(f): f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields), key=str)  # YAML keys may be numbers, booleans, null
    if unknown:
        key = f"{where}.{unknown[0]}" if where else unknown[0]
        close = difflib.get_close_matches(str(unknown[0]), list(fields), n=1, cutoff=0.7)
        guess = f"did you mean {f'{where}.{close[0]}' if where else close[0]!r}? " if close else ""
        name, colon, _ = str(unknown[0]).partition(":")
        if colon and name in fields:  # {r:8} is YAML's one key 'r:8': a mapping needs a space after each colon
            guess = f"YAML reads {unknown[0]!r} as one key: write '{name}: ...', with a space after the colon; "
        raise RecipeError(f"unknown recipe key {key!r}; {guess}known keys here: {', '.join(fields)}")
    values = {}
    for name, value in raw.items():
        key = f"{where}.{name}" if where else name
        try:
            values[fields[name].name] = _coerce(hints[fields[name].name], value, key)
        except RecipeError:  # a field that takes values of several types says them all (its metadata's words)
            expected = fields[name].metadata.get("expected")
            if expected is None:
                raise
            raise RecipeError(f"{key}: expected {expected}, got {value!r}") from None
        if fields[name].metadata.get("path") and values[fields[name].name] is not None:
            values[fields[name].name] = _path(values[fields[name].name], key)
    missing = [n for n, f in fields.items() if f.name not in values and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        key = f"{where}.{missing[0]}" if where else missing[0]
        raise RecipeError(f"recipe key {key!r} is required")
    return cls(**values)


# what os.path.expandvars replaces: $NAME or ${NAME}; one left after it names a variable that is not set
ENV_VARIABLE = re.compile(r"\$(\w+|\{[^}]*\})")


def _path(value: str, key: str) -> str:
    """A field marked as a path (metadata {"path": True}): `~` is the home folder and $NAME / ${NAME} the
    environment variable's value, as a shell would have read them, for every path key alike and once, here, so
    that every reader and the saved recipe see the same path. A variable that is not set would leave a folder
    literally named `$SCRATCH` in the current one, and an empty path would be the current folder (an output_dir:
    the run written beside whatever is there)."""
    if not value.strip():
        raise RecipeError(f"{key} is empty, which would mean the current folder; give it a file or folder path")
    home = os.path.expanduser(value)
    names = [m.group(1).strip("{}") for m in ENV_VARIABLE.finditer(home)]
    empty = [name for name in names if os.environ.get(name) == ""]
    if empty:  # `$SCRATCH/runs` would be `/runs`: a folder at the root of the file system, not what was meant
        raise RecipeError(f"{key}: {value!r} names the environment variable {empty[0]}, which is set but empty; "
                          f"set it (export {empty[0]}=...) or write the path out")
    expanded = os.path.expandvars(home)
    unset = ENV_VARIABLE.search(expanded)
    if unset is not None:
        name = unset.group(1).strip("{}")
        raise RecipeError(f"{key}: {value!r} names the environment variable {name}, which is not set; set it "
                          f"(export {name}=...) or write the path out")
    return expanded


# a number in exponent form without a dot (1e-4): YAML 1.1, which PyYAML reads, takes it for text
YAML_11_TEXT_NUMBER = re.compile(r"[-+]?\d+(\.\d*)?[eE][-+]?\d+")


def yaml_number(value: Any) -> Any:
    """`value`, or the number a user meant by text YAML 1.1 did not read as one (`lr: 1e-4` in a file or a
    --set): for keys that take a number, and the values of a transformers config (model.config), where no
    field holds such text."""
    if isinstance(value, str) and YAML_11_TEXT_NUMBER.fullmatch(value.strip()):
        return float(value)
    if isinstance(value, dict):
        return {k: yaml_number(v) for k, v in value.items()}
    if isinstance(value, list):
        return [yaml_number(v) for v in value]
    return value


def _coerce(hint: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, key)
            except RecipeError as exc:
                errors.append(str(exc))
        raise RecipeError(errors[0] if errors else f"{key}: bad value {value!r}")
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return from_plain(hint, value, key)
    if origin is tuple:
        args = typing.get_args(hint)
        if isinstance(value, str) and args == (str, Ellipsis):
            value = [value]  # a list of names also takes one name: `report_to: tensorboard`
        if not isinstance(value, (list, tuple)):
            raise RecipeError(f"{key}: expected a list, got {value!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(args[0], v, key) for v in value)
        if len(args) != len(value):
            raise RecipeError(f"{key}: expected {len(args)} values, got {len(value)}")
        return tuple(_coerce(a, v, key) for a, v in zip(args, value))
    if hint is dict or origin is dict:
        if not isinstance(value, dict):
            raise RecipeError(f"{key}: expected a mapping, got {value!r}")
        return yaml_number(value)
    if hint is bool:
        if not isinstance(value, bool):
            raise RecipeError(f"{key}: expected true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise RecipeError(f"{key}: expected an integer, got {value!r}")
        return value
    if hint is float:
        value = yaml_number(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RecipeError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise RecipeError(f"{key}: expected a string, got {value!r}")
        return value
    raise AssertionError(f"unhandled recipe type {hint} for {key}")
