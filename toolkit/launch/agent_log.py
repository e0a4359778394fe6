"""What torch's elastic agent does between the launch's own lines, read from its log records (the toolkit keeps
them off the terminal: quiet_agent_logs): a rank that failed and the restart of every rank (--max-restarts),
and after a stop signal the wait for the ranks to finish their step and the kill of those that did not."""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any

AGENT_LOGGER = "torch.distributed.elastic.agent.server.api"  # the restarts, the stop signal it forwards
PROCESSES_LOGGER = "torch.distributed.elastic.multiprocessing.api"  # the first failed rank, the kills at shutdown


def shutdown_timeout_s() -> int:
    """How long torch's agent waits for the ranks after it forwards a stop signal, before it kills them: the
    environment's PET_SHUTDOWN_TIMEOUT (torch.distributed.run's --shutdown-timeout), else
    TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30 s."""
    given = os.environ.get("PET_SHUTDOWN_TIMEOUT") or os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT") or "30"
    try:
        return int(given)
    except ValueError:  # torch's own parser refuses it, in its words
        return 30


class AgentWatch(logging.Handler):
    """Says in one line what the agent's records tell, and keeps what the launch says after it:
    - a rank that failed while restarts remain: which and how, and that every rank restarts from the newest
      checkpoint (otherwise the restart is silent: the launch's next lines are the resumed run's);
    - a stop signal the agent forwarded: once the ranks have not stopped within `patience_s`, that it waits for
      them (a rank blocked in a collective whose peer hangs finishes no step) and how long before it kills them;
    - `killed`: the ranks it killed at the end of that wait (they wrote nothing of the stop)."""

    def __init__(self, *, one_machine: bool, patience_s: float = 5.0):
        super().__init__(logging.INFO)
        self.timeout_s, self.one_machine = shutdown_timeout_s(), one_machine
        self.patience_s = min(patience_s, self.timeout_s / 3)
        self.killed = 0
        self.stop_signal: str | None = None
        self._failed: str | None = None  # the first failed rank of the attempt, until the agent restarts or ends
        self._timer: threading.Timer | None = None
        self._saved: list[tuple[logging.Logger, int, bool]] = []

    def attach(self, *, quiet: bool) -> None:
        """On the agent's two loggers; `quiet` (no LOGLEVEL): their records reach this handler only."""
        for name in (AGENT_LOGGER, PROCESSES_LOGGER):
            logger = logging.getLogger(name)
            self._saved.append((logger, logger.level, logger.propagate))
            logger.addHandler(self)
            if quiet:
                logger.setLevel(logging.INFO)
                logger.propagate = False

    def detach(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        for logger, level, propagate in self._saved:
            logger.removeHandler(self)
            logger.setLevel(level)
            logger.propagate = propagate
        self._saved.clear()

    def emit(self, record: logging.LogRecord) -> None:
        message, args = str(record.msg), tuple[Any, ...](record.args) if isinstance(record.args, tuple) else ()
        if message.startswith("failed (exitcode:") and len(args) >= 2:
            from toolkit.launch.exits import describe_failures

            rank = int(args[1])
            self._failed = describe_failures({rank: int(args[0])})
            if not self.one_machine:
                self._failed = self._failed.replace(f"rank {rank}", f"local rank {rank} on this machine", 1)
        elif "attempts left" in message and len(args) >= 4:
            left, most = int(args[2]), int(args[3])
            what = self._failed or f"the ranks {str(args[1]).lower()}"
            say(f"{what}; restarting every rank (restart {most - left + 1} of {most}): they resume from the run's "
                "newest checkpoint")
            self._failed = None
        elif "death signal" in message and args:
            self.stop_signal = getattr(args[0], "name", str(args[0]))
            self._timer = threading.Timer(self.patience_s, self._waiting)
            self._timer.daemon = True
            self._timer.start()
        elif message.startswith("Unable to shutdown process"):
            self.killed += 1

    def _waiting(self) -> None:
        say(f"{self.stop_signal}: waiting for the ranks to finish their step and checkpoint; those still running "
            f"{self.timeout_s} s after the signal are killed (a rank blocked in a collective whose peer hangs cannot "
            "finish)")


def say(line: str) -> None:
    print(f"toolkit: {line}", file=sys.stderr, flush=True)
