"""What ended DeepSpeed processes leave behind no longer hangs the next run or holds the machine's memory.

- torch takes a lock file for every load of a JIT extension (torch.utils.file_baton.FileBaton) and any other process
  waits for it to go, with no time limit. A test run killed during a ZeRO rank's start once left one in the
  extensions cache, and the next `make test` on that machine waited in its op preparation until CI's time limit.
- DeepSpeed's CPU collectives make a 66 MB shared-memory segment per rank and never unlink it: a day of test runs
  left 290 of them in /dev/shm, 19 GB of the machine's 24 GiB."""

import json
import shutil
import os
import subprocess
import sys
import time
from pathlib import Path

from conftest import REPO, toolkit_env, write_recipe
from toolkit.process import leftovers
from toolkit.process.leftovers import SHM, SHM_PREFIX, clear_stale_build_locks, clear_stale_shm_segments

HOLD = "import sys, os, time; fd = os.open(sys.argv[1], os.O_CREAT | os.O_EXCL); print('held', flush=True); " \
       "time.sleep(60)"
# a segment's user as DeepSpeed's peers are after shm_open + mmap, here with the descriptor closed: mapped only
MAP = "import sys, mmap, os, time; fd = os.open(sys.argv[1], os.O_RDWR); m = mmap.mmap(fd, 4096); os.close(fd); " \
      "print('held', flush=True); time.sleep(60)"


def _holding(script: str, path: Path) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", script, str(path)], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "held"
    return process


def _stale(path: Path) -> Path:
    """A lock as a killed loader leaves it: created with O_EXCL, as FileBaton does, then no longer open."""
    path.parent.mkdir(parents=True, exist_ok=True)
    os.close(os.open(path, os.O_CREAT | os.O_EXCL))
    return path


def test_a_lock_no_process_holds_is_removed_and_a_held_one_is_kept(tmp_path):
    root = tmp_path / "extensions"
    stale_default = _stale(root / "py311_cpu" / "deepspeed_shm_comm" / "lock")  # the per-user cache's layout
    stale_chosen = _stale(root / "cpu_adam" / "lock")  # TORCH_EXTENSIONS_DIR's layout
    held = root / "py311_cpu" / "fused_op" / "lock"
    held.parent.mkdir(parents=True)
    other = _stale(root / "py311_cpu" / "fused_op" / "build.ninja")
    holder = _holding(HOLD, held)
    try:
        removed = clear_stale_build_locks([root], settle_s=0.05)
        assert sorted(removed) == sorted([stale_default, stale_chosen])
        assert not stale_default.exists() and not stale_chosen.exists()
        assert held.exists() and other.exists()  # a building process's lock, and what is not a lock, stay
    finally:
        holder.kill()
        holder.wait()


def test_the_filesystem_of_a_path_is_its_longest_mount_point():
    mounts = ("/dev/vda / ext4 rw 0 0\nsrv:/home /home nfs4 rw 0 0\n"
              "srv:/scratch\\040a /home/x\\040y lustre rw 0 0\n")
    assert leftovers.filesystem_type(Path("/home/u/.cache/torch_extensions"), mounts) == "nfs4"
    assert leftovers.filesystem_type(Path("/home/x y/ops/lock"), mounts) == "lustre"  # a mount point with a space
    assert leftovers.filesystem_type(Path("/homer/lock"), mounts) == "ext4"  # /home is no folder above /homer
    assert leftovers.filesystem_type(Path("/home"), mounts) == "nfs4"


def test_on_a_shared_filesystem_only_a_lock_older_than_any_build_is_removed(tmp_path, monkeypatch, capsys):
    # another machine's build holds its lock where /proc here cannot see: a young lock is said, with its command
    monkeypatch.setattr(leftovers, "filesystem_type", lambda path, mounts=None: "nfs4")
    young = _stale(tmp_path / "py311_cpu" / "cpu_adam" / "lock")
    old = _stale(tmp_path / "py311_cpu" / "deepspeed_shm_comm" / "lock")
    an_hour_ago = time.time() - 3600
    os.utime(old, (an_hour_ago, an_hour_ago))
    assert clear_stale_build_locks([tmp_path], settle_s=0.05) == [old]
    assert young.exists() and not old.exists()
    said = capsys.readouterr().err
    assert f"{young}: a build lock no process on this machine holds, on a nfs4 filesystem" in said
    assert f"rm {young}" in said and f"removed {old}" in said


def test_a_lock_taken_again_between_the_two_looks_is_kept(tmp_path, monkeypatch):
    # a loader that releases closes the file an instant before it removes it: a lock seen unheld once is looked
    # at again; here a process takes it (holds it open) in between, as a sibling rank's load would
    lock = _stale(tmp_path / "py311_cpu" / "deepspeed_shm_comm" / "lock")
    opened: list[int] = []
    monkeypatch.setattr(leftovers.time, "sleep", lambda s: opened.append(os.open(lock, os.O_RDONLY)))
    try:
        assert clear_stale_build_locks([tmp_path], settle_s=0.05) == []
        assert opened and lock.exists()
    finally:
        for fd in opened:
            os.close(fd)


def test_a_shared_memory_segment_no_process_uses_is_removed(tmp_path, capsys):
    mine = f"{SHM_PREFIX}_{os.getuid()}_127.0.0.1"
    stale = [tmp_path / f"{mine}_29500_0", tmp_path / f"{mine}_29500_1"]
    opened, mapped = tmp_path / f"{mine}_29501_0", tmp_path / f"{mine}_29501_1"
    theirs, other = tmp_path / f"{SHM_PREFIX}_{os.getuid() + 1}_127.0.0.1_29502_0", tmp_path / "psm_1234"
    for path in (*stale, opened, mapped, theirs, other):
        path.write_bytes(b"\0" * 8192)
    users = [_holding(HOLD.replace("os.O_CREAT | os.O_EXCL", "os.O_RDWR"), opened), _holding(MAP, mapped)]
    try:
        assert sorted(clear_stale_shm_segments(tmp_path, settle_s=0.05)) == stale
        assert [p.exists() for p in (*stale, opened, mapped, theirs, other)] == [False, False, True, True, True, True]
        assert "removed 2 DeepSpeed shared-memory segment(s)" in capsys.readouterr().err
    finally:
        for user in users:
            user.kill()
            user.wait()


def _segments() -> set[Path]:
    return set(SHM.glob(f"{SHM_PREFIX}_{os.getuid()}_*"))


def test_a_zero_run_starts_past_a_stale_lock_on_its_op(tmp_path, tiny_llama_dir):
    """The user's path: a ZeRO run with optimizer offload, whose CPU Adam op's lock a killed run left behind.
    Without the clearing it waits forever (here: until the timeout) before its first step. It leaves no
    shared-memory segment: DeepSpeed's shared-memory collectives are not started (toolkit.strategies.zero.comm)."""
    from torch.utils.cpp_extension import _get_build_directory  # where torch itself looks for that op's lock

    # the op as the suite built it, copied (mtimes kept: ninja finds it up to date) into a folder of this test's
    # own: a ZeRO run of another test, in the other pytest worker, clears every stale lock under the shared cache,
    # this one's too, and says so in its own output
    built = Path(_get_build_directory("cpu_adam", verbose=False))
    extensions = tmp_path / "extensions"
    shutil.copytree(built, extensions / "cpu_adam", ignore=shutil.ignore_patterns("lock"))
    env = {**toolkit_env(), "TORCH_EXTENSIONS_DIR": str(extensions)}
    lock = extensions / "cpu_adam" / "lock"
    recipe = write_recipe(tmp_path / "recipe.yaml", model_dir=tiny_llama_dir, output_dir=tmp_path / "run",
                          strategy={"name": "zero", "stage": 2, "offload_optimizer": True}, data={"eval": None},
                          train={"max_steps": 1, "eval_every": None, "consistency_check_every": None,
                                 "progress": False})
    assert not lock.exists(), f"{lock} is there before the test: a killed load left it (remove it)"
    _stale(lock)
    before = _segments()
    try:
        result = subprocess.run([sys.executable, "-m", "toolkit", "train", str(recipe)], cwd=REPO,
                                env=env, capture_output=True, text=True, timeout=240)
        output = result.stdout + result.stderr
        assert result.returncode == 0, output[-4000:]
        assert f"removed {lock}: a build lock no process holds" in output
        run = json.loads((tmp_path / "run" / "run.json").read_text())
        assert run["status"] == "completed"
        assert _segments() - before == set()
    finally:
        lock.unlink(missing_ok=True)
