"""Ending a run early without losing it: a stop signal (preemption), a non-finite loss, an output that could
not be written.

SIGTERM and SIGUSR1 are what SLURM and Kubernetes send before they kill a job. The handler only notes the
signal; at the next step boundary every rank learns whether any rank got one (one tiny all-reduce per step)
so that all of them stop after the same step, write a checkpoint and leave. Under torchrun the launcher
forwards the signal to every rank and waits 30 s before SIGKILL: a save must fit in that. Ctrl-C (SIGINT)
is the same stop, said as "interrupted"; a second Ctrl-C without a launcher stops at once.
"""

from __future__ import annotations

import errno
import math
import os
import re
import signal

import torch

from toolkit.errors import os_error_text
from toolkit.process.dist import DistEnv, all_reduce_max

# SIGINT: Ctrl-C in a terminal reaches the launcher and every rank; they stop like on SIGTERM
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class Stopped(Exception):
    """Every rank stopped after `step` because a stop signal arrived; `checkpoint` holds the run."""

    def __init__(self, signum: int, step: int, total: int, checkpoint):
        from toolkit.process.orphans import launcher_gone

        gone = " (the launcher died: the kernel's signal to its ranks)" if launcher_gone() else ""
        super().__init__(f"{signal.Signals(signum).name} at step {step} of {total}{gone}")
        self.signum, self.step, self.total, self.checkpoint = signum, step, total, checkpoint


class OutputWriteError(Exception):
    """The run's own outputs could not be written (metrics.jsonl mid-run, the exported model at its end: a full
    disk, a file made read-only), on every rank alike: mid-run they stopped after `step`, its checkpoint written
    (where that disk allows); None: at the export, after the last step. The message is the first part of
    rank.py's one line (which adds the checkpoint to resume); only rank 0, which writes them, knows it.
    before_first_step: output_dir's first files (recipe.yaml, run.json) could not be written: nothing trained."""

    def __init__(self, message: str, *, step: int | None = None, last_step: int | None = None,
                 before_first_step: bool = False) -> None:
        super().__init__(message)
        self.step, self.last_step = step, last_step  # last_step: the run's, where the export failed
        self.before_first_step = before_first_step


def write_error_text(exc: BaseException) -> str | None:
    """A failed write as a user reads it ('No space left on device (ENOSPC)'), or None where `exc` is not one:
    an OSError, or safetensors' own error for one (it raises no OSError: 'I/O error: No space left on device')."""
    if isinstance(exc, OSError):
        return os_error_text(exc)
    text = str(exc)
    if type(exc).__name__ != "SafetensorError" or "I/O error: " not in text:
        return None
    text = text.split("I/O error: ", 1)[1].strip()
    number = re.search(r"\(os error (\d+)\)$", text)  # named as an OSError's: 'File too large (EFBIG)'
    name = errno.errorcode.get(int(number.group(1))) if number else None
    return f"{text[:number.start()].strip()} ({name})" if number and name else text


class NonFinite(Exception):
    """The global-batch loss or the gradient norm of `step` is not finite (without fp16 loss scaling, which
    handles its own overflows): the run stopped before any checkpoint could hold it. `skipped_from`: under
    train.on_nonfinite=skip, the first of the steps skipped in a row up to `step` (SkippedSteps)."""

    def __init__(self, what: str, value: float, step: int, *, skipped_from: int | None = None):
        where = f"at step {step}" if skipped_from is None else \
            f"at every step from {skipped_from} to {step}, each skipped ({step - skipped_from + 1} in a row)"
        super().__init__(f"non-finite {what} ({value}) {where}")
        self.what, self.value, self.step, self.skipped_from = what, value, step, skipped_from


def nonfinite_value(record: dict) -> tuple[str, float]:
    """Which of a step's loss and gradient norm was not finite (the loss, if both), and its value."""
    if not math.isfinite(record["loss"]):
        return "loss", record["loss"]
    return "gradient norm", record["grad_norm"]


class SkippedSteps:
    """train.on_nonfinite=skip: counts the steps dropped for a non-finite loss or gradient norm, and stops the
    run (NonFinite) at the `limit`-th in a row. A skipped step changes no weight, so when `limit` different
    batches in a row are all non-finite it is the weights that give non-finite values (the forward
    overflows on them), and no number of further skips can recover: the run would only log NaN to its end.
    Also the fp16 loss scale of such a step: the one of the last update (a dropped step leaves the scaler as
    it was), None until an update reported one."""

    def __init__(self, limit: int | None, *, done: int = 0):
        self.limit, self.done = limit, done  # done: the steps before this process's first (a resume)
        self.num_nonfinite = self.num_overflow = self.num_steps = 0
        self.in_row = 0  # the skipped steps since the last update
        self.loss_scale: float | None = None

    def count(self, record: dict) -> NonFinite | None:
        """Note one step's record (loop.train_step's); fills in a dropped step's loss scale. Returns the
        NonFinite to raise once the record is written, when this step is the `limit`-th skipped in a row."""
        self.num_steps += 1
        if not record.get("skipped_nonfinite"):
            self.in_row = 0
            self.num_overflow += bool(record["skipped"])  # fp16 loss scaling skipped it (and lowered its scale)
            self.loss_scale = record["loss_scale"] if record["loss_scale"] is not None else self.loss_scale
            return None
        if record["loss_scale"] is None:
            record["loss_scale"] = self.loss_scale
        self.num_nonfinite += 1
        self.in_row += 1
        if self.limit is None or self.in_row < self.limit:
            return None
        what, value = nonfinite_value(record)
        return NonFinite(what, value, record["step"], skipped_from=record["step"] - self.in_row + 1)

    def summary(self) -> dict:
        """run.json's skipped_steps: the steps this process ran, and those skipped, by why."""
        return {"nonfinite": self.num_nonfinite, "fp16_overflow": self.num_overflow, "steps_run": self.num_steps}

    def note(self) -> str:
        """'3 of 50 steps skipped (non-finite)' for the line a run ends with; '' when none was."""
        if not self.num_nonfinite:
            return ""
        since = f" since the resume at step {self.done}" if self.done else ""
        return f"{self.num_nonfinite} of {self.num_steps} steps{since} skipped (non-finite loss or gradient norm)"


class StopSignals:
    """Notes SIGTERM / SIGUSR1 instead of dying; `requested()` says, on every rank alike, whether to stop."""

    def __init__(self) -> None:
        self.received = 0
        self.write_failure: str | None = None  # rank 0: metrics.jsonl could not be written (why), said by agree
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

    def agree(self, env: DistEnv, *, checkpoint_due: bool = False) -> tuple[int, bool, bool]:
        """Collective, every rank alike: the signal any rank received (0: none), whether any rank's clock says a
        checkpoint is due (checkpoint.every_minutes) and whether an output could not be written (write_failure):
        one all-reduce for the three."""
        flags = torch.tensor([float(self.received), float(checkpoint_due), float(self.write_failure is not None)],
                             dtype=torch.float64)
        if env.distributed:
            flags = all_reduce_max(flags, env)
        return int(flags[0].item()), bool(flags[1].item()), bool(flags[2].item())

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
