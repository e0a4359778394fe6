"""How a launch's ranks ended, from torch.distributed.run's exit codes per global rank (negative: killed by that
signal): which failed on their own, which the launcher stopped, and the words for it (toolkit.launch.launcher)."""

from __future__ import annotations

from typing import NamedTuple


class Failure(NamedTuple):
    """How a launch's ranks on this machine failed: the words (describe_failures) and their global ranks."""
    how: str
    ranks: frozenset[int]


def stopped_together(codes: dict[int, int]) -> int:
    """The exit code 128 + signal every failed rank gave after a stop signal made the ranks checkpoint and stop
    (toolkit.process.stopping), 0 for anything else."""
    from toolkit.process.stopping import STOP_SIGNALS

    failed = {codes[rank] for rank in failed_ranks(codes)}
    return failed.pop() if len(failed) == 1 and failed <= {128 + int(s) for s in STOP_SIGNALS} else 0


def nonfinite_elsewhere(codes: dict[int, int]) -> str:
    """The line for ranks that stopped on a non-finite value where rank 0, which says at which step, did not
    exit so here: it runs on another machine, or this launcher stopped it (SIGTERM) before it said it."""
    if 0 not in codes:
        return ("toolkit: this machine's ranks stopped on a non-finite loss or gradient norm with the job; the first "
                "rank's output says at which step")
    return ("toolkit: the ranks stopped on a non-finite loss or gradient norm (rank 0 was stopped by the launcher "
            "before it said at which step: see run.json's ended)")


def failed_ranks(codes: dict[int, int]) -> list[int]:
    """The ranks that failed on their own: not those the launcher stopped with SIGTERM after the first failure
    (all of them, if every rank was stopped so)."""
    import signal

    stopped = [r for r, c in codes.items() if c == -signal.SIGTERM]
    return [r for r in codes if r not in stopped] or stopped


def describe_failures(codes: dict[int, int]) -> str:
    """Which rank failed and how, from torch.distributed.run's exit codes (negative: killed by that signal).
    When one rank fails the launcher stops the others with SIGTERM: those are named as stopped, not failed."""
    import signal

    def how(code: int) -> str:
        if code >= 0:
            return f"exit code {code}"
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"

    failed = failed_ranks(codes)
    stopped = [r for r in codes if r not in failed]
    text = "; ".join(f"rank {r} {how(codes[r])}" for r in sorted(failed))
    if stopped:
        text += f"; rank{'s' if len(stopped) > 1 else ''} {', '.join(map(str, sorted(stopped)))} stopped by the launcher"
    return text
