"""Ending a run early without losing it: a stop signal (preemption) and a non-finite loss.

SIGTERM and SIGUSR1 are what SLURM and Kubernetes send before they kill a job. The handler only notes the
signal; at the next step boundary every rank learns whether any rank got one (one tiny all-reduce per step)
so that all of them stop after the same step, write a checkpoint and leave. Under torchrun the launcher
forwards the signal to every rank and waits 30 s before SIGKILL: a save must fit in that. Ctrl-C (SIGINT)
is the same stop, said as "interrupted"; a second Ctrl-C without a launcher stops at once.
"""

from __future__ import annotations

import os
import signal

import torch

from toolkit.dist import DistEnv, all_reduce_max

# SIGINT: Ctrl-C in a terminal reaches the launcher and every rank; they stop like on SIGTERM
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class Stopped(Exception):
    """Every rank stopped after `step` because a stop signal arrived; `checkpoint` holds the run."""

    def __init__(self, signum: int, step: int, total: int, checkpoint):
        super().__init__(f"{signal.Signals(signum).name} at step {step} of {total}")
        self.signum, self.step, self.total, self.checkpoint = signum, step, total, checkpoint


class NonFinite(Exception):
    """The global-batch loss or the gradient norm of `step` is not finite (without fp16 loss scaling, which
    handles its own overflows): the run stopped before any checkpoint could hold it."""

    def __init__(self, what: str, value: float, step: int):
        super().__init__(f"non-finite {what} ({value}) at step {step}")
        self.what, self.value, self.step = what, value, step


class StopSignals:
    """Notes SIGTERM / SIGUSR1 instead of dying; `requested()` says, on every rank alike, whether to stop."""

    def __init__(self) -> None:
        self.received = 0
        self._previous: dict[int, object] = {}

    def install(self) -> "StopSignals":
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._note)
        return self

    def _note(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.received == signal.SIGINT and "TORCHELASTIC_RUN_ID" not in os.environ:
            # a second Ctrl-C: stop now, without the checkpoint (under a launcher the second one is the copy
            # torch's agent forwards of the first, and its own timeout ends a rank that does not stop)
            raise KeyboardInterrupt
        self.received = self.received or signum

    def requested(self, env: DistEnv) -> int:
        """Collective: the signal any rank received (0: none)."""
        flag = torch.tensor([float(self.received)], dtype=torch.float64)
        return int(all_reduce_max(flag, env).item()) if env.distributed else self.received

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
