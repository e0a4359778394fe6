"""What `toolkit launch` does when things go wrong around the training: its own process killed, a user's mistake
found inside the ranks with --max-restarts, a tracker that fails mid-run."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from conftest import REPO, toolkit_env, write_recipe


def _launcher(args: list[str], log: Path) -> subprocess.Popen:
    """`toolkit launch ARGS` with its output (and its ranks', which inherit it) in `log`: a file, not a pipe,
    that nobody has to drain once the launcher is gone."""
    with open(log, "w") as handle:
        return subprocess.Popen([sys.executable, "-m", "toolkit", "launch", *args], cwd=REPO, env=toolkit_env(),
                                stdout=handle, stderr=subprocess.STDOUT)


def _wait_for(log: Path, words: str, process: subprocess.Popen, *, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while words not in log.read_text():
        assert process.poll() is None, f"the launcher ended ({process.returncode}):\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {words!r} in {timeout_s} s:\n{log.read_text()[-3000:]}"
        time.sleep(0.2)


def _alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    """Those still running: a dead rank whose new parent does not reap it stays a zombie, which is gone too."""
    alive = []
    for process in processes:
        try:
            if process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process)
        except psutil.NoSuchProcess:
            pass
    return alive


def _wait_gone(processes: list[psutil.Process], *, timeout_s: float) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout_s
    while _alive(processes) and time.monotonic() < deadline:
        time.sleep(0.2)
    return _alive(processes)


# --- the launcher killed -----------------------------------------------------------------------------------------

def test_ranks_of_a_killed_launcher_checkpoint_and_end(tmp_path, tiny_llama_dir):
    # enough steps to still be training seconds after the first is logged; each step logged
    out = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=out, data={"eval": None},
                          batch={"micro_batch_size": 4}, strategy={"name": "ddp"},
                          train={"max_steps": 2000, "consistency_check_every": None, "progress": True,
                                 "log_every": 1})
    log = tmp_path / "launch.log"
    launcher = _launcher(["--nproc", "2", str(recipe)], log)
    ranks: list[psutil.Process] = []
    try:
        _wait_for(log, "step 2/2000", launcher, timeout_s=120)
        ranks = psutil.Process(launcher.pid).children()
        assert len(ranks) == 2, ranks
        launcher.kill()
        launcher.wait()
        left = _wait_gone(ranks, timeout_s=15)
    finally:
        launcher.kill()
        for process in _alive(ranks):  # a failed test leaves no rank training on
            process.kill()
    assert not left, f"ranks {[p.pid for p in left]} outlived their launcher:\n{log.read_text()[-3000:]}"
    # the death signal is SIGTERM: the ranks stopped together after a step and wrote a checkpoint first
    text = log.read_text()
    assert "toolkit: stopped by SIGTERM at step" in text, text[-3000:]
    assert list((out / "checkpoints").glob("step-*")), text[-3000:]


ORPHAN = textwrap.dedent("""
    # a 'launcher' that starts a 'rank' which cannot act on SIGTERM (a rank blocked in a collective)
    import os, subprocess, sys, time
    from toolkit.orphans import LAUNCHER_PID_ENV
    rank = '''
    import signal, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from toolkit.orphans import follow_launcher
    follow_launcher(grace_s=1.0)
    print("ready", flush=True)
    time.sleep(120)
    '''
    child = subprocess.Popen([sys.executable, "-c", rank], env={**os.environ, LAUNCHER_PID_ENV: str(os.getpid())},
                             start_new_session=True)
    print(child.pid, flush=True)
    time.sleep(120)
""")


def test_a_rank_that_cannot_stop_is_killed_after_the_grace(tmp_path):
    launcher = subprocess.Popen([sys.executable, "-c", ORPHAN], cwd=REPO, env=toolkit_env(), text=True,
                                stdout=subprocess.PIPE)
    assert launcher.stdout is not None
    rank = psutil.Process(int(launcher.stdout.readline()))
    try:
        assert launcher.stdout.readline().strip() == "ready"
        launcher.kill()
        launcher.wait()
        left = _wait_gone([rank], timeout_s=10)
    finally:
        if _alive([rank]):
            rank.kill()
    assert not left


# --- a user's mistake found inside the ranks, with --max-restarts -------------------------------------------------

def test_a_restart_after_a_users_mistake_ends_at_once_with_its_one_line(tmp_path, tiny_llama_dir):
    # 4 rows, a global batch of 8: found by the rank once it has read the data, not by launch's checks (one rank:
    # what is tested is the launcher's restarts, the same for any number)
    train = tmp_path / "four.jsonl"
    train.write_text("".join((REPO / "data" / "reviews-train.jsonl").read_text().splitlines(keepends=True)[:4]))
    out = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=out,
                          data={"train": str(train), "eval": None})
    env = {**toolkit_env(), "LOGLEVEL": "INFO"}  # torch's agent logs each restart (restart_count=N)
    start = time.monotonic()
    launcher = subprocess.Popen([sys.executable, "-m", "toolkit", "launch", "--nproc", "1", "--max-restarts", "2",
                                 str(recipe)], cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    assert launcher.stderr is not None
    line = "toolkit: error: data: 4 train samples are fewer than one global batch of 8"
    said_s, lines = None, []
    for text in launcher.stderr:
        lines.append(text)
        if said_s is None and text.startswith(line):
            said_s = time.monotonic() - start
    code, total_s = launcher.wait(), time.monotonic() - start
    output = "".join(lines)
    assert code == 2, output[-3000:]
    assert [text.startswith(line) for text in lines].count(True) == 1, output[-3000:]
    assert "restart_count=2" in output  # both restarts happened
    assert said_s is not None
    # the first attempt started the launcher and loaded torch, the model and the data before it found the
    # mistake; the two restarts, which load nothing, take a fraction of that (they took as long each)
    assert total_s - said_s < said_s / 2, (said_s, total_s)
    assert not out.exists()
