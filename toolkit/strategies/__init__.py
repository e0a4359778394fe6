"""The strategy table: name -> factory. Imports are lazy so DeepSpeed loads only when asked for."""

from __future__ import annotations

import importlib

from toolkit.strategies.names import STRATEGY_NAMES

_FACTORIES = {
    "single": ("toolkit.strategies.single", "SingleStrategy"),
    "dp": ("toolkit.strategies.dp", "DataParallelStrategy"),
    "ddp": ("toolkit.strategies.ddp", "DdpStrategy"),
    "fsdp": ("toolkit.strategies.fsdp", "FsdpStrategy"),
    "zero": ("toolkit.strategies.zero", "ZeroStrategy"),
}
assert set(_FACTORIES) == set(STRATEGY_NAMES)


def make_strategy(name: str):
    module, cls = _FACTORIES[name]
    return getattr(importlib.import_module(module), cls)()
