"""Reading a YAML file the user wrote: what is wrong with it, if anything, is one RecipeError naming the file."""

from __future__ import annotations

from pathlib import Path

import yaml

from toolkit.errors import RecipeError


def _yaml_where(path: Path, exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    return f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)


def yaml_problem(exc: yaml.YAMLError) -> str:
    problem, context = getattr(exc, "problem", None), getattr(exc, "context", None)
    if problem:
        return f"{problem} ({context})" if context else str(problem)
    return str(exc).splitlines()[0]


def read_yaml_mapping(path: Path, *, what: str, holds: str) -> dict:
    """A YAML file that must hold a mapping (an empty file is an empty one): text that is not UTF-8, not YAML,
    or YAML of another shape is a RecipeError naming the file (and the line and column where YAML broke)."""
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as exc:
        raise RecipeError(f"{what} {path}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start}); "
                          "save it as UTF-8") from None
    except yaml.YAMLError as exc:
        raise RecipeError(f"{what} {_yaml_where(path, exc)}: not valid YAML: {yaml_problem(exc)}") from None
    if not isinstance(raw, dict):
        raise RecipeError(f"{what} {path} must be a mapping of {holds}")
    return raw
