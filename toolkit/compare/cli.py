"""`toolkit compare` and `toolkit report` (registered into the main parser)."""

from __future__ import annotations

COMPARE_COMMANDS: dict = {}


def add_compare_commands(sub, add_overrides) -> None:
    return None
