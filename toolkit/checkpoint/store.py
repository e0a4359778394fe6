"""Checkpoint folders on disk: names, the manifest, the atomic commit, keep_last, finding the newest.

Nothing here touches tensors: see toolkit/checkpoint/state.py for what goes into a checkpoint.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from toolkit.atomic import write_text_whole
from toolkit.checkpoint import digest
from toolkit.config.files import dump_recipe
from toolkit.config.recipe import Recipe
from toolkit.errors import RecipeError
from toolkit.process import faults, folder_lock

FORMAT = "toolkit-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
DCP_METADATA = ".metadata"  # written by DCP's coordinator once every rank's files are complete
NAME = re.compile(r"^step-(\d{8})$")


def checkpoints_dir(out_dir: Path) -> Path:
    return Path(out_dir) / "checkpoints"


def final_path(out_dir: Path, step: int) -> Path:
    return checkpoints_dir(out_dir) / f"step-{step:08d}"


def partial_path(out_dir: Path, step: int) -> Path:
    return checkpoints_dir(out_dir) / f".step-{step:08d}.partial"


def recipe_hash(recipe: Recipe) -> str:
    return hashlib.sha256(dump_recipe(recipe).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    manifest: dict

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    @property
    def records_digests(self) -> bool:
        """Its save recorded digests.json (a checkpoint written before the toolkit did has no such key)."""
        return self.manifest.get("digests") == digest.DIGESTS


def is_complete(path: Path) -> bool:
    return (path / MANIFEST).is_file() and (path / DCP_METADATA).is_file()


def complete_checkpoints(out_dir: Path) -> list[Path]:
    """The committed checkpoints of a run, oldest first (a partial save is never among them)."""
    root = checkpoints_dir(out_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and NAME.match(p.name) and is_complete(p)]
    return sorted(found, key=step_of)


def step_of(path: Path) -> int:
    """The step a checkpoint folder's name says (step-N)."""
    return int(NAME.match(path.name).group(1))  # type: ignore[union-attr]


def read_checkpoint(path: Path, *, resuming: bool = True) -> Checkpoint:
    """A checkpoint folder given by the user or found in output_dir; RecipeError (one line) if it is not one.
    `resuming`: given to --resume (which alone finds the newest), not to `toolkit convert`."""
    path = Path(path)
    if not path.is_dir():
        newest = ", or --resume alone for the newest" if resuming else ""
        inside = f" (the folder holding it: {path.parent})" if path.name == MANIFEST else ""
        raise RecipeError(f"checkpoint {path} does not exist or is not a folder{inside}; pass an "
                          f"output_dir/checkpoints/step-N folder{newest}")
    if re.fullmatch(r"\.step-\d+\.partial", path.name):  # written until a crash or a stop: never committed
        raise RecipeError(f"{path} is a save that was never committed (the run ended while writing it: its files may "
                          "be incomplete or of different steps); use a complete checkpoint, checkpoints/step-N")
    if not (path / MANIFEST).is_file():
        how = "pass it with --resume alone, or one of its checkpoints/step-N" if resuming else \
            "pass one of its checkpoints/step-N"
        hint = f" (a run folder: {how})" if checkpoints_dir(path).is_dir() else ""
        raise RecipeError(f"{path} is not a toolkit checkpoint: no {MANIFEST}{hint}")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise RecipeError(f"checkpoint {path}: {MANIFEST} is unreadable ({exc}); the checkpoint is corrupted, "
                          "use an earlier one") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise RecipeError(f"{path} is not a toolkit checkpoint ({MANIFEST} has no format {FORMAT!r})")
    if manifest.get("version") != VERSION:
        raise RecipeError(f"checkpoint {path} has format version {manifest.get('version')}; this toolkit reads "
                          f"version {VERSION}")
    if not (path / DCP_METADATA).is_file():
        raise RecipeError(f"checkpoint {path} is incomplete (no {DCP_METADATA}); use an earlier one")
    return Checkpoint(path=path, manifest=manifest)


def find_resume(out_dir: Path, given: str | None) -> Checkpoint:
    """The checkpoint `--resume` means: the given folder, or the newest complete one in output_dir."""
    if given:
        return read_checkpoint(Path(given))
    found = complete_checkpoints(out_dir)
    if not found:
        fresh = (f"remove {out_dir} (its run wrote no checkpoint) and start again without --resume"
                 if holds_run(out_dir) else "start the run without --resume")
        raise RecipeError(f"--resume: no complete checkpoint in {checkpoints_dir(out_dir)}; {fresh}, or pass a "
                          "checkpoint folder with --resume PATH")
    return read_checkpoint(found[-1])


def newest_checkpoint_in(path: Path) -> Path | None:
    """Where a checkpoint is asked for and a run's folder or its checkpoints/ folder is given: that run's newest
    complete checkpoint (None where `path` is a checkpoint itself, or holds none)."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return None
    run = path.parent if path.name == "checkpoints" and not checkpoints_dir(path).is_dir() else path
    found = complete_checkpoints(run)
    return found[-1] if found else None


def saved_recipe(path: Path) -> dict | None:
    """The recipe.yaml a checkpoint holds (its run's resolved recipe), as plain data; None where it is missing,
    unreadable or no mapping. A record: a checkpoint is read by its tensors and manifest, not by this."""
    import yaml

    try:
        raw = yaml.safe_load((Path(path) / "recipe.yaml").read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return None
    return raw if isinstance(raw, dict) else None


def holds_checkpoint(out_dir: Path, path: Path) -> bool:
    """Whether the checkpoint folder `path` is one of output_dir's own."""
    return Path(path).resolve().parent == checkpoints_dir(out_dir).resolve()


def read_run_info(out_dir: Path) -> dict | None:
    """output_dir's run.json (runinfo.py writes it); None where it is missing or is no JSON object (cut short,
    edited by hand): every reader takes such a run as one that did not complete."""
    try:
        info = json.loads((Path(out_dir) / "run.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def completed_run(out_dir: Path, *, total_steps: int) -> bool:
    """output_dir's run.json says its run completed, at `total_steps`."""
    info = read_run_info(out_dir) or {}
    return info.get("status") == "completed" and info.get("total_steps") == total_steps


EXPORTS = ("model", "model-merged")  # export_model's folders in output_dir


def set_aside_later(out_dir: Path, step: int) -> Path | None:
    """Rank 0: the complete checkpoints after `step` move into checkpoints/set-aside-after-step-N-TIME (a name
    no checkpoint has); the folder, or None when there were none. The exported model/ (and model-merged/) go with
    them: the run went past `step`, so an export there is the given-up steps' (or, after a run extended beyond an
    earlier finish, weights the branch re-trains from); left in place it would pass for this branch's until the
    branch exports its own at its end."""
    later = [p for p in complete_checkpoints(out_dir) if step_of(p) > step]
    if not later:
        return None
    aside = checkpoints_dir(out_dir) / f"set-aside-after-step-{step:08d}-{time.strftime('%Y%m%d-%H%M%S')}"
    locks = []
    try:
        for path in later:  # a process reading one (a fork resuming from it, a convert) reads it to the end first
            lock = taken_from_readers(path, doing="this run sets it aside (it branches at an earlier step)")
            if lock is None:
                raise RecipeError(f"checkpoint {path}, which resuming from step {step} sets aside, is still being "
                                  f"read by {folder_lock.holder(path)} after {TAKE_WAIT_S / 60:.0f} min; resume once "
                                  "that process has ended")
            locks.append(lock)
        aside.mkdir()
        for path in [*later, *(Path(out_dir) / name for name in EXPORTS if (Path(out_dir) / name).is_dir())]:
            path.rename(aside / path.name)
    finally:
        for lock in locks:
            lock.release()
    return aside


def holds_run(out_dir: Path) -> bool:
    out_dir = Path(out_dir)
    return any((out_dir / name).exists() for name in ("run.json", "metrics.jsonl", "checkpoints", "model"))


def check_output_dir(out_dir: Path, *, resume: bool) -> None:
    """Never overwrite a run silently: an output_dir that holds one needs --resume (or another output_dir). A run's
    output_dir is a folder, or one it can make: checked before anything is written."""
    check_creatable(out_dir)
    check_not_in_a_run(out_dir, what="output_dir", fix="write this run elsewhere with --set output_dir=OTHER")
    if not resume and holds_run(out_dir):
        if not complete_checkpoints(out_dir):  # --resume would find nothing: say what does help
            if (read_run_info(out_dir) or {}).get("status") == "completed":  # checkpoint.final null, a quick run
                raise RecipeError(f"output_dir {out_dir} holds a completed run (its model in {out_dir / 'model'}; no "
                                  "checkpoint, so it cannot be trained further); remove that folder to start again "
                                  "there, or write this one elsewhere with --set output_dir=OTHER")
            raise RecipeError(f"output_dir {out_dir} holds a run that wrote no checkpoint, so --resume cannot "
                              f"continue it; remove that folder to start again there, or write this one elsewhere "
                              f"with --set output_dir=OTHER")
        info = read_run_info(out_dir) or {}
        if info.get("status") == "completed":  # --resume would find nothing left to do at the same max_steps
            raise RecipeError(f"output_dir {out_dir} holds a completed run ({info.get('total_steps')} steps); write "
                              f"this one elsewhere with --set output_dir=OTHER, or train that one further with a "
                              f"larger train.max_steps and --resume")
        raise RecipeError(f"output_dir {out_dir} already holds a run; continue it with --resume, or write this "
                          f"one elsewhere with --set output_dir=OTHER")


def check_not_in_a_run(path: Path, *, what: str, fix: str) -> None:
    """`path` (a run's output_dir, an experiment folder, a converted model's folder) is no part of another run's:
    not a checkpoint nor in one (what is written there changes its files, and its digests then refuse it), not in
    a run's checkpoints/ or model/ (its keep_last, branches and export delete or replace what is there), and not
    in the folder of a run still going. Any other folder under a run's is the user's own."""
    try:
        resolved = Path(path).resolve()
    except (OSError, RuntimeError, ValueError):  # a link loop, a NUL: check_creatable says
        return
    for folder in (resolved, *resolved.parents):
        try:
            why = _part_of_a_run(folder, leaf=folder == resolved)
        except (OSError, ValueError):  # a name too long, an unreadable folder: no run of ours there
            continue
        if why:
            raise RecipeError(f"{what} {path} {why}; {fix}")


def _part_of_a_run(folder: Path, *, leaf: bool) -> str | None:
    """Why `folder` (the path itself, `leaf`, or a folder above it) makes the path part of another run's."""
    if _is_checkpoint(folder):
        return ("is a checkpoint folder: writing into it would damage it" if leaf else
                f"is inside the checkpoint {folder}: writing there would damage it")
    if folder.name in ("checkpoints", *EXPORTS) and is_run_folder(folder.parent):
        where = "is" if leaf else f"is inside {folder}, which is"
        return (f"{where} the run's in {folder.parent}: its keep_last, branches and export delete or replace what "
                "is there")
    if not leaf and is_run_folder(folder):
        who = folder_lock.in_use(folder)
        if who is not None:
            return f"is inside the folder of the run in {folder}, which is still going ({who})"
    return None


def _is_checkpoint(folder: Path) -> bool:
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and manifest.get("format") == FORMAT


def is_run_folder(path: Path) -> bool:
    """A run's output_dir: its run.json (status and strategy) or a complete checkpoint."""
    info = read_run_info(path)
    return bool(info is not None and "status" in info and "strategy" in info) or bool(complete_checkpoints(path))


def check_creatable(out_dir: Path, *, what: str = "output_dir") -> None:
    """`out_dir`, or its nearest parent that exists, is a folder this process can make a folder in. Tried, not
    inferred from permission bits: root passes os.access everywhere, also in /proc, where mkdir still fails."""
    fix = f"choose another {what}"
    if "\0" in str(out_dir):  # exists() says False for it, and mkdir raises ValueError
        raise RecipeError(f"{what} {str(out_dir)!r} holds a NUL character; {fix}")
    try:  # exists() is False for a missing path, and raises for a name the file system refuses (too long)
        nearest = next(p for p in (out_dir, *out_dir.parents) if p.exists())
        dangling = out_dir.is_symlink() and nearest != out_dir  # mkdir finds it there (EEXIST), every write fails
    except OSError as exc:
        raise RecipeError(f"{what} {out_dir}: {exc.strerror}; {fix}") from None
    if dangling:
        raise RecipeError(f"{what} {out_dir} is a link to {os.readlink(out_dir)}, which does not exist; make that "
                          f"folder, or {fix}")
    if not nearest.is_dir():
        raise RecipeError(f"{what} {out_dir}: {nearest} is a file, not a folder; {fix}")
    try:
        probe = tempfile.mkdtemp(prefix=".toolkit-probe-", dir=nearest)
    except OSError as exc:
        raise RecipeError(f"{what} {out_dir}: no folder can be made in {nearest} ({exc.strerror}); {fix}") from None
    # made: the answer. Then gone, nothing left behind; already gone where another rank, refusing the run for a
    # mistake of its own, removed what appeared in output_dir since it started (process/cleanup.py remove_made)
    with contextlib.suppress(FileNotFoundError):
        os.rmdir(probe)


def remove_partials(out_dir: Path) -> None:
    """Rank 0, before the run's first save: what a crashed save left behind (never resumed from) goes."""
    root = checkpoints_dir(out_dir)
    for stale in root.glob(".step-*.partial") if root.is_dir() else ():
        shutil.rmtree(stale, ignore_errors=True)


def write_manifest(partial: Path, manifest: dict, *, recipe: Recipe, hf_files) -> None:
    """Rank 0, after every rank's tensors are written: the small files, then the manifest last."""
    (partial / "recipe.yaml").write_text(dump_recipe(recipe))
    hf_files(partial / "hf")
    # on disk before the manifest and digests that vouch for them (DCP syncs its own files): after a power
    # loss a committed checkpoint's small files could be empty, and its digest check would refuse it
    hf = [*sorted((partial / "hf").rglob("*")), partial / "hf"] if (partial / "hf").is_dir() else []
    _fsync_files([partial / "recipe.yaml", *hf, partial])
    data = {"format": FORMAT, "version": VERSION, **manifest}
    if recipe.checkpoint.digests:
        data["digests"] = digest.DIGESTS  # recorded by commit(); without the key a reader expects none
    write_text_whole(partial / MANIFEST, json.dumps(data, indent=2), durable=True)


def commit(out_dir: Path, step: int, *, keep_last: int, digests: bool = True) -> Path:
    """Rank 0: the partial folder, its digests recorded (unless `digests` is False), becomes the checkpoint,
    then checkpoints beyond keep_last are deleted."""
    faults.before_commit(step)  # tests: a save that dies here must never be resumed from
    if digests:
        digest.record(partial_path(out_dir, step))  # after the manifest: digests.json covers every other file
    final = final_path(out_dir, step)
    if final.exists():  # the same step saved again (a resumed run that ends where its checkpoint was)
        lock = taken_from_readers(final, doing=f"this run replaces it with its new save of step {step}")
        if lock is None:  # one line: CheckpointWriteError (state.written)
            raise OSError(errno.EBUSY, f"{final} is still being read by {folder_lock.holder(final)}")
        try:
            shutil.rmtree(final)
        finally:
            lock.release()
    partial_path(out_dir, step).rename(final)
    _fsync_files([final.parent])
    for old in complete_checkpoints(out_dir)[:-keep_last]:
        remove_unless_read(old)
    return final


def remove_unless_read(path: Path) -> None:
    """keep_last's deletion of an older checkpoint, unless another process is reading it now (a run resuming from
    it, a convert: it holds the folder's shared lock, hold_for_reading): then it stays, said in one line (once), for
    a later save of this run to remove."""
    lock = folder_lock.FolderLock(path)
    if not lock.acquire():
        if path not in _SAID_KEPT:
            _SAID_KEPT.add(path)
            print(f"[toolkit] checkpoint {path} kept past checkpoint.keep_last for now: another process is reading "
                  f"it ({folder_lock.holder(path)}); a later save of this run removes it, or delete it once that "
                  "process has ended", file=sys.stderr, flush=True)
        return
    try:
        shutil.rmtree(path, ignore_errors=True)
    finally:
        lock.release()


_SAID_KEPT: set[Path] = set()  # the checkpoints remove_unless_read said it kept


def taken_from_readers(path: Path, *, doing: str) -> folder_lock.FolderLock | None:
    """The checkpoint folder's lock, held, before this process moves or replaces it: a process reading it
    (hold_for_reading) is waited for, in one line saying `doing`, for up to TAKE_WAIT_S; None if it still reads."""
    lock = folder_lock.FolderLock(path)
    return lock if folder_lock.acquire_within(lock, TAKE_WAIT_S, poll_s=0.5, waiting=lambda: print(
        f"[toolkit] waiting for {folder_lock.holder(path)} to finish reading checkpoint {path}: {doing}",
        file=sys.stderr, flush=True)) else None


TAKE_WAIT_S = 600.0  # a reader holds a checkpoint for a run's start (its build, load and setup) or a convert


_READING: list[folder_lock.FolderLock] = []  # this process's shared locks on the checkpoints it reads


def hold_for_reading(checkpoint: Checkpoint) -> Checkpoint:
    """A checkpoint this process reads (a resume's, a convert's), held from here until `done_reading`: the run
    that wrote it, if still going, leaves it to this reader past its keep_last. RecipeError (one line) where that
    run removed it between finding and holding it."""
    lock = folder_lock.FolderLock(checkpoint.path, shared=True)
    if not folder_lock.acquire_within(lock, READ_WAIT_S):  # a keep_last deletion holds it: it is going
        raise RecipeError(f"checkpoint {checkpoint.path} is held by {folder_lock.holder(checkpoint.path)}, which is "
                          f"removing it, and was not let go in {READ_WAIT_S:.0f} s; pass another checkpoint")
    if not is_complete(checkpoint.path):  # its run's keep_last got there first
        lock.release()
        newer = newest_checkpoint_in(checkpoint.path.parent)
        then = f"; its run's newest is {newer}" if newer is not None else ""
        raise RecipeError(f"checkpoint {checkpoint.path} was removed by its run (checkpoint.keep_last, or a resume "
                          f"that set it aside) before it could be held{then}: pass a checkpoint that is kept")
    _READING.append(lock)
    return checkpoint


READ_WAIT_S = 60.0  # a keep_last deletion holds its folder for as long as removing its files takes


def done_reading() -> None:
    """Every checkpoint `hold_for_reading` holds in this process let go (nothing where none is)."""
    while _READING:
        _READING.pop().release()


def _fsync_files(paths: list[Path]) -> None:
    """Each file's bytes, and each folder's entries, on disk."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class CheckpointWriteError(Exception):
    """A checkpoint whose files could not be written (a full disk, a file size limit): the run ends on it in one
    line, which its message is (rank.py), and run.json's ended.reason says the same."""

    def __init__(self, message: str, *, step: int, on_every_rank: bool = False) -> None:
        super().__init__(message)
        self.step, self.on_every_rank = step, on_every_rank  # DCP's write failed: every rank raises this one


def write_failed(out_dir: Path, step: int, *, why: str, on_every_rank: bool = False) -> CheckpointWriteError:
    """The error of a checkpoint that was not written: its step and folder, why (the OS error), the free space
    where it goes, and the newest intact checkpoint to resume from (what is half-written is never resumed and
    goes at the next start: remove_partials)."""
    root = checkpoints_dir(out_dir)
    try:
        free_bytes = shutil.disk_usage(root if root.is_dir() else out_dir).free
        free = f"{free_bytes / 2**30:,.2f} GiB free on its file system"
    except OSError as exc:
        free = f"its free space unknown ({exc.strerror})"
    found = complete_checkpoints(out_dir)
    newest = f"the newest intact checkpoint is {found[-1]} (--resume)" if found else \
        "no intact checkpoint was written before it"
    return CheckpointWriteError(f"checkpoint of step {step} NOT written to {final_path(out_dir, step)}: {why}; "
                                f"{free}; {newest}", step=step, on_every_rank=on_every_rank)
