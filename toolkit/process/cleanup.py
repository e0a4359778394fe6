"""After a user's mistake, what the run made goes again: nothing half-written is left for a rerun to trip on."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path


def entries(folder: Path) -> set[str] | None:
    """The names `folder` holds; None where nothing is there (the run makes the folder)."""
    if not os.path.lexists(folder):  # False, not an error, for a name the file system refuses (train says so)
        return None
    try:
        return {path.name for path in folder.iterdir()}
    except OSError:  # a file, a folder this process cannot read: nothing of it is removed
        return set()


def remove_made(folder: Path, *, before: set[str] | None) -> None:
    """After a user's mistake: remove what this run made in `folder` (output_dir, its TensorBoard folder), the
    folder itself if the run made it (`before`: `entries` at the start). A folder made beforehand (a job script's
    `mkdir -p`) keeps only what it held: left in output_dir, run.json and metrics.jsonl made a rerun "already hold
    a run" and --resume find no checkpoint."""
    if before is None:
        shutil.rmtree(folder, ignore_errors=True)
        return
    for name in (entries(folder) or set()) - before:
        path = folder / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def make_folders(out_dir: Path) -> list[Path]:
    """A folder (a run's output_dir, convert's OUT) made with the folders above it it needs, one at a time: those
    this process made, outermost first (another process making the same ones at once keeps its own). A path no
    folder can take stops it: the recipe's checks, or the write that follows, say why."""
    made = []
    for folder in (*reversed(out_dir.parents), out_dir):
        try:
            os.mkdir(folder)
        except FileExistsError:
            continue
        except (OSError, ValueError):
            break
        made.append(folder)
    return made


def remove_empty(folders: list[Path]) -> None:
    """Each folder, deepest first, where it is empty: what make_folders made, once a failed run or write is gone."""
    for folder in folders:
        with contextlib.suppress(OSError, ValueError):
            folder.rmdir()
