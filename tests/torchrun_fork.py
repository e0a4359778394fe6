"""`python -m torch.distributed.run ARGS`, each launch a process forked from one that imported torch's launcher
once (multiprocessing's forkserver, torch.distributed.run preloaded): ~1.5 s of imports less per multi-rank test
run. The fork runs torchrun's own `__main__` as the interpreter would, in the folder and environment given; the
ranks it starts are new interpreters as under a plain torchrun."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import tempfile
from pathlib import Path

_SERVER = multiprocessing.get_context("forkserver")
# the server imports nothing of the toolkit's, transformers' or the tests': only torch's launcher, which a
# plain torchrun imports too
_SERVER.set_forkserver_preload(["torch.distributed.run"])


def run_torchrun(args: list[str], *, cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """As subprocess.run([python, "-m", "torch.distributed.run", *args], cwd=cwd, env=env, capture_output=True,
    text=True, timeout=timeout)."""
    with tempfile.TemporaryDirectory(prefix="torchrun-") as tmp:
        # torch's agent logs in this launch's own folder, removed with it (its default: a torchelastic_* folder
        # in the temporary folder, left there after every launch)
        args = ["--log-dir", str(Path(tmp) / "agent"), *args] if "--log-dir" not in args else args
        command = [sys.executable, "-m", "torch.distributed.run", *args]
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        process = _SERVER.Process(target=_torchrun_main, args=(args, str(cwd), env, str(out), str(err)))
        process.start()
        process.join(timeout)
        if process.exitcode is None:  # as subprocess.run: the launcher is killed, its ranks are left to their fate
            process.kill()
            process.join()
            raise subprocess.TimeoutExpired(command, timeout, _read(out), _read(err))
        return subprocess.CompletedProcess(command, process.exitcode, _read(out), _read(err))


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.is_file() else ""


def _torchrun_main(args: list[str], cwd: str, env: dict[str, str], out: str, err: str) -> None:
    """In the fork: the interpreter's `-m torch.distributed.run ARGS`, its output to `out` and `err`."""
    import runpy
    import traceback

    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(handle, fd)
        os.close(handle)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False)
    sys.argv = [sys.executable, *args]
    code = 0
    try:
        runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
    except BaseException:  # what the interpreter does with an exception nothing caught
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
