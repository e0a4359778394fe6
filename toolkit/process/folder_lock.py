"""One run at a time in a folder. A second `toolkit train` into an output_dir whose run is still going (a job
requeued while the first still runs, a command typed again in another terminal) would interleave metrics.jsonl,
write the same checkpoint steps twice and, refused for a mistake of its own, remove what it believes it made:
the live run's new files. So the process that writes a folder (rank 0 of a run, a compare for its experiment
folder) holds an exclusive flock on the folder itself while it runs: no lock file to leave behind, and the
kernel lets go when the process ends, however it ends (SIGKILL and the out-of-memory killer included). A child
forked while it is held (a DataLoader worker) drops its copy of the descriptor as it starts: an orphaned worker
of a killed rank would keep the folder held for seconds after the rank is gone.
A file system that cannot lock a folder (some network mounts) runs unguarded, as before."""

from __future__ import annotations

import errno
import fcntl
import os
import time
from pathlib import Path

from toolkit.errors import RecipeError


class FolderInUse(RecipeError):
    """The folder is held by another process: it is that process's, and nothing of it may be touched."""


class FolderLock:
    """An exclusive (or, `shared`, a shared) non-blocking flock on a folder, held until `release` or the end of
    the process. Shared: the readers of a checkpoint, which its run's keep_last leaves until they let go."""

    def __init__(self, folder: Path, *, shared: bool = False):
        self.folder = folder
        self.mode = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
        self.fd: int | None = None

    def acquire(self) -> bool:
        """True once held; False where another process holds it. Where the folder cannot be locked (it does not
        exist, a name no file can have, a file system with no flock for folders) nothing is held and True is
        returned: unguarded (the recipe's checks say what is wrong with such a path)."""
        try:
            fd = os.open(self.folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except (OSError, ValueError):  # ValueError: a NUL in the path
            return True
        try:
            fcntl.flock(fd, self.mode | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            return exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN)
        self.fd = fd
        _HELD.add(self)
        return True

    def release(self) -> None:
        if self.fd is not None:
            _HELD.discard(self)
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None

    def _forget_in_child(self) -> None:
        """In a forked child: its copy of the descriptor closed, the parent's lock untouched (no LOCK_UN, which
        would unlock the description both share)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


_HELD: set[FolderLock] = set()  # this process's held locks, which a forked child lets go of


def _after_fork_in_child() -> None:
    for lock in list(_HELD):
        lock._forget_in_child()
    _HELD.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def holder(folder: Path) -> str:
    """Who holds `folder`'s flock, for a user to find it: 'pid N: its command line', from /proc/locks; 'another
    process' where that cannot be read (another machine's, a process of another user)."""
    try:
        stat = os.stat(folder)
        wanted = f"{os.major(stat.st_dev):02x}:{os.minor(stat.st_dev):02x}:{stat.st_ino}"
        with open("/proc/locks", encoding="ascii") as locks:
            pids = [int(fields[4]) for fields in (line.split() for line in locks)
                    if len(fields) > 5 and fields[1] == "FLOCK" and fields[5] == wanted]
    except (OSError, ValueError):
        return "another process"
    if not pids:
        return "another process"
    pid = pids[0]
    try:
        import psutil

        command = " ".join(_shown(psutil.Process(pid).cmdline()))
    except Exception:  # gone since, or not ours to read
        return f"pid {pid}"
    return f"pid {pid}: {command[:77] + '…' if len(command) > 78 else command}"


def _shown(argv: list[str]) -> list[str]:
    """A rank's command line as a user typed it: `toolkit train ...` for `python -m toolkit train ...` or a
    path to the console script."""
    for i, arg in enumerate(argv):
        if arg == "toolkit" and i > 0 and argv[i - 1] == "-m" or os.path.basename(arg) == "toolkit":
            return ["toolkit", *argv[i + 1:]]
    return argv


def run_in_use(out_dir: Path):
    """The message of a run refused because output_dir is another live run's."""
    return lambda who: (f"output_dir {out_dir} is being written by a run that is still going ({who}); let it end, "
                        "or stop it (SIGTERM: it saves a checkpoint after its current step) and continue it with "
                        "--resume; or write this one elsewhere with --set output_dir=OTHER")


def hold(folder: Path, *, message, wait_s: float = 0.0) -> FolderLock:
    """The folder's lock, held; FolderInUse(message(holder)) where another process holds it (after trying for
    `wait_s`: a restarted rank whose predecessor is still on its way out)."""
    lock = FolderLock(folder)
    if not acquire_within(lock, wait_s):
        raise FolderInUse(message(holder(folder)))
    return lock


def acquire_within(lock: FolderLock, wait_s: float, *, poll_s: float = 0.2, waiting=None) -> bool:
    """`lock` acquired, tried every `poll_s` until it holds or `wait_s` have passed (False then); `waiting()` is
    called once, at the first try that found it held."""
    deadline = time.monotonic() + wait_s
    while not lock.acquire():
        if time.monotonic() >= deadline:
            return False
        if waiting is not None:
            waiting()
            waiting = None
        time.sleep(poll_s)
    return True


def in_use(folder: Path) -> str | None:
    """Who holds `folder` now (holder's words), or None where no other process does; nothing held after."""
    probe = FolderLock(folder)
    if probe.acquire():
        probe.release()
        return None
    return holder(folder)


def check_free(folder: Path, *, message) -> None:
    """FolderInUse where another process holds the folder now (a launcher's check before its ranks start, which
    then take the lock themselves)."""
    who = in_use(folder)
    if who is not None:
        raise FolderInUse(message(who))
