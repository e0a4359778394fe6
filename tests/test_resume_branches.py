"""--resume from a checkpoint that is not the run's newest, past the recipe's end, or from another run: the run
branches (its later checkpoints and metrics set aside, not lost), is refused in one line, or does nothing.
Each case works on a copy of one 3-step single-process run with a checkpoint after every step."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import FORKED_RANKS, REPO, forked_env, run_cli, write_recipe
from toolkit.process.faults import HOLD_CHECKPOINT_UNTIL
from toolkit.process.folder_lock import FolderLock

SETS = ("checkpoint.every_steps=1", "checkpoint.keep_last=5", "train.max_steps=3")


@pytest.fixture(scope="module")
def three_steps(tmp_path_factory, tiny_llama_dir):
    root = tmp_path_factory.mktemp("branches")
    recipe = write_recipe(root / "recipe.yaml", model_dir=tiny_llama_dir, output_dir=root / "unused")
    out = root / "run"
    done = run_cli("train", str(recipe), *_sets(*SETS, f"output_dir={out}"))
    assert done.returncode == 0, done.stderr[-3000:]
    return recipe, out


def _sets(*items: str) -> list[str]:
    return [a for item in items for a in ("--set", item)]


def _copy(run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    return copy


def _files(run) -> dict:
    """Every file of a run folder and its bytes: what a refused or empty resume must leave as it was."""
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def _steps(path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_resuming_an_earlier_checkpoint_branches_and_sets_the_later_steps_aside(three_steps, tmp_path):
    """Before: with keep_last 1 the checkpoint the resumed run wrote (step 2) was deleted, and the given-up
    run's step 3 stayed the newest, which a later --resume would continue."""
    recipe, run = three_steps
    out = _copy(run, tmp_path)
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[1])  # the uninterrupted run's step 2
    done = run_cli("train", str(recipe), *_sets("checkpoint.every_steps=1", "checkpoint.keep_last=1",
                                                "train.max_steps=2", f"output_dir={out}"),
                   "--resume", str(out / "checkpoints" / "step-00000001"))
    assert done.returncode == 0, done.stderr[-3000:]
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names[0].startswith("set-aside-after-step-00000001-")
    assert names[1:] == ["step-00000002"]  # the new step 2, kept; keep_last did not touch the set-aside ones
    aside = out / "checkpoints" / names[0]
    assert sorted(p.name for p in aside.iterdir()) == ["metrics.jsonl", "model", "step-00000002", "step-00000003"]
    assert _steps(aside / "metrics.jsonl") == [2, 3] and _steps(out / "metrics.jsonl") == [1, 2]
    assert "later checkpoints (step-00000002, step-00000003), its exported model/ and the metrics" in done.stderr
    assert f"set aside in {aside}" in done.stderr
    # the given-up run's step-3 export went with its steps; model/ is the branch's own step-2 export
    assert _files(aside / "model") == _files(run / "model")
    assert _files(out / "model") != _files(run / "model")
    # the branch continued the same data and weights: its step 2 is the uninterrupted run's
    again = json.loads((out / "metrics.jsonl").read_text().splitlines()[1])
    assert again["loss"] == pytest.approx(first["loss"], rel=1e-6)
    newest = run_cli("train", str(recipe), *_sets(*SETS, f"output_dir={out}"), "--resume")
    assert newest.returncode == 0 and "step-00000002 (step 2" in newest.stderr, newest.stderr[-3000:]


@pytest.mark.parametrize("command", ["train", "launch"])
def test_a_checkpoint_past_the_last_step_is_one_line(command, three_steps, tmp_path):
    """Before: 'continuing at step 4 of 2', exit 0, and the exported model replaced by the step-3 weights."""
    recipe, run = three_steps
    out = _copy(run, tmp_path)
    before = _files(out)
    done = run_cli(command, str(recipe), *_sets(*SETS[:2], "train.max_steps=2", f"output_dir={out}"),
                   "--resume", str(out / "checkpoints" / "step-00000003"))
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(err) == 1, done.stderr[-3000:]
    assert "is at step 3, past this run's last step 2" in err[0] and "train.max_steps above 3" in err[0]
    assert _files(out) == before


@pytest.mark.parametrize("command", ["train", "launch"])
def test_resuming_a_completed_run_leaves_it_as_it_is(command, three_steps, tmp_path):
    """Before: the run was 'resumed' at its last step: nothing trained, and run.json rewritten without its
    final loss, precision audit and model-state bytes."""
    recipe, run = three_steps
    out = _copy(run, tmp_path)
    before = _files(out)
    done = run_cli(command, str(recipe), *_sets(*SETS, f"output_dir={out}"), "--resume")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("nothing to resume") == 1 and "completed run (step 3 of 3)" in done.stderr
    assert _files(out) == before


def test_a_run_stopped_at_its_export_is_resumed_into_the_export(three_steps, tmp_path, capsys):
    """A Ctrl-C (or a full disk) at the export, after the last step's checkpoint: the interrupted line names that
    checkpoint and the command that continues (it said only 'outputs so far in ...'), and that --resume trains
    nothing and exports its weights (it said 'continuing at step 4 of 3')."""
    from toolkit.config.files import load_recipe
    from toolkit.launch.rank import interrupted

    recipe, run = three_steps
    out = _copy(run, tmp_path)
    shutil.rmtree(out / "model")  # what an export cut short leaves: its .model.partial, removed by the next one
    info = json.loads((out / "run.json").read_text())
    (out / "run.json").write_text(json.dumps({**info, "status": "stopped"}))
    previous = signal.getsignal(signal.SIGINT)
    try:
        assert interrupted(load_recipe(str(recipe), [f"output_dir={out}"])) == 130
    finally:
        signal.signal(signal.SIGINT, previous)
    said = capsys.readouterr().err.strip()
    assert said.startswith(f"toolkit: interrupted; outputs so far in {out}; the newest checkpoint is "
                           f"{out / 'checkpoints' / 'step-00000003'} (step 3); resume with: toolkit "), said
    assert said.endswith(" --resume"), said
    done = run_cli("train", str(recipe), *_sets(*SETS, f"output_dir={out}"), "--resume")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "(step 3, single on 1 rank(s)); every step of 3 trained: exporting its model" in done.stderr
    assert _files(out / "model") == _files(run / "model")  # the same weights the run exported
    assert _steps(out / "metrics.jsonl") == [1, 2, 3]


def test_a_metrics_line_cut_short_is_left_out_on_resume(three_steps, tmp_path):
    """A full disk (or a kill) can leave metrics.jsonl's last line cut short: the resume its stop line offers
    ended in a JSONDecodeError traceback. The cut line is left out, said in one line, and the run goes on."""
    recipe, run = three_steps
    out = _copy(run, tmp_path)
    with (out / "metrics.jsonl").open("a") as metrics_file:
        metrics_file.write('{"step": 4, "loss": 10.')
    done = run_cli("train", str(recipe), *_sets(*SETS[:2], "train.max_steps=4", f"output_dir={out}"), "--resume")
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert f"[toolkit] resume: 1 line(s) of {out / 'metrics.jsonl'} cut short (no JSON record of a step) left " \
        "out" in done.stderr
    assert _steps(out / "metrics.jsonl") == [1, 2, 3, 4]


def test_another_runs_checkpoint_into_a_folder_holding_a_run_is_one_line(three_steps, tmp_path):
    """Before: the two runs' metrics were mixed in one metrics.jsonl, without a word."""
    recipe, run = three_steps
    other = _copy(run, tmp_path)  # a run of its own in another folder: the checkpoint below is not one of its own
    before = _files(other)
    done = run_cli("train", str(recipe), *_sets(*SETS, f"output_dir={other}"),
                   "--resume", str(run / "checkpoints" / "step-00000001"))
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(err) == 1 and "holds another run" in err[0], done.stderr[-3000:]
    assert _files(other) == before
    # into a new folder it is the supported way to branch from another run
    fresh = tmp_path / "fresh"
    done = run_cli("train", str(recipe), *_sets(*SETS, f"output_dir={fresh}"),
                   "--resume", str(run / "checkpoints" / "step-00000001"))
    assert done.returncode == 0 and _steps(fresh / "metrics.jsonl") == [2, 3], done.stderr[-3000:]


def test_another_seed_on_resume_is_one_line(three_steps, tmp_path):
    """The sampler's order is a function of seed + step: another seed would go on with other samples."""
    recipe, run = three_steps
    out = _copy(run, tmp_path)
    done = run_cli("train", str(recipe), *_sets(*SETS[:2], "train.max_steps=4", "seed=7", f"output_dir={out}"),
                   "--resume")
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(err) == 1, done.stderr[-3000:]
    assert "was trained with seed 0, this recipe has seed 7" in err[0] and "set seed=0" in err[0]


def test_a_checkpoint_another_run_reads_is_kept_by_its_runs_keep_last_until_read(three_steps, tmp_path):
    """A run resumed from a checkpoint of a run that is still going (`--resume OTHER/checkpoints/step-N` into its
    own folder) reads it for the whole of its start (digests, weights, optimizer state, generators). Before, the
    other run's keep_last deleted it whenever that run saved past it, mid-read. Now the reader holds the folder
    (a shared flock), and keep_last leaves it, in one line, for a later save to remove once it is let go."""
    recipe, run = three_steps
    source, fork, gate = _copy(run, tmp_path), tmp_path / "fork", tmp_path / "gate"
    reader = _held_reader(recipe, source / "checkpoints" / "step-00000001", out=fork, gate=gate)
    try:
        # the source run goes on with keep_last 1: its saves at steps 4 and 5 would delete steps 1-4
        more = run_cli("train", str(recipe), *_sets("checkpoint.every_steps=1", "checkpoint.keep_last=1",
                                                    "train.max_steps=5", f"output_dir={source}"), "--resume")
        assert more.returncode == 0, more.stderr[-3000:]
        assert _checkpoints(source) == ["step-00000001", "step-00000005"]
        # (the pid is the forked process that runs the reader's command: not reader.pid, the tests' client)
        kept = f"checkpoint {source / 'checkpoints' / 'step-00000001'} kept past checkpoint.keep_last for now: " \
               "another process is reading it (pid "
        assert more.stderr.count(kept) == 1, more.stderr[-3000:]  # said once, at the save of step 4 (and kept at 5)
    finally:
        gate.touch()
        out, err = reader.communicate(timeout=300)
    assert reader.returncode == 0, err[-3000:]
    assert _steps(fork / "metrics.jsonl") == [2, 3]  # the fork trained on from the checkpoint it held
    assert json.loads((fork / "run.json").read_text())["resumed_from"]["step"] == 1
    # let go: the source run's next save removes it
    again = run_cli("train", str(recipe), *_sets("checkpoint.every_steps=1", "checkpoint.keep_last=1",
                                                 "train.max_steps=6", f"output_dir={source}"), "--resume")
    assert again.returncode == 0, again.stderr[-3000:]
    assert _checkpoints(source) == ["step-00000006"] and "kept past" not in again.stderr


def test_a_branch_waits_for_a_reader_of_a_checkpoint_it_sets_aside(three_steps, tmp_path):
    """Resumed from step 1, a run sets its steps 2 and 3 aside (renames them): one that another process is reading
    would lose its files' paths mid-read. The branch waits, in one line naming the reader, and sets it aside once
    it is let go."""
    recipe, run = three_steps
    source, fork, gate = _copy(run, tmp_path), tmp_path / "fork", tmp_path / "gate"
    reader = _held_reader(recipe, source / "checkpoints" / "step-00000003", out=fork, gate=gate,
                          sets=("train.max_steps=4",))
    try:
        with open(tmp_path / "branch.err", "w") as err_file:
            branch = subprocess.Popen([sys.executable, str(FORKED_RANKS), "train", str(recipe),
                                       *_sets(*SETS, f"output_dir={source}"), "--resume",
                                       str(source / "checkpoints" / "step-00000001")], cwd=REPO, env=forked_env(),
                                      stdout=subprocess.DEVNULL, stderr=err_file, text=True)
        waiting = f"to finish reading checkpoint {source / 'checkpoints' / 'step-00000003'}: this run sets it aside"
        deadline = time.monotonic() + 300
        while waiting not in (tmp_path / "branch.err").read_text():
            assert branch.poll() is None and time.monotonic() < deadline, (tmp_path / "branch.err").read_text()
            time.sleep(0.2)
        assert _checkpoints(source) == ["step-00000001", "step-00000002", "step-00000003"]  # nothing moved yet
    finally:
        gate.touch()
        reader.communicate(timeout=300)
    assert branch.wait(timeout=300) == 0, (tmp_path / "branch.err").read_text()[-3000:]
    assert reader.returncode == 0
    aside = next((source / "checkpoints").glob("set-aside-after-step-00000001-*"))
    assert sorted(p.name for p in aside.iterdir()) == ["metrics.jsonl", "model", "step-00000002", "step-00000003"]
    assert _checkpoints(source) == ["step-00000001", "step-00000002", "step-00000003"]  # the branch's own 2 and 3


def _held_reader(recipe, checkpoint, *, out, gate, sets=()) -> subprocess.Popen:
    """`toolkit train --resume CHECKPOINT` into `out`, started and waited for until it has read the checkpoint and
    holds it, as it does until `gate` exists (faults.HOLD_CHECKPOINT_UNTIL)."""
    reader = subprocess.Popen([sys.executable, str(FORKED_RANKS), "train", str(recipe),
                               *_sets(*SETS, *sets, f"output_dir={out}"), "--resume", str(checkpoint)], cwd=REPO,
                              env={**forked_env(), HOLD_CHECKPOINT_UNTIL: str(gate)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not Path(f"{gate}.held").exists():
        if reader.poll() is not None or time.monotonic() > deadline:
            reader.kill()
            pytest.fail(f"the reader did not hold {checkpoint}: {reader.communicate()[1][-3000:]}")
        time.sleep(0.2)
    return reader


def _checkpoints(run) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step-"))


def test_an_output_dir_in_another_runs_folder_is_one_line_and_touches_nothing(three_steps, tmp_path):
    """Before, each of these trained (exit 0) into another run's folder: a checkpoint's files changed (its digests
    then refused it), or that run's next save, branch or export deleted or replaced what was written. A compare's
    experiment folder and a converted model's folder there are refused the same way. Any other folder under a run's
    is the user's own, unless that run is still going. A refused run leaves no folder it made above output_dir, and
    an output_dir that is a link to nowhere is one line, not a failed first write."""
    recipe, run = three_steps
    source = _copy(run, tmp_path)
    before = _files(source)
    step, checkpoints = source / "checkpoints" / "step-00000001", source / "checkpoints"
    theirs = f"the run's in {source}: its keep_last, branches and export delete or replace what is there"
    cases = [(step, "is a checkpoint folder: writing into it would damage it"),
             (step / "hf" / "sub", f"is inside the checkpoint {step}: writing there would damage it"),
             (checkpoints, f"is {theirs}"), (source / "model", f"is {theirs}"),
             (checkpoints / "new", f"is inside {checkpoints}, which is {theirs}")]
    for out, said in cases:
        done = run_cli("train", str(recipe), *_sets(*SETS, f"output_dir={out}"))
        assert done.returncode == 2 and done.stderr.strip().splitlines() == [
            f"toolkit: error: output_dir {out} {said}; write this run elsewhere with --set output_dir=OTHER"], \
            done.stderr[-3000:]
    lock = FolderLock(source)  # as a run still going there holds it (this process: another open file description)
    assert lock.acquire() and lock.fd is not None
    try:
        live = run_cli("train", str(recipe), *_sets(*SETS, f"output_dir={source / 'sub'}"))
    finally:
        lock.release()
    assert live.returncode == 2 and live.stderr.startswith(
        f"toolkit: error: output_dir {source / 'sub'} is inside the folder of the run in {source}, which is still "
        f"going (pid {os.getpid()}"), live.stderr[-3000:]
    converted = run_cli("convert", str(step), str(checkpoints / "hf-model"))
    assert converted.returncode == 2 and converted.stderr.startswith(
        f"toolkit: error: model folder {checkpoints / 'hf-model'} is inside {checkpoints}"), converted.stderr[-3000:]
    compared = run_cli("compare", str(recipe), "--strategies", "single", "--steps", "1", "--output",
                       str(source / "model" / "exp"))
    assert compared.returncode == 2 and compared.stderr.startswith(
        f"toolkit: error: experiment folder {source / 'model' / 'exp'} is inside {source / 'model'}"), \
        compared.stderr[-3000:]
    assert _files(source) == before
    # a refused run removes the folders it made above output_dir (here: refused for --resume with nothing to resume)
    refused = run_cli("train", str(recipe), *_sets(*SETS, f"output_dir={tmp_path / 'new' / 'x' / 'y'}"), "--resume")
    assert refused.returncode == 2 and not (tmp_path / "new").exists(), refused.stderr[-3000:]
    (tmp_path / "link").symlink_to(tmp_path / "nowhere" / "deep")
    dangling = run_cli("train", str(recipe), *_sets(*SETS, f"output_dir={tmp_path / 'link'}"))
    assert dangling.returncode == 2 and dangling.stderr.strip().splitlines() == [
        f"toolkit: error: output_dir {tmp_path / 'link'} is a link to {tmp_path / 'nowhere' / 'deep'}, which does "
        "not exist; make that folder, or choose another output_dir"], dangling.stderr[-3000:]
    # a folder of the user's own under a finished run's: trained as any
    own = run_cli("train", str(recipe), *_sets(*SETS, "train.max_steps=1", f"output_dir={source / 'sub'}"))
    assert own.returncode == 0, own.stderr[-3000:]
