"""What a new user meets around the training itself: what a run says while it runs, and how it ends."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from conftest import REPO, metrics, toolkit_env, write_recipe
from toolkit.cli import main


def test_dp_without_two_gpus_says_what_it_ran_as_and_progress_shows_eval_loss(tmp_path, tiny_llama_dir, capsys):
    out = tmp_path / "out"
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=out, strategy={"name": "dp"},
                          train={"max_steps": 3, "eval_every": 2, "log_every": 10, "progress": True})
    assert main(["train", str(recipe)]) == 0
    err = capsys.readouterr().err.splitlines()
    warnings = [line for line in err if "warning" in line]
    run = json.loads((out / "run.json").read_text())
    import torch

    gpus = torch.cuda.device_count()
    if gpus < 2:
        where = "one GPU" if gpus == 1 else "the CPU (no CUDA device)"
        reason = (f"strategy dp needs 2+ CUDA devices; this machine has {gpus}, so it runs as one process on {where}, "
                  "like strategy single")
        assert warnings == [f"[toolkit] warning: {reason}"]
        # run.json says what ran, for a report: nothing was summed onto a GPU 0
        assert run["fallback"] == reason
        assert run["precision_audit"]["grad_reduction"] == \
            "none: one process; dp without 2+ CUDA devices runs as single"
    else:  # DataParallel really splits the batch: nothing to warn about
        assert warnings == []
        assert "fallback" not in run and run["precision_audit"]["grad_reduction"] == "sum onto GPU 0 (fp32)"
    evaluated = {m["step"]: m["eval_loss"] for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
                 if "eval_loss" in m}
    assert sorted(evaluated) == [2, 3]
    # the progress lines: the steps evaluated (2, and the last) show their eval loss; log_every 10 adds none
    lines = [line for line in err if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["2/3", "3/3"]
    for line, step in zip(lines, (2, 3)):
        assert f" eval_loss {evaluated[step]:.4f} " in line
    # the last evaluation, the exported model's, is in run.json and the line the run ends with
    assert run["final_eval"]["eval_loss"] == evaluated[3]
    [done] = [line for line in err if line.startswith("[toolkit] done: ")]
    assert done.startswith(f"[toolkit] done: final eval_loss {evaluated[3]:.4f}, eval_perplexity "), done


def ctrl_c(args: list[str], *, started, timeout: float = 240, signum: int = signal.SIGINT,
           meanwhile=None) -> tuple[subprocess.CompletedProcess, list[int]]:
    """Run `toolkit ARGS` in a session of its own, wait until `started()` holds, then press Ctrl-C as a terminal
    does: SIGINT to the whole process group (another `signum`: to the toolkit's process alone, as `kill` or a
    job scheduler sends it). Returns the result and the processes below it at that moment. `meanwhile(process)`:
    checks made while it runs, before the signal."""
    # SIGINT as a terminal's foreground job has it: a shell without job control starts a background job (a CI
    # script run with `&`) with SIGINT ignored, and Python then never raises KeyboardInterrupt
    proc = subprocess.Popen([sys.executable, "-m", "toolkit", *args], cwd=REPO, env=toolkit_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + timeout
    while not started():
        assert proc.poll() is None, f"ended before Ctrl-C: {proc.communicate()}"
        assert time.monotonic() < deadline, "never started"
        time.sleep(0.2)
    if meanwhile is not None:
        try:
            meanwhile(proc)
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    below = [child.pid for child in psutil.Process(proc.pid).children(recursive=True)]
    if signum == signal.SIGINT:
        os.killpg(proc.pid, signum)
    else:
        proc.send_signal(signum)
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), below


def assert_none_left(pids: list[int]) -> None:
    time.sleep(0.5)
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"left running: {alive}"


def stepped(run_dir: Path) -> bool:
    path = run_dir / "metrics.jsonl"
    return path.is_file() and bool(path.read_text().strip())


def test_ctrl_c_stops_every_rank_after_its_step_with_one_line(tmp_path, tiny_llama_dir):
    out = tmp_path / "out"
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=out, strategy={"name": "ddp"},
                          data={"eval": None}, batch={"micro_batch_size": 4},
                          train={"max_steps": 2000, "consistency_check_every": None})
    result, ranks = ctrl_c(["launch", "--nproc", "2", str(recipe)], started=lambda: stepped(out))
    assert len(ranks) == 2  # the two ranks (torch's agent runs inside the launcher)
    assert result.returncode == 130 and "Traceback" not in result.stderr, result.stderr[-3000:]
    said = [line for line in result.stderr.splitlines() if line.startswith("toolkit:")]
    assert len(said) == 1 and said[0].startswith("toolkit: interrupted at step ") and \
        f"of 2000; outputs so far in {out}; checkpoint {out}/checkpoints/step-" in said[0], result.stderr
    assert all(line.startswith(("[toolkit]", "toolkit:")) for line in result.stderr.splitlines()), result.stderr
    step = int(said[0].split()[4])
    assert [m["step"] for m in metrics(out)] == list(range(1, step + 1))
    assert (out / "checkpoints" / f"step-{step:08d}" / "manifest.json").is_file()
    assert_none_left(ranks)


def test_ctrl_c_during_compare_keeps_the_finished_arms_and_says_how_to_go_on(tmp_path, tiny_llama_dir):
    exp = tmp_path / "exp"
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=tmp_path / "unused",
                          data={"eval": None}, batch={"micro_batch_size": 4},
                          train={"consistency_check_every": None})
    result, below = ctrl_c(["compare", str(recipe), "--strategies", "single,ddp@train.max_steps=2000", "--steps", "2",
                            "--nproc", "2", "--output", str(exp)],
                           started=lambda: stepped(exp / "ddp@train.max_steps=2000"))
    assert result.returncode == 130 and "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert lines == [f"toolkit: compare interrupted during arm ddp@train.max_steps=2000; arms completed and kept in {exp}: single; "
                     f"run the rest with: toolkit compare {recipe} --strategies single,ddp@train.max_steps=2000 "
                     f"--steps 2 --nproc 2 --output {exp}"]
    assert json.loads((exp / "single" / "run.json").read_text())["status"] == "completed"
    assert not (exp / "ddp@train.max_steps=2000" / "failed.json").exists()  # interrupted, not failed: a re-run runs it afresh
    assert_none_left(below)


def test_sigterm_to_compare_stops_the_arm_it_runs_and_says_how_to_go_on(tmp_path, tiny_llama_dir):
    """compare runs an arm's launch in its own process: torch's agent turns the SIGTERM into a stop of the arm's
    ranks (they checkpoint and stop after their step), and compare ends as after Ctrl-C."""
    exp = tmp_path / "exp"
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=tmp_path / "unused",
                          data={"eval": None}, batch={"micro_batch_size": 4},
                          train={"consistency_check_every": None})
    arm = "ddp@train.max_steps=20000"
    result, below = ctrl_c(["compare", str(recipe), "--strategies", arm, "--steps", "2", "--nproc", "2", "--output",
                            str(exp)], started=lambda: stepped(exp / arm), signum=signal.SIGTERM,
                           meanwhile=lambda compare: _second_runs_refused(compare, recipe, exp, arm))
    assert result.returncode == 130 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines() == [
        f"toolkit: compare interrupted during arm {arm}; arms completed and kept in {exp}: none; run the rest with: "
        f"toolkit compare {recipe} --strategies {arm} --steps 2 --nproc 2 --output {exp}"]
    log = (exp / arm / "launch.log").read_text()
    assert "toolkit: stopped by SIGTERM" in log, log[-2000:]  # the ranks' own line: they stopped after a step
    assert not (exp / arm / "failed.json").exists()
    # nothing of a second run reached the arm's folder: its steps are the arm's own, once each, up to its stop
    stopped = json.loads((exp / arm / "run.json").read_text())
    assert stopped["status"] == "stopped", stopped
    assert [m["step"] for m in metrics(exp / arm)] == list(range(1, stopped["ended"]["steps_done"] + 1))
    assert_none_left(below)


def _second_runs_refused(compare: subprocess.Popen, recipe: Path, exp: Path, arm: str) -> None:
    """While a compare runs an arm: a second compare into its folder, and a run resumed into the arm's folder
    (torchrun's ranks, toolkit launch's check before its ranks start), are each refused in one line that names the
    process holding the folder, and none of them touches it."""
    from conftest import run_cli, run_torchrun

    ranks = {child.pid: child for child in psutil.Process(compare.pid).children(recursive=True)}
    entries = sorted(p.name for p in (exp / arm).iterdir())
    again = run_cli("compare", str(recipe), "--strategies", "single", "--steps", "2", "--output", str(exp))
    assert again.returncode == 2, again.stderr[-3000:]
    assert again.stderr.strip().splitlines() == [again.stderr.strip()]
    assert again.stderr.startswith(f"toolkit: error: experiment folder {exp} is in use by a compare still running "
                                   f"(pid {compare.pid}: toolkit compare "), again.stderr
    assert again.stderr.strip().endswith("its completed arms are kept) and run this again; or pass another --output")
    assert not (exp / "single").exists()
    report = run_cli("report", str(exp))  # what a user may run meanwhile: the table so far, and that it is so far
    assert report.returncode == 0, report.stderr[-3000:]
    assert f"[report] a compare is still running in {exp} (pid {compare.pid}: toolkit compare " in report.stdout
    assert f"{arm} not run: not completed yet" in report.stdout  # the arm it is running
    assert not list(exp.glob("report.*")) and not (exp / "results.json").exists()  # the running compare's folder
    for result in (run_torchrun(2, "train", str(recipe), "--set", f"output_dir={exp / arm}", "--resume"),
                   run_cli("launch", "--nproc", "2", str(recipe), "--set", f"output_dir={exp / arm}", "--resume")):
        said = [line for line in result.stderr.splitlines() if line.startswith("toolkit:")]
        assert result.returncode != 0 and len(said) == 1, result.stderr[-3000:]
        prefix = f"toolkit: error: output_dir {exp / arm} is being written by a run that is still going (pid "
        assert said[0].startswith(prefix), said
        holder = int(said[0][len(prefix):].split(":")[0])
        assert holder in ranks and "train" in ranks[holder].cmdline(), said  # the arm's rank 0
        assert said[0].endswith("continue it with --resume; or write this one elsewhere with --set output_dir=OTHER")
    assert entries == sorted(p.name for p in (exp / arm).iterdir() if p.name in entries)  # nothing removed


def test_a_mistake_only_the_ranks_can_see_is_one_line_from_the_launcher(tmp_path, tiny_llama_dir):
    # 3 samples, a global batch of 8: found once the data is tokenized, in the ranks, not before they start
    data = tmp_path / "train.jsonl"
    data.write_text("".join(f'{{"text": "review number {i}"}}\n' for i in range(3)))
    out = tmp_path / "out"
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=out, strategy={"name": "ddp"},
                          data={"train": str(data), "eval": None}, batch={"micro_batch_size": 4})
    result = subprocess.run([sys.executable, "-m", "toolkit", "launch", "--nproc", "2", str(recipe)], cwd=REPO,
                            env=toolkit_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        "toolkit: error: data: 3 train samples are fewer than one global batch of 8; lower batch sizes or add data"]
    assert not out.exists()
