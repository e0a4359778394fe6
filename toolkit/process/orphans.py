"""A rank of `toolkit launch` (or of plain `torchrun` / `accelerate launch`) does not outlive its launcher.

torch's agent starts each rank in a session of its own (Popen(start_new_session=True)), so a launcher killed
with SIGKILL (or by the OOM killer) takes nothing with it: its ranks train on to the end, or wait in a
collective forever when one of them dies. Each rank therefore asks the kernel for a signal when its parent
dies (prctl PR_SET_PDEATHSIG, Linux), as the first thing its process does (toolkit/__main__.py).

PR_SET_PDEATHSIG fires when the *thread* that forked the child ends, not the process. In torch 2.13 the agent
starts the ranks in the thread that called torch.distributed.run's run(): LocalElasticAgent._start_workers ->
start_processes -> SubprocessContext._start -> Popen, and a restart (--max-restarts) goes through
_restart_workers from the same _invoke_run loop, in the same thread. `toolkit launch` calls run() from its main
thread (launch.launch passes its pid only from there), and that thread ends only with the process. So do
`torchrun` (torch.distributed.run's main -> run -> elastic_launch) and `accelerate launch` (multi_gpu_launcher ->
torch.distributed.run's run): a rank they start (TORCHELASTIC_RUN_ID set) follows its parent, the agent.

The signal is SIGTERM, not SIGKILL: the ranks take it as a stop (toolkit.process.stopping), agree on it at the next
step boundary, write a checkpoint and leave, so a launcher killed by mistake or by the OOM killer loses
nothing that --resume cannot continue. A rank that cannot act on it (blocked in a collective whose peer hangs
or died: Python runs a signal handler only between bytecodes of the main thread) is ended by a watch thread
with SIGKILL ORPHAN_GRACE_S after the launcher is gone, the time torch's agent itself gives ranks between its
SIGTERM and its SIGKILL.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

LAUNCHER_PID_ENV = "TOOLKIT_LAUNCHER_PID"  # set by `toolkit launch` for its ranks: the process that starts them
LAUNCHED_AT_ENV = "TOOLKIT_LAUNCHED_AT"  # set by `toolkit launch` for its ranks: when it started them (a time.time())
FOLLOWED_ENV = "TOOLKIT_FOLLOWS_LAUNCHER"  # set in a rank that follows its launcher: not in what the rank starts
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
ORPHAN_GRACE_S = 30.0  # torch's agent: SIGTERM, then SIGKILL after its shutdown timeout of 30 s
WATCH_INTERVAL_S = 1.0


def follow_launcher(*, grace_s: float = ORPHAN_GRACE_S) -> None:
    """In a rank of `toolkit launch` (LAUNCHER_PID_ENV set) or of torch's elastic agent (torchrun, accelerate
    launch: TORCHELASTIC_RUN_ID set, the agent is the parent): SIGTERM when the launcher dies, SIGKILL `grace_s`
    later if the rank is still there. Elsewhere (a single process, not Linux) nothing. The variables are
    removed (FOLLOWED_ENV set) so that processes this rank starts do not take the launcher for their parent."""
    value = os.environ.pop(LAUNCHER_PID_ENV, None)
    if value is None and "TORCHELASTIC_RUN_ID" in os.environ and FOLLOWED_ENV not in os.environ:
        value = str(os.getppid())  # the agent that started this rank (or a wrapper it ran, which waits for it)
    if value is None or sys.platform != "linux":
        return
    os.environ[FOLLOWED_ENV] = "1"
    launcher = int(value)
    _followed["launcher"] = launcher
    if _set_parent_death_signal(signal.SIGTERM) and os.getppid() != launcher:
        # the launcher died before the request was made: no signal will come, and nothing has started yet
        raise SystemExit(128 + signal.SIGTERM)
    threading.Thread(target=_end_when_orphaned, args=(launcher, grace_s), name="toolkit-launcher-watch",
                     daemon=True).start()


_followed: dict[str, int] = {}  # the launcher this rank follows (follow_launcher)


def launcher_gone() -> bool:
    """Whether the launcher this rank follows has died (the rank was re-parented): a SIGTERM now is its death
    signal, not a scheduler's or a user's."""
    return "launcher" in _followed and os.getppid() != _followed["launcher"]


def _set_parent_death_signal(signum: int) -> bool:
    """prctl(PR_SET_PDEATHSIG, signum) through libc; False where it cannot be made (no glibc, a sandbox)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _end_when_orphaned(launcher: int, grace_s: float) -> None:
    """The backstop of the death signal: once this process's parent is no longer the launcher (it died; the
    rank was re-parented), wait `grace_s` for the rank's own stop, then SIGKILL it. A poll, not a wait on the
    launcher: it takes no GIL for long and works where the death signal could not be set."""
    while os.getppid() == launcher:
        time.sleep(WATCH_INTERVAL_S)
    time.sleep(grace_s)
    os.kill(os.getpid(), signal.SIGKILL)
