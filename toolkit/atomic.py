"""Files written whole: into a temporary name beside the target, renamed into place. A reader (a resumed
run, `toolkit compare`, a concurrent planner) finds the old file or the new one, never a part of one. And the
user's cache folder such files are kept in between commands (cache_dir)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


def write_whole(path: Path, writer: Callable[[Path], object], *, durable: bool = False) -> None:
    """`writer(tmp)` writes the file at `tmp`; it is then renamed to `path`. The temporary name carries the
    pid (two processes writing one path do not write into each other's) and is removed if anything fails.
    durable: fsync the file before the rename (a manifest that says a checkpoint is complete)."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        writer(partial)
        if durable:
            with open(partial, "rb") as handle:
                os.fsync(handle.fileno())
        partial.replace(path)
    except OSError as exc:  # a full disk: the error names the file meant, not its temporary name (or none)
        if exc.errno is not None and exc.filename in (None, str(partial)):  # (a bare OSError("...") keeps its text)
            exc.filename = str(path)
        raise
    finally:
        partial.unlink(missing_ok=True)


def write_text_whole(path: Path, text: str, *, durable: bool = False) -> None:
    write_whole(path, lambda tmp: tmp.write_text(text), durable=durable)


def cache_dir(kind: str) -> Path:
    """$TOOLKIT_CACHE/<kind>, else the user's cache folder (XDG_CACHE_HOME or ~/.cache)/toolkit/<kind>; a
    RuntimeError where no home is to be found (an arbitrary container user), which a cache treats as no cache."""
    root = os.environ.get("TOOLKIT_CACHE")
    if root:
        return Path(root) / kind
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "toolkit" / kind
