"""Timing a callable on the host, as every probe here does: its calls after a warm-up (allocation, kernel
selection, caches), by the wall clock. Where a GPU runs it, the caller synchronises inside `run`."""

from __future__ import annotations

import statistics
import time
from typing import Callable


def timings(run: Callable[[], object], repeats: int, *, warm: bool = True) -> list[float]:
    """Seconds of each of `repeats` calls of `run`, after one untimed call where `warm`."""
    if warm:
        run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return times


def median_seconds(run: Callable[[], object], repeats: int = 5, *, warm: bool = True) -> float:
    """A call's time: the median of `repeats` (after a warm-up where `warm`), as a step's time is its run's median:
    on a shared machine the best of a few catches a quiet moment the steps do not have."""
    return statistics.median(timings(run, repeats, warm=warm))
