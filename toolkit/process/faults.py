"""Fault injection for the tests of what a run survives: real signals at a given step, set by environment
variables (nothing happens unless one is set). Each acts only in a run's first attempt, so that a run
restarted by `--max-restarts` goes on."""

from __future__ import annotations

import os
import resource
import signal
import time
from pathlib import Path

from toolkit.process.dist import DistEnv, restarted

# "RANK:STEP": SIGKILL that rank after that step ("RANK:STEP:SIGSTOP": that signal, a rank hung in its next collective)
KILL_RANK_AT_STEP = "TOOLKIT_FAULT_KILL_RANK_AT_STEP"
SIGTERM_LAUNCHER_AT_STEP = "TOOLKIT_FAULT_SIGTERM_LAUNCHER_AT_STEP"  # rank 0 sends its launcher SIGTERM
KILL_BEFORE_COMMIT_STEP = "TOOLKIT_FAULT_KILL_BEFORE_COMMIT_STEP"  # SIGKILL before a checkpoint is committed
INF_GRADIENT_AT_STEP = "TOOLKIT_FAULT_INF_GRADIENT_AT_STEP"  # an inf gradient before that step's update
NAN_LOSS_AT_STEP = "TOOLKIT_FAULT_NAN_LOSS_AT_STEP"  # that step's loss, as every rank sees it, is NaN
DELAY_FAILURE_LINE = "TOOLKIT_FAULT_DELAY_FAILURE_LINE"  # seconds rank 0 waits before a failed save's line
FULL_METRICS_AT_STEP = "TOOLKIT_FAULT_FULL_METRICS_AT_STEP"  # metrics.jsonl's writes go to /dev/full from then
FULL_DISK_AFTER_STEP = "TOOLKIT_FAULT_FULL_DISK_AFTER_STEP"  # from then no file grows past run.json's size
# "FILE": a resumed run, its checkpoint read, writes FILE.held (rank 0) and lets go of the checkpoint once FILE exists
HOLD_CHECKPOINT_UNTIL = "TOOLKIT_FAULT_HOLD_CHECKPOINT_UNTIL"


def after_step(step: int, env: DistEnv, *, out_dir: Path) -> None:
    if restarted():
        return
    if os.environ.get(FULL_DISK_AFTER_STEP) == str(step):  # a disk as good as full: what is written stays so,
        limit = (out_dir / "run.json").stat().st_size  # and no file grows past this (EFBIG; Python ignores SIGXFSZ)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    rank, at, *how = (os.environ.get(KILL_RANK_AT_STEP) or "::").split(":")
    if f"{rank}:{at}" == f"{env.rank}:{step}":
        os.kill(os.getpid(), getattr(signal, how[0]) if how else signal.SIGKILL)
    if os.environ.get(SIGTERM_LAUNCHER_AT_STEP) == str(step) and env.is_main:
        os.kill(os.getppid(), signal.SIGTERM)  # what a scheduler's preemption does to the launcher


def before_commit(step: int) -> None:
    if not restarted() and os.environ.get(KILL_BEFORE_COMMIT_STEP) == str(step):
        os.kill(os.getpid(), signal.SIGKILL)


def before_update(step: int, model) -> None:
    """An inf in the first gradient of `step`, as an fp16 overflow leaves one (the loss scaler skips the update)."""
    if not restarted() and os.environ.get(INF_GRADIENT_AT_STEP) == str(step):
        next(p.grad for p in model.parameters() if p.grad is not None).fill_(float("inf"))


def before_failure_line() -> None:
    """Rank 0 slower to say why the run failed than the other ranks are to exit (as a loaded machine makes it)."""
    if not restarted() and os.environ.get(DELAY_FAILURE_LINE):
        time.sleep(float(os.environ[DELAY_FAILURE_LINE]))


def step_loss(step: int, loss: float) -> float:
    """The step's loss, or NaN where a test asks for a non-finite loss at this step (train.on_nonfinite's path)."""
    if not restarted() and os.environ.get(NAN_LOSS_AT_STEP) == str(step):
        return float("nan")
    return loss


def before_metrics_write(step: int, file) -> None:
    """metrics.jsonl's file (rank 0's) becomes /dev/full at `step`: its writes fail as on a full disk (ENOSPC)."""
    if not restarted() and os.environ.get(FULL_METRICS_AT_STEP) == str(step):
        full = os.open("/dev/full", os.O_WRONLY)
        os.dup2(full, file.fileno())
        os.close(full)


def before_letting_go_of_checkpoint(env: DistEnv) -> None:
    """A resumed run still holding the checkpoint it read, for as long as a test takes to save past it in the run
    that wrote it (at most 5 minutes)."""
    until = os.environ.get(HOLD_CHECKPOINT_UNTIL)
    if restarted() or not until:
        return
    if env.is_main:
        Path(until + ".held").touch()
    deadline = time.monotonic() + 300
    while not Path(until).exists() and time.monotonic() < deadline:
        time.sleep(0.1)
