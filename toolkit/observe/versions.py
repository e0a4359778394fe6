"""The versions a run ran with: Python, torch and the libraries whose behaviour a run's numbers depend on
(run.json, every checkpoint's manifest)."""

from __future__ import annotations

import functools
import platform
from importlib import metadata

import torch


def versions() -> dict[str, str | None]:
    return dict(_versions())


@functools.cache  # package metadata is read once: every checkpoint's manifest holds it
def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("transformers", "accelerate", "deepspeed", "datasets"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out
