"""The strategy table: name -> factory. Imports are lazy so DeepSpeed loads only when asked for."""

from __future__ import annotations

import importlib

from toolkit.strategies.names import STRATEGY_NAMES

_FACTORIES = {
    "single": ("toolkit.strategies.single", "build"),
    "dp": ("toolkit.strategies.dp", "build"),
    "ddp": ("toolkit.strategies.ddp", "build"),
    "fsdp": ("toolkit.strategies.fsdp", "FsdpStrategy"),
    "zero": ("toolkit.strategies.zero", "ZeroStrategy"),
}
assert set(_FACTORIES) == set(STRATEGY_NAMES)


def make_strategy(name: str):
    module, factory = _FACTORIES[name]
    return getattr(importlib.import_module(module), factory)()
