"""`toolkit compare`, `report` and `plan`: each user mistake is exit code 2, one line naming the problem and
the fix, and nothing written. Only the resume tests train: one 1-step, single-process compare they share."""

import json
import os
import shutil

import pytest
import yaml

from conftest import write_recipe
from toolkit.cli import main
from toolkit.process.folder_lock import FolderLock


def _assert_one_line_exit_2(code, capsys, words, out=None):
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("toolkit: error:") and all(w in err[0] for w in words), err
    assert out is None or not out.exists()


@pytest.fixture
def recipe(tmp_path, tiny_llama_dir):
    return write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=tmp_path / "unused")


# a compare file as it may come: (its bytes, words of the one line; the file's path is added)
BAD_COMPARE_FILES = {
    "unparsable": (b"recipe: [\n", (":2:1: not valid YAML",)),
    "a number": (b"42\n", ("must be a mapping of recipe sections", "or matrix keys")),
    "not UTF-8": (b"recipe: \xff\xfe\n", ("not UTF-8 text", "save it as UTF-8")),
}


@pytest.mark.parametrize("case", list(BAD_COMPARE_FILES))
def test_a_compare_file_that_cannot_be_read_is_one_line(case, tmp_path, capsys):
    text, words = BAD_COMPARE_FILES[case]
    path = tmp_path / "c.yaml"
    path.write_bytes(text)
    out = tmp_path / "exp"
    _assert_one_line_exit_2(main(["compare", str(path), "--output", str(out)]), capsys,
                            (f"compare file {path}", *words), out)


@pytest.mark.parametrize("arms", [",", "", "ddp,,fsdp"])
@pytest.mark.parametrize("command", ["compare", "plan"])
def test_an_empty_arm_name_is_refused(arms, command, recipe, tmp_path, capsys):
    out = tmp_path / "exp"
    extra = ["--output", str(out)] if command == "compare" else []
    _assert_one_line_exit_2(main([command, str(recipe), "--strategies", arms, *extra]), capsys,
                            (f"--strategies {arms!r}: an arm name is empty", "single,ddp,fsdp"), out)


@pytest.mark.parametrize("command", ["compare", "plan"])
def test_an_arm_override_without_a_value_names_the_arm(command, recipe, tmp_path, capsys):
    """It was said to be a --set the user never gave."""
    out = tmp_path / "exp"
    extra = ["--output", str(out)] if command == "compare" else []
    _assert_one_line_exit_2(main([command, str(recipe), "--strategies", "single,fsdp@seed", *extra]), capsys,
                            ("arm 'fsdp@seed': 'seed' after @ is no override; write fsdp@key.path=value",), out)


@pytest.mark.parametrize("command, arms", [("compare", "single,single"), ("plan", "ddp,ddp")])
def test_a_repeated_arm_is_refused(command, arms, recipe, tmp_path, capsys):
    out = tmp_path / "exp"
    extra = ["--output", str(out)] if command == "compare" else []
    _assert_one_line_exit_2(main([command, str(recipe), "--strategies", arms, *extra]), capsys,
                            (f"arm {arms.split(',')[0]!r} is given twice", "list each arm once"), out)


# a matrix-file line with a slip: words of the one line
BAD_MATRIX_LINES = {
    "nproc: two": ("nproc must be a whole number >= 1", "got 'two'"),
    "grad_accum_steps: [0]": ("grad_accum_steps must be a list of whole numbers >= 1", "got [0]"),
    "strategies: ddp,fsdp": ("strategies must be a list of arms, e.g. strategies: [ddp, fsdp]", "got 'ddp,fsdp'"),
    "strategies: [ddp, ddp]": ("strategies: arm 'ddp' is given twice",),
    "precisions: bf16": ("precisions must be a list, e.g. precisions: [fp32, bf16]", "got 'bf16'"),
    "set: train.max_steps=2": ("set must be a list of KEY=VALUE overrides", "got 'train.max_steps=2'"),
    "set: {train.max_steps: 1}": ("set must be a list of KEY=VALUE overrides", "got {'train.max_steps': 1}"),
}


@pytest.mark.parametrize("line", list(BAD_MATRIX_LINES))
def test_a_matrix_key_of_the_wrong_form_is_named(line, recipe, tmp_path, capsys):
    matrix = tmp_path / "m.yaml"
    fields = {"recipe": str(recipe), "strategies": ["single", "ddp"], **yaml.safe_load(line)}
    matrix.write_text(yaml.safe_dump(fields))
    out = tmp_path / "exp"
    _assert_one_line_exit_2(main(["compare", str(matrix), "--output", str(out)]), capsys,
                            BAD_MATRIX_LINES[line], out)


def test_a_matrix_file_with_strategies_on_the_command_line_is_refused(recipe, tmp_path, capsys):
    matrix = tmp_path / "m.yaml"
    matrix.write_text(yaml.safe_dump({"recipe": str(recipe), "strategies": ["single", "ddp"]}))
    out = tmp_path / "exp"
    _assert_one_line_exit_2(main(["compare", str(matrix), "--strategies", "fsdp", "--output", str(out)]), capsys,
                            ("is a matrix file: its `strategies:` lists the arms", "drop --strategies"), out)


@pytest.mark.parametrize("below", ["", "/sub"])
def test_an_output_path_on_a_file_is_refused_before_any_arm_runs(below, recipe, tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.write_text("not a folder\n")
    code = main(["compare", str(recipe), "--strategies", "single", "--steps", "1", "--output", f"{taken}{below}"])
    _assert_one_line_exit_2(code, capsys, (f"{taken}", "is a file, not a folder; pass another --output"))
    assert taken.read_text() == "not a folder\n"


def test_an_output_folder_that_holds_no_experiment_is_left_alone(recipe, tmp_path, capsys):
    # an arm runs afresh in OUTPUT/<arm>, replacing that folder: a user's folder of that name must survive
    mine = tmp_path / "work" / "single"
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("mine\n")
    code = main(["compare", str(recipe), "--strategies", "single", "--steps", "1", "--output", str(tmp_path / "work")])
    _assert_one_line_exit_2(code, capsys, ("holds files but no experiment.json", "pass a new or empty --output"))
    assert (mine / "notes.txt").read_text() == "mine\n"


@pytest.mark.parametrize("nproc", ["0", "-1"])
def test_compare_refuses_fewer_than_one_rank_up_front(nproc, recipe, tmp_path, capsys):
    out = tmp_path / "exp"
    _assert_one_line_exit_2(main(["compare", str(recipe), "--strategies", "ddp", "--nproc", nproc, "--output",
                                  str(out)]), capsys, (f"--nproc {nproc}: give the number of ranks", "1 or more"), out)


@pytest.mark.parametrize("text, words", [("{bad", "Expecting property name"), ('{"recipe": "x"}', "no 'arms' key"),
                                         ("[]", "not the layout it writes"),
                                         ('{"recipe": "x", "common": [], "arms": []}', "(no arm)")])
def test_report_of_a_damaged_experiment_file_is_one_line(text, words, tmp_path, capsys):
    (tmp_path / "experiment.json").write_text(text)
    _assert_one_line_exit_2(main(["report", str(tmp_path)]), capsys,
                            (f"{tmp_path / 'experiment.json'} is not a readable compare experiment", words))
    assert [p.name for p in tmp_path.iterdir()] == ["experiment.json"]


@pytest.mark.parametrize("size", ["40", "0", "0.0001KiB"])
def test_plan_wants_a_memory_size_with_its_unit(size, recipe, capsys):
    _assert_one_line_exit_2(main(["plan", str(recipe), "--memory-per-rank", size]), capsys,
                            (f"--memory-per-rank: {size!r}", "1 MiB or more with its unit", "40GiB"))


@pytest.fixture
def one_step(two_arm_compare):
    """The shared finished compare (its first arm, `single`, is the one these tests name): (its recipe, its
    folder, the arguments that made it)."""
    return two_arm_compare


def _files(folder):
    return {p: p.stat().st_mtime_ns for p in folder.rglob("*")}


def test_rerun_with_other_settings_refuses_the_folder(one_step, capsys):
    recipe, out, args = one_step
    before = _files(out)
    code = main([*args[:4], "--steps", "3", "--set", "optim.lr=0.5", "--output", str(out)])
    _assert_one_line_exit_2(code, capsys, (f"{out} holds arm single run with other settings",
                                           "optim.lr: 0.001 then, 0.5 now", "train.max_steps: 1 then, 3 now",
                                           "pass a new --output, or remove"))
    assert _files(out) == before  # experiment.json still describes the runs it holds


@pytest.mark.parametrize("inside", ["", "sub"])
def test_an_arm_folder_a_run_typed_by_hand_holds_is_not_replaced(one_step, tmp_path, capsys, inside):
    """A re-run replaces an arm that did not complete (its folder removed, the arm run afresh). Before, that
    removed the files of a run typed into the arm's folder (`toolkit train --set output_dir=EXP/ARM`, or EXP/ARM/sub)
    while it ran; now the compare stops in one line naming it, the folder as it was."""
    recipe, out, args = one_step
    copy = tmp_path / "exp"
    shutil.copytree(out, copy)
    arm = copy / "single@optim.lr=2e-3"
    (arm / "run.json").unlink()  # not completed: the re-run would replace it
    (arm / inside).mkdir(exist_ok=True)
    before = _files(arm)
    # as the hand-typed run's rank 0 holds it (this process: another open file description)
    lock = FolderLock(arm / inside)
    assert lock.acquire() and lock.fd is not None
    try:
        code = main([*args[:6], "--output", str(copy)])
    finally:
        lock.release()
    _assert_one_line_exit_2(code, capsys, (f"arm single@optim.lr=2e-3's folder {arm} is being written by a run that "
                                           f"is not this compare's (pid {os.getpid()}", "--output OTHER"))
    assert _files(arm) == before


def test_rerun_after_the_recipe_file_changed_refuses_the_folder(one_step, tmp_path, capsys):
    recipe, out, args = one_step
    changed = tmp_path / "r.yaml"
    changed.write_text(recipe.read_text().replace("lr: 0.001", "lr: 0.002"))
    copy = tmp_path / "exp"
    shutil.copytree(out, copy)
    code = main(["compare", str(changed), *args[2:6], "--output", str(copy)])
    _assert_one_line_exit_2(code, capsys, ("holds arm single run with other settings",
                                           "optim.lr: 0.001 then, 0.002 now"))


def test_rerun_with_the_same_settings_reuses_the_completed_arm(one_step, tmp_path, capsys):
    recipe, out, args = one_step
    copy = tmp_path / "exp"
    shutil.copytree(out, copy)
    assert main([*args[:-1], str(copy)]) == 0
    assert "single: already completed, skipped" in capsys.readouterr().out
    assert json.loads((copy / "results.json").read_text())["arms"][0]["arm"] == "single"


@pytest.mark.parametrize("text", ["{bad", "[]", ""])
def test_an_arm_whose_run_json_is_damaged_runs_again(text, tmp_path):
    from toolkit.compare.runner import arm_status

    (tmp_path / "model").mkdir()
    (tmp_path / "run.json").write_text(text)
    assert arm_status(tmp_path) == "pending"  # not a traceback, nor a completed arm without numbers
    (tmp_path / "run.json").write_text('{"status": "completed"}')
    step = {"loss": 1.0, "grad_norm": 1.0, "step_time_s": 1.0, "tokens_per_s": 1.0, "samples_per_s": 1.0}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(step) + "\n")
    (tmp_path / "recipe.yaml").write_text("seed: 1\n")  # the run's resolved recipe, which the report reads
    assert arm_status(tmp_path) == "completed"
