"""Each strategy's own options dataclass: the typed subset of the recipe's `strategy:` keys that strategy reads.

A strategy module declares one (`@strategy_options class FsdpOptions: reshard_after_forward: bool ...`) and reads
its options through it (`options_of(FsdpOptions, recipe)`), never the whole section. The recipe parses one
`strategy:` section (StrategyConfig, toolkit/config/recipe.py), which holds each key once: its type, its default
and what it trades (docs/recipe-keys.md is generated from it), so an options dataclass holds fields without
defaults, each of StrategyConfig's type: `strategy_options` checks that as the class is made. Its field names are
the strategy's StrategyInfo.options, which the registry reads to refuse, in one line, an option set for a
strategy that ignores it.
"""

from __future__ import annotations

import dataclasses
from typing import TypeVar

from toolkit.config.recipe import Recipe, StrategyConfig

T = TypeVar("T")

_SECTION = {f.name: f for f in dataclasses.fields(StrategyConfig)}


def strategy_options(cls: type[T]) -> type[T]:
    """Make `cls` a frozen keyword-only dataclass of strategy keys; each field must be a StrategyConfig key of the
    same type, without a default of its own (StrategyConfig's is the one default)."""
    made = dataclasses.dataclass(frozen=True, kw_only=True)(cls)
    for f in dataclasses.fields(made):  # type: ignore[arg-type]
        declared = _SECTION.get(f.name)
        assert declared is not None and f.name != "name", f"{cls.__name__}.{f.name}: not a strategy.<option> key"
        assert _spelled(f.type) == _spelled(declared.type), (
            f"{cls.__name__}.{f.name}: {_spelled(f.type)}, but the recipe's is {_spelled(declared.type)}")
        assert f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING, (
            f"{cls.__name__}.{f.name}: the default lives in StrategyConfig only")
    return made


def _spelled(annotation: object) -> str:
    """An annotation as source spells it: a string under `from __future__ import annotations`, a type without."""
    if isinstance(annotation, str):
        return annotation
    return annotation.__name__ if isinstance(annotation, type) else str(annotation)


@strategy_options
class NoOptions:
    """A strategy that reads no strategy.<option> key (single, dp)."""


def option_names(options: type) -> tuple[str, ...]:
    """The strategy.<option> keys an options dataclass holds, in its order."""
    return tuple(f.name for f in dataclasses.fields(options))


def options_of(options: type[T], recipe: Recipe) -> T:
    """The recipe's values of the keys `options` holds."""
    return options(**{name: getattr(recipe.strategy, name) for name in option_names(options)})
