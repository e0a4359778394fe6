"""Reading a YAML file the user wrote: what is wrong with it, if anything, is one RecipeError naming the file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from toolkit.errors import RecipeError


class DuplicateKey(yaml.MarkedYAMLError):
    """A key written twice in one mapping: PyYAML keeps the last without a word, so a section appended to a
    recipe (a second `optim:`) would silently replace the first, every key of it."""

    def __init__(self, key: str, first: yaml.Mark, again: yaml.Mark) -> None:
        super().__init__(problem=f"key {key!r} appears twice (also line {first.line + 1}); keep one",
                         problem_mark=again)


class UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key written twice in one mapping, named with its section (`optim.lr`):
    keys a `<<` merge brings in may still be overridden, that is what a merge is for."""

    def construct_document(self, node: yaml.Node) -> Any:
        self._refuse_repeats(node, "", set())
        return super().construct_document(node)

    def _refuse_repeats(self, node: yaml.Node, where: str, open_nodes: set[int]) -> None:
        if id(node) in open_nodes:  # an alias inside its own anchor: walked already
            return
        open_nodes.add(id(node))
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, value_node in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                name = f"{where}.{key}" if where else str(key)
                try:
                    first = seen.setdefault(key, key_node)
                except TypeError:  # an unhashable key: construct_mapping refuses it in its own words
                    continue
                if first is not key_node:
                    raise DuplicateKey(name, first.start_mark, key_node.start_mark)
                self._refuse_repeats(value_node, name, open_nodes)
        elif isinstance(node, yaml.SequenceNode):
            for index, item in enumerate(node.value):
                self._refuse_repeats(item, f"{where}[{index}]", open_nodes)
        open_nodes.discard(id(node))


def load_yaml(text: str) -> Any:
    """YAML text the user wrote (a file, a --set value): safe_load, a duplicated key refused."""
    return yaml.load(text, Loader=UniqueKeyLoader)  # a SafeLoader: tags that build Python objects are refused


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
    a key written twice, or YAML of another shape is a RecipeError naming the file (and the line and column
    where YAML broke)."""
    try:
        raw = load_yaml(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as exc:
        raise RecipeError(f"{what} {path}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start}); "
                          "save it as UTF-8") from None
    except DuplicateKey as exc:
        raise RecipeError(f"{what} {_yaml_where(path, exc)}: {yaml_problem(exc)}") from None
    except yaml.YAMLError as exc:
        raise RecipeError(f"{what} {_yaml_where(path, exc)}: not valid YAML: {yaml_problem(exc)}") from None
    if not isinstance(raw, dict):
        raise RecipeError(f"{what} {path} must be a mapping of {holds}")
    return raw
