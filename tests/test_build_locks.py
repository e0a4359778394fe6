"""A build lock left by a process killed while it loaded a JIT-built op no longer hangs the next DeepSpeed run.

torch takes a lock file for every load of a JIT extension (torch.utils.file_baton.FileBaton) and any other process
waits for it to go, with no time limit. A test run killed during a ZeRO rank's start once left one in the
extensions cache, and the next `make test` on that machine waited in its op preparation until CI's time limit."""

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO, toolkit_env, write_recipe
from toolkit.process import build_locks
from toolkit.process.build_locks import clear_stale_build_locks

HOLD = "import sys, os, time; fd = os.open(sys.argv[1], os.O_CREAT | os.O_EXCL); print('held', flush=True); " \
       "time.sleep(60)"


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
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(held)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        removed = clear_stale_build_locks([root], settle_s=0.05)
        assert sorted(removed) == sorted([stale_default, stale_chosen])
        assert not stale_default.exists() and not stale_chosen.exists()
        assert held.exists() and other.exists()  # a building process's lock, and what is not a lock, stay
    finally:
        holder.kill()
        holder.wait()


def test_a_lock_taken_again_between_the_two_looks_is_kept(tmp_path, monkeypatch):
    # a loader that releases closes the file an instant before it removes it: a lock seen unheld once is looked
    # at again; here a process takes it (holds it open) in between, as a sibling rank's load would
    lock = _stale(tmp_path / "py311_cpu" / "deepspeed_shm_comm" / "lock")
    opened: list[int] = []
    monkeypatch.setattr(build_locks.time, "sleep", lambda s: opened.append(os.open(lock, os.O_RDONLY)))
    try:
        assert clear_stale_build_locks([tmp_path], settle_s=0.05) == []
        assert opened and lock.exists()
    finally:
        for fd in opened:
            os.close(fd)


def test_a_zero_run_starts_past_a_stale_lock_on_its_op(tmp_path, tiny_llama_dir):
    """The user's path: a ZeRO run whose shared-memory op's lock a killed run left behind. Without the clearing
    it waits forever (here: until the timeout) before its first step."""
    from torch.utils.cpp_extension import _get_build_directory  # where torch itself looks for that op's lock

    lock = Path(_get_build_directory("deepspeed_shm_comm", verbose=False)) / "lock"
    recipe = write_recipe(tmp_path / "recipe.yaml", model_dir=tiny_llama_dir, output_dir=tmp_path / "run",
                          strategy={"name": "zero", "stage": 2}, data={"eval": None},
                          train={"max_steps": 1, "eval_every": None, "consistency_check_every": None,
                                 "progress": False})
    assert not lock.exists(), f"{lock} is there before the test: a killed load left it (remove it)"
    _stale(lock)
    try:
        result = subprocess.run([sys.executable, "-m", "toolkit", "train", str(recipe)], cwd=REPO,
                                env=toolkit_env(), capture_output=True, text=True, timeout=240)
        output = result.stdout + result.stderr
        assert result.returncode == 0, output[-4000:]
        assert f"removed {lock}: a build lock no process holds" in output
        assert json.loads((tmp_path / "run" / "run.json").read_text())["status"] == "completed"
    finally:
        lock.unlink(missing_ok=True)
