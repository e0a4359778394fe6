"""Build locks no process holds, left by one killed while it loaded a JIT-built op: found and removed.

torch builds a C++ extension (DeepSpeed's CPU ops: the shared-memory collectives every ZeRO run starts, CPU Adam
for offload) in its extensions folder under a lock file (torch.utils.file_baton.FileBaton): the process that
creates the file holds it open, and removes it when done; any other waits, with no time limit and no word, for
as long as the file is there. Every load takes the lock, of an op long built too. So a rank killed during a load
(Ctrl-C, a timeout, the kernel's OOM killer) leaves a file that makes every later DeepSpeed run of that user on
that machine hang before its first step. A lock is stale when no process has it open, twice, a moment apart (a
process that releases one closes it an instant before it removes it): that file is removed, and said in a line.
Only the user's own locks are judged, as only their processes' open files can be read here (Linux's /proc)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

SETTLE_S = 0.5  # between the two looks: far longer than a release's close-then-remove


def extension_roots() -> list[Path]:
    """The folders torch builds extensions under: TORCH_EXTENSIONS_DIR, else its per-user cache folder."""
    chosen = os.environ.get("TORCH_EXTENSIONS_DIR")
    if chosen:
        return [Path(chosen)]
    from torch.utils.cpp_extension import get_default_build_root

    return [Path(get_default_build_root())]


def locks_under(root: Path) -> list[Path]:
    """root/<op>/lock (TORCH_EXTENSIONS_DIR) and root/<python>_<device>/<op>/lock (the default cache)."""
    if not root.is_dir():
        return []
    return sorted([*root.glob("*/lock"), *root.glob("*/*/lock")])


def held_open(paths: set[str], proc: Path = Path("/proc")) -> set[str]:
    """Which of paths some process of this user has open, from each process's file descriptors."""
    held: set[str] = set()
    for fd_dir in proc.glob("[0-9]*/fd"):
        try:
            entries = list(os.scandir(fd_dir))
        except OSError:  # another user's process, or one that ended while being read
            continue
        for entry in entries:
            try:
                target = os.readlink(entry.path)
            except OSError:
                continue
            if target in paths:
                held.add(target)
    return held


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    return (stat.st_ino, stat.st_mtime_ns) if stat.st_uid == os.getuid() else None


def stale_locks(locks: list[Path], settle_s: float = SETTLE_S) -> list[Path]:
    """The locks of this user that no process had open at two looks settle_s apart, the same file both times."""
    first = {str(lock): _identity(lock) for lock in locks}
    first = {path: ident for path, ident in first.items() if ident is not None}
    if not first:
        return []
    unheld = set(first) - held_open(set(first))
    if not unheld:
        return []
    time.sleep(settle_s)
    unheld -= held_open(unheld)
    return [Path(path) for path in sorted(unheld) if _identity(Path(path)) == first[path]]


def clear_stale_build_locks(roots: list[Path] | None = None, settle_s: float = SETTLE_S) -> list[Path]:
    """Remove the stale build locks under the extension folders; each removal is said on stderr. Nothing happens
    where the system has no /proc to tell a held lock from a stale one."""
    if not Path("/proc/self/fd").is_dir():
        return []
    locks = [lock for root in (roots if roots is not None else extension_roots()) for lock in locks_under(root)]
    removed = []
    for lock in stale_locks(locks, settle_s):
        try:
            lock.unlink()
        except FileNotFoundError:
            continue
        removed.append(lock)
        print(f"removed {lock}: a build lock no process holds, left by a process killed while it loaded that op "
              "(every later load would have waited for it forever)", file=sys.stderr, flush=True)
    return removed
