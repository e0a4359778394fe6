"""`single`: one process, one device, no parallelism. The reference every other strategy is checked against."""

from __future__ import annotations

from toolkit.strategies.replicated import Replication, ReplicatedStrategy

SINGLE = Replication(name="single", wrap=lambda module, args: module, reduce_desc="none (one process)")


def build() -> ReplicatedStrategy:
    return ReplicatedStrategy(SINGLE)
