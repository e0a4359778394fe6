"""What `toolkit launch` does when things go wrong around the training: its own process killed, a user's mistake
found inside the ranks with --max-restarts, a tracker that fails mid-run."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from conftest import REPO, metrics, toolkit_env, write_recipe


def _launcher(args: list[str], log: Path, *, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`toolkit launch ARGS` with its output (and its ranks', which inherit it) in `log`: a file, not a pipe,
    that nobody has to drain once the launcher is gone."""
    with open(log, "w") as handle:
        return subprocess.Popen([sys.executable, "-m", "toolkit", "launch", *args], cwd=REPO,
                                env={**toolkit_env(), **(env or {})}, stdout=handle, stderr=subprocess.STDOUT)


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


# --- one 2-rank run: its TensorBoard disk full mid-run, then its launcher killed ---------------------------------

@dataclass
class KilledRun:
    out: Path
    log: str  # the launcher's output and its ranks'
    failed_step: int  # the step the tracker failed at
    left: list[psutil.Process]  # ranks still running once the launcher was killed and the wait is over


DISK_FULL = textwrap.dedent("""
    # rank 0's TensorBoard event file is on a disk that fills up once the test creates the flag file: the
    # writes of TensorBoard's own writer thread fail as on a full disk (ENOSPC), the rest of the run's are fine
    import errno, os
    if os.environ.get("RANK") == "0":
        from tensorboard.summary.writer import record_writer

        _write = record_writer.RecordWriter.write

        def write(self, data):
            if os.path.exists(os.environ["TEST_DISK_FULL"]):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return _write(self, data)

        record_writer.RecordWriter.write = write
""")


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory, tiny_llama_dir) -> KilledRun:
    # enough steps to still be training seconds after the first is logged; each step logged
    root = tmp_path_factory.mktemp("killed")
    out = root / "run"
    recipe = write_recipe(root / "r.yaml", model_dir=tiny_llama_dir, output_dir=out, data={"eval": None},
                          batch={"micro_batch_size": 4}, strategy={"name": "ddp"},
                          train={"max_steps": 2000, "consistency_check_every": None, "progress": True,
                                 "log_every": 1, "report_to": "tensorboard"})
    (root / "shim").mkdir()
    (root / "shim" / "sitecustomize.py").write_text(DISK_FULL)
    full = root / "disk-full"
    log = root / "launch.log"
    shim = {"PYTHONPATH": f"{root / 'shim'}:{toolkit_env()['PYTHONPATH']}", "TEST_DISK_FULL": str(full)}
    launcher = _launcher(["--nproc", "2", str(recipe)], log, env=shim)
    ranks: list[psutil.Process] = []
    try:
        _wait_for(log, "step 2/2000", launcher, timeout_s=120)
        full.touch()
        _wait_for(log, "[toolkit] warning: train.report_to tensorboard failed at step", launcher, timeout_s=30)
        failed_step = int(re.findall(r"tensorboard failed at step (\d+)", log.read_text())[0])
        _wait_for(log, f"step {failed_step + 2}/2000", launcher, timeout_s=30)  # training went on
        ranks = psutil.Process(launcher.pid).children()
        assert len(ranks) == 2, ranks
        launcher.kill()
        launcher.wait()
        left = _wait_gone(ranks, timeout_s=15)
    finally:
        launcher.kill()
        for process in _alive(ranks):  # a failed test leaves no rank training on
            process.kill()
    return KilledRun(out=out, log=log.read_text(), failed_step=failed_step, left=left)


def test_ranks_of_a_killed_launcher_checkpoint_and_end(killed_run):
    assert not killed_run.left, f"ranks {[p.pid for p in killed_run.left]} outlived their launcher:\n" \
        f"{killed_run.log[-3000:]}"
    # the death signal is SIGTERM: the ranks stopped together after a step and wrote a checkpoint first; the line
    # and run.json say where the signal came from
    assert re.search(r"toolkit: stopped by SIGTERM at step \d+ of 2000 \(the launcher died: the kernel's signal to "
                     r"its ranks\); checkpoint ", killed_run.log), killed_run.log[-3000:]
    assert list((killed_run.out / "checkpoints").glob("step-*")), killed_run.log[-3000:]
    ended = json.loads((killed_run.out / "run.json").read_text())["ended"]
    assert ended["reason"].endswith("(the launcher died: the kernel's signal to its ranks)"), ended


def test_a_tracker_failing_mid_run_is_one_warning_and_the_run_goes_on(killed_run):
    warnings = [line for line in killed_run.log.splitlines() if "train.report_to tensorboard failed" in line]
    assert len(warnings) == 1, killed_run.log[-3000:]
    assert "No space left on device" in warnings[0] and "it is off for the rest of the run" in warnings[0]
    assert f"{killed_run.out / 'metrics.jsonl'} has every step" in warnings[0]
    assert "Traceback" not in killed_run.log and "launch failed" not in killed_run.log
    steps = [record["step"] for record in metrics(killed_run.out)]
    assert steps == list(range(1, len(steps) + 1)) and steps[-1] >= killed_run.failed_step + 2


ORPHAN = textwrap.dedent("""
    # a 'launcher' that starts a 'rank' which cannot act on SIGTERM (a rank blocked in a collective)
    import os, subprocess, sys, time
    from toolkit.process.orphans import LAUNCHER_PID_ENV
    rank = '''
    import signal, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from toolkit.process.orphans import follow_launcher
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


TORCHRUN_RANK = textwrap.dedent("""
    # a rank of plain torchrun: a SIGTERM handler that says it was called, as the toolkit's stop does
    import os, signal, sys, time
    from toolkit.process.orphans import follow_launcher
    signal.signal(signal.SIGTERM, lambda *_: (print("SIGTERM", flush=True), sys.exit(143)))
    follow_launcher(grace_s=30.0)
    print("ready", os.getpid(), os.environ.get("TOOLKIT_FOLLOWS_LAUNCHER"), flush=True)
    time.sleep(120)
""")


def test_a_rank_of_plain_torchrun_gets_sigterm_when_torchrun_is_killed(tmp_path):
    """torchrun's agent starts its ranks in sessions of their own: before, `kill -9` of torchrun (or the OOM
    killer) left them running. The agent is the real one here; the rank is a script, so this takes seconds."""
    log = tmp_path / "log"
    with open(log, "w") as handle:
        agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
                                  "--no-python", sys.executable, "-c", TORCHRUN_RANK], cwd=REPO, env=toolkit_env(),
                                 stdout=handle, stderr=subprocess.STDOUT)
    rank = None
    try:
        _wait_for(log, "ready", agent, timeout_s=60)
        words = re.search(r"ready (\d+) (\S+)", log.read_text())
        assert words is not None and words[2] == "1", log.read_text()  # followed; what it starts will not
        rank = psutil.Process(int(words[1]))
        agent.kill()
        agent.wait()
        left = _wait_gone([rank], timeout_s=10)  # well inside the 30 s grace: the signal ended it, not the kill
    finally:
        if rank is not None and _alive([rank]):
            rank.kill()
    assert not left and "SIGTERM" in log.read_text(), log.read_text()


# --- how the ranks ended, as the launcher's exit code ----------------------------------------------------------------

def _ranks_exit(codes: dict[int, int], *, pid: int = 0):
    """torch.distributed.run's run() where the ranks ended with `codes` (negative: killed by that signal); rank r
    was process `pid` + r."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    def run(args):
        raise ChildFailedError("toolkit", {rank: ProcessFailure(local_rank=rank, pid=pid + rank, exitcode=code,
                                                                error_file="") for rank, code in codes.items()})
    return run


def test_a_failure_a_rank_said_in_one_line_gets_no_launch_failed_line_after_it(capsys, tmp_path, monkeypatch):
    """A checkpoint that cannot be written: every rank exits 1 and rank 0 says why in one line (the 2-rank run is
    test_checkpoints' test_a_checkpoint_that_cannot_be_written_...). Its mark is per process: a crash of another
    process (a restarted rank) still gets the launcher's line."""
    from toolkit.errors import SAID_DIR_ENV
    from toolkit.launch.launcher import Nodes, _run_ranks

    monkeypatch.setenv(SAID_DIR_ENV, str(tmp_path))
    (tmp_path / "toolkit-failure-said-1000").touch()  # what rank 0, process 1000, left (errors.mark_failure_said)
    assert _run_ranks(_ranks_exit({0: 1, 1: 1}, pid=1000), None, Nodes()) == 1
    assert capsys.readouterr().err == ""
    # rank 1 exited first (after rank 0's line: toolkit.launch.rank waits for it), and the launcher stopped rank 0
    assert _run_ranks(_ranks_exit({0: -15, 1: 1}, pid=1000), None, Nodes()) == 1
    assert capsys.readouterr().err == ""
    for codes, pid in (({0: 1, 1: 1}, 2000), ({0: -9, 1: 1}, 1000), ({0: 1, 1: 4}, 1000)):
        assert _run_ranks(_ranks_exit(codes, pid=pid), None, Nodes()) == 1
        assert "toolkit: launch failed: rank 0 " in capsys.readouterr().err, (codes, pid)


def test_ranks_stopped_on_a_non_finite_value_end_the_launch_with_exit_4_not_as_a_failure(capsys):
    """Before: every rank exited 4 after rank 0's line, and the launcher added 'launch failed' and exit 1."""
    from toolkit.launch.launcher import Nodes, _run_ranks

    for codes in ({0: 4, 1: 4}, {0: 4, 1: -15}):  # -15: stopped by the launcher once rank 0 had left
        assert _run_ranks(_ranks_exit(codes), None, Nodes()) == 4
        assert capsys.readouterr().err == ""  # rank 0 said it (toolkit.launch.rank), nothing to add
    assert _run_ranks(_ranks_exit({0: -15, 1: 4}), None, Nodes()) == 4  # rank 0 stopped before its line
    assert "non-finite" in capsys.readouterr().err
    assert _run_ranks(_ranks_exit({0: 4, 1: 1}), None, Nodes()) == 1  # a rank that failed otherwise: a failure
    assert "launch failed: rank 0 exit code 4; rank 1 exit code 1" in capsys.readouterr().err
    assert _run_ranks(_ranks_exit({0: 143, 1: 143}), None, Nodes()) == 143  # a stop signal: as before
    assert _run_ranks(_ranks_exit({0: 3, 1: 3}), None, Nodes()) == 3  # replica drift: every rank said which tensor
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("code", [2, 4])
def test_a_restart_after_a_stop_that_would_come_again_ends_at_once_with_its_code(code, tmp_path, monkeypatch):
    """A user's mistake, or a non-finite loss the restart would reach again from the same checkpoint: the
    restarted rank exits before loading anything (the 2-rank path is test_a_restart_after_a_users_mistake...)."""
    from toolkit.errors import SAID_DIR_ENV, end_restart_after_final_stop, mark_final

    monkeypatch.setenv(SAID_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    end_restart_after_final_stop()  # the first attempt, nothing marked: it goes on
    mark_final(code)
    end_restart_after_final_stop()  # the first attempt itself is never ended so
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    with pytest.raises(SystemExit) as ended:
        end_restart_after_final_stop()
    assert ended.value.code == code


# --- a user's mistake found inside the ranks, with --max-restarts -------------------------------------------------

def test_a_restart_after_a_users_mistake_ends_at_once_with_its_one_line(tmp_path, tiny_llama_dir):
    # 4 short rows, packed: fewer tokens than one global batch of blocks, which only the rank finds, once it has
    # tokenized them (launch's checks count rows, and packed blocks are known only after tokenizing; one rank:
    # what is tested is the launcher's restarts, the same for any number)
    train = tmp_path / "four.jsonl"
    train.write_text("".join((REPO / "data" / "reviews-train.jsonl").read_text().splitlines(keepends=True)[:4]))
    out = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=out,
                          data={"train": str(train), "eval": None, "packing": True})
    env = {**toolkit_env(), "LOGLEVEL": "INFO"}  # torch's agent logs each restart (restart_count=N)
    start = time.monotonic()
    launcher = subprocess.Popen([sys.executable, "-m", "toolkit", "launch", "--nproc", "1", "--max-restarts", "2",
                                 str(recipe)], cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    assert launcher.stderr is not None
    line = "toolkit: error: data: "  # N train samples (packed blocks) are fewer than one global batch of 8
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


# --- trackers that fail: what the log does with them ---------------------------------------------------------------

class _Tracker:
    """A tracker whose store fails at `fails_at` (a step, or "close")."""

    def __init__(self, name: str, fails_at):
        self.name, self.fails_at = name, fails_at
        self.steps: list[int] = []
        self.closed = self.dropped = False

    def write(self, step: int, values: dict[str, float]) -> None:
        if step == self.fails_at:
            raise ConnectionError(f"{self.name} store gone\nsecond line")
        self.steps.append(step)

    def close(self, status: str) -> None:
        if self.fails_at == "close":
            raise OSError("no space left")
        self.closed = True

    def drop(self) -> None:
        self.dropped = True


def test_each_failing_tracker_is_one_warning_and_the_others_and_metrics_jsonl_go_on(tmp_path, capsys):
    from toolkit.observe.metrics import JsonlWriter
    from toolkit.observe.tracking import MetricsLog

    mid_run, at_close, healthy = _Tracker("mlflow", 2), _Tracker("tensorboard", "close"), _Tracker("other", None)
    log = MetricsLog(JsonlWriter(tmp_path / "metrics.jsonl"), [mid_run, at_close, healthy])
    for step in (1, 2, 3):
        log.write({"step": step, "loss": 1.0 / step})
    log.close("FINISHED")
    assert metrics(tmp_path) == [{"step": s, "loss": 1.0 / s} for s in (1, 2, 3)]
    assert mid_run.steps == [1] and mid_run.dropped and not mid_run.closed  # asked nothing after it failed
    assert at_close.steps == [1, 2, 3] and healthy.steps == [1, 2, 3] and healthy.closed
    assert log.switched_off == [{"tracker": "mlflow", "step": 2, "error": "ConnectionError: mlflow store gone"}]
    where = f"{tmp_path / 'metrics.jsonl'} has every step"
    assert capsys.readouterr().err.splitlines() == [
        f"[toolkit] warning: train.report_to mlflow failed at step 2 (ConnectionError: mlflow store gone); it is off "
        f"for the rest of the run, and {where}",
        f"[toolkit] warning: train.report_to tensorboard failed when it was closed (OSError: no space left); it may "
        f"show the run as still running, and {where}"]
