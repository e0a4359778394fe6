"""Files that ended DeepSpeed processes left behind and later runs would trip on: found and removed before a run.

- **Build locks.** torch builds a C++ extension (DeepSpeed's CPU ops: CPU Adam for optimizer offload, the
  shared-memory collectives ZeRO runs started before) in its extensions folder under a lock file (FileBaton): the
  process that creates the file holds it open and removes it when done; any other waits, with no time limit and no
  word, for as long as the file is there. Every load takes the lock, of an op long built too, so a rank killed
  during a load (Ctrl-C, a timeout, the OOM killer) leaves a file that makes every later DeepSpeed run of that user
  on that machine hang before its first step.
- **Shared-memory segments.** DeepSpeed's CPU collectives (deepspeed/ops/csrc/cpu/comm/shm.cpp) create one
  segment per rank, `/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>`, 66 MB each, when all ranks
  are on one machine, and never unlink it: each such run kept 66 MB of memory per rank until the machine restarted
  (290 of them, 19 GB of a 24 GiB machine, after a day of test runs). The toolkit's ZeRO runs no longer start
  those collectives (toolkit.strategies.zero.comm); what earlier runs or other DeepSpeed programs left stays until
  this finds it.

A file is stale when no process has it open or mapped, at two looks a moment apart (a process that releases a lock
closes it an instant before it removes it), the same file both times: it is removed, and said in a line. Only the
user's own files are judged, as only their processes' open files can be read here (Linux's /proc). A build lock on a
filesystem other machines may share (a cluster's home over NFS) may be held by a build on another machine, which
/proc here cannot see: it is removed only once older than any build, and a younger one is said with its command."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

SETTLE_S = 0.5  # between the two looks: far longer than a release's close-then-remove
SHM = Path("/dev/shm")
SHM_PREFIX = "deepspeed_allreduce_buffer"  # shm.cpp's SHM_BUFFER_NAME
# filesystems only this machine writes: a build lock there that no process here holds is stale
LOCAL_FILESYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "jfs", "reiserfs", "tmpfs",
                               "ramfs", "overlay", "apfs"})
SHARED_LOCK_AGE_S = 600  # on any other: a lock this old is no build's (DeepSpeed's CPU ops build in about a minute)


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


def shm_segments(folder: Path = SHM) -> list[Path]:
    """This user's DeepSpeed collective segments: shm.cpp names them by uid, master address, port and rank."""
    return sorted(folder.glob(f"{SHM_PREFIX}_{os.getuid()}_*")) if folder.is_dir() else []


def in_use(paths: set[str], proc: Path = Path("/proc")) -> set[str]:
    """Which of paths some process of this user has open (its file descriptors) or mapped (its maps)."""
    used: set[str] = set()
    for pid_dir in proc.glob("[0-9]*"):
        try:
            entries = list(os.scandir(pid_dir / "fd"))
        except OSError:  # another user's process, or one that ended while being read
            continue
        for entry in entries:
            try:
                target = os.readlink(entry.path)
            except OSError:
                continue
            if target in paths:
                used.add(target)
        try:
            maps = (pid_dir / "maps").read_text()
        except OSError:
            continue
        used.update(path for path in paths if path in maps)
    return used


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    return (stat.st_ino, stat.st_mtime_ns) if stat.st_uid == os.getuid() else None


def stale(paths: list[Path], settle_s: float = SETTLE_S) -> list[Path]:
    """Those of paths, this user's, that no process had open or mapped at two looks settle_s apart, the same file
    both times."""
    first = {str(path): _identity(path) for path in paths}
    first = {path: ident for path, ident in first.items() if ident is not None}
    if not first:
        return []
    unused = set(first) - in_use(set(first))
    if not unused:
        return []
    time.sleep(settle_s)
    unused -= in_use(unused)
    return [Path(path) for path in sorted(unused) if _identity(Path(path)) == first[path]]


def _remove(paths: list[Path]) -> list[tuple[Path, int]]:
    removed = []
    for path in paths:
        try:
            size = path.stat().st_size
            path.unlink()
        except FileNotFoundError:
            continue
        removed.append((path, size))
    return removed


def filesystem_type(path: Path, mounts: str | None = None) -> str:
    """The type of the filesystem `path` lies on: the mount point above it that is longest, in /proc/self/mounts."""
    if mounts is None:
        try:
            mounts = Path("/proc/self/mounts").read_text()
        except OSError:
            return "unknown"
    target = os.path.realpath(path)
    best, kind = "", "unknown"
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind


def clear_stale_build_locks(roots: list[Path] | None = None, settle_s: float = SETTLE_S) -> list[Path]:
    """Remove the stale build locks under the extension folders; each removal is said on stderr. On a filesystem
    other machines may share (a cluster's home over NFS, Lustre, ...) a process here cannot see another machine's
    holder: a lock there is removed only once older than SHARED_LOCK_AGE_S (a build takes about a minute), and a
    younger one is said in a line, with the command that removes it."""
    if not Path("/proc/self/fd").is_dir():  # no way to tell a held lock from a stale one
        return []
    locks = [lock for root in (roots if roots is not None else extension_roots()) for lock in locks_under(root)]
    candidates: list[Path] = []
    for lock in stale(locks, settle_s):
        kind = filesystem_type(lock)
        try:
            old = time.time() - lock.stat().st_mtime > SHARED_LOCK_AGE_S
        except FileNotFoundError:
            continue
        if kind in LOCAL_FILESYSTEMS or old:
            candidates.append(lock)
        else:
            print(f"{lock}: a build lock no process on this machine holds, on a {kind} filesystem other machines "
                  "may share; torch waits until it goes. If no machine is building that op, remove it: "
                  f"rm {lock}", file=sys.stderr, flush=True)
    removed = [path for path, _ in _remove(candidates)]
    for lock in removed:
        print(f"removed {lock}: a build lock no process holds, left by a process killed while it loaded that op "
              "(every later load would have waited for it forever)", file=sys.stderr, flush=True)
    return removed


def clear_stale_shm_segments(folder: Path = SHM, settle_s: float = SETTLE_S) -> list[Path]:
    """Remove this user's DeepSpeed shared-memory segments no process uses; said in one line on stderr."""
    if not Path("/proc/self/fd").is_dir():
        return []
    removed = _remove(stale(shm_segments(folder), settle_s))
    if removed:
        total = sum(size for _, size in removed)
        print(f"removed {len(removed)} DeepSpeed shared-memory segment(s) in {folder} that ended runs left behind "
              f"({total / 2 ** 20:,.0f} MiB of memory held until the machine restarts)", file=sys.stderr, flush=True)
    return [path for path, _ in removed]


def clear_deepspeed_leftovers() -> None:
    """Both, before a process's DeepSpeed loads its ops and starts its collectives."""
    clear_stale_build_locks()
    clear_stale_shm_segments()
