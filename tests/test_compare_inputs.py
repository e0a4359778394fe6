"""`toolkit compare` and `report` inputs that were silently dropped, misread or ended in a traceback: a per-arm
override of what compare sets for every arm itself, --output beside an output_dir, a matrix file's relative recipe:,
an arm whose metrics.jsonl is damaged, arms given in another order. Only those about a finished experiment train:
one 2-arm, 1-step, single-process compare they share."""

import html
import json
import os
import resource
import shutil
import subprocess
import sys

import pytest
import yaml

from conftest import REPO, toolkit_env, write_recipe
from toolkit.cli import build_parser, main
from toolkit.compare.cli import experiment_of
from toolkit.compare.report_render import table_rows
from toolkit.config.files import load_recipe
from toolkit.config.recipe import plan_batch
from toolkit.strategies import validate_strategy


def _one_line_exit_2(code, capsys, words, out=None):
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert len(err) == 1 and err[0].startswith("toolkit: error:") and all(w in err[0] for w in words), err
    assert out is None or not out.exists()


@pytest.fixture
def recipe(tmp_path, tiny_llama_dir):
    return write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=tmp_path / "unused")


def _matrix(tmp_path, recipe, **fields):
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump({"recipe": str(recipe), **fields}))
    return path


@pytest.mark.parametrize("arms, key, words", [
    ("single@batch.global_batch_size=64,ddp", "batch.global_batch_size", "the same global batch"),
    ("single,single@batch.grad_accum_steps=4", "batch.grad_accum_steps", "NAME@batch.micro_batch_size=N"),
    ("single,ddp@output_dir=/tmp/elsewhere", "output_dir", "--output names the experiment folder"),
    ("single@train.tracking_dir=/tmp/elsewhere", "train.tracking_dir", "one run per arm"),
    # the reference's false was replaced by true: the verdict reads its gradient scale
    ("single@train.record_gradient_scale=false,ddp", "train.record_gradient_scale", "reference (first) arm only"),
    ("single,ddp@train.record_gradient_scale=true", "train.record_gradient_scale", "the verdict reads"),
])
def test_a_per_arm_override_compare_replaces_is_one_line(recipe, tmp_path, capsys, arms, key, words):
    """Both arms of `single@batch.global_batch_size=64,single@batch.grad_accum_steps=4` ran global batch 32."""
    out = tmp_path / "exp"
    _one_line_exit_2(main(["compare", str(recipe), "--strategies", arms, "--output", str(out)]), capsys,
                     ("arm '", f"compare sets {key} for every arm itself", words), out)


def test_a_per_arm_micro_batch_is_what_the_refusal_offers_and_is_kept(recipe, tmp_path, capsys):
    out = tmp_path / "exp"
    _one_line_exit_2(main(["compare", str(recipe), "--strategies", "single@batch.grad_accum_steps=4",
                           "--output", str(out)]), capsys, ("batch.grad_accum_steps",), out)
    args = build_parser().parse_args(["compare", str(recipe), "--strategies", "single@batch.micro_batch_size=2,ddp",
                                      "--output", str(out)])
    experiment = experiment_of(args)
    arm = load_recipe(experiment.recipe, [*experiment.common, *experiment.arms[0].overrides])
    plan = plan_batch(arm.batch, world_size=experiment.arms[0].nproc)
    assert (plan.global_batch_size, plan.micro_batch_size, plan.grad_accum_steps) == (16, 2, 8)  # one rank


@pytest.mark.parametrize("matrix, arm, key", [
    ({"precisions": ["fp32", "bf16"]}, "single@precision=bf16", "precision"),
    ({"grad_accum_steps": [1, 2]}, "single@batch.micro_batch_size=2", "batch.micro_batch_size"),
])
def test_a_per_arm_override_the_matrix_sets_is_one_line(recipe, tmp_path, capsys, matrix, arm, key):
    path = _matrix(tmp_path, recipe, strategies=[arm, "ddp"], **matrix)
    out = tmp_path / "exp"
    _one_line_exit_2(main(["compare", str(path), "--output", str(out)]), capsys,
                     (f"arm '{arm}'", f"compare sets {key} for every arm itself", "drop"), out)


@pytest.mark.parametrize("matrix, sets, key", [
    ({"precisions": ["fp32", "bf16"]}, ["--set", "precision=bf16"], "precision"),
    ({}, ["--set", "train.tracking_dir=/tmp/elsewhere"], "train.tracking_dir"),
    ({}, ["--set", "train.record_gradient_scale=false"], "train.record_gradient_scale"),
])
def test_a_setting_for_all_arms_that_compare_replaces_is_one_line(recipe, tmp_path, capsys, matrix, sets, key):
    path = _matrix(tmp_path, recipe, strategies=["single", "ddp"], **matrix)
    out = tmp_path / "exp"
    _one_line_exit_2(main(["compare", str(path), *sets, "--output", str(out)]), capsys,
                     (f"{key} is set for all arms", "compare sets it for every arm itself"), out)


@pytest.mark.parametrize("matrix, words", [
    # the schedule's check named no arm among the matrix's 6
    ({"strategies": ["single", "pp-1f1b", "tp"], "grad_accum_steps": [1, 2]},
     "arm pp-1f1b-accum1 (2 rank(s), 1 of them data-parallel): schedule 1f1b needs at least as many micro-batches"),
    # these named no arm: an arm's recipe that does not read, a layout its strategy cannot make at its ranks
    ({"strategies": ["single", "ddp@optim.lr=abc"]}, "arm ddp@optim.lr=abc: optim.lr: expected a number, got 'abc'"),
    ({"strategies": ["single", "ddp"], "precisions": ["fp32", "fp33"]},
     "arm single-fp33 (1 rank(s)): precision: unknown value 'fp33'"),
    ({"strategies": ["single", "pp-ddp"], "nproc": 3},
     "arm pp-ddp (3 rank(s)): world size 3 is not divisible by strategy.pipeline_degree 2"),
    ({"strategies": ["single", "pp-ddp"], "nproc": 3, "grad_accum_steps": [1, 2]},
     "arms pp-ddp-accum1, pp-ddp-accum2 (3 rank(s)): world size 3 is not divisible"),
])
def test_a_refused_arm_is_named_in_the_one_line(recipe, tmp_path, capsys, matrix, words):
    """The whole experiment is refused before any arm runs, in one line that starts with the arm(s) refused."""
    out = tmp_path / "exp"
    _one_line_exit_2(main(["compare", str(_matrix(tmp_path, recipe, steps=2, **matrix)), "--output", str(out)]),
                     capsys, (f"toolkit: error: {words}",), out)


def test_the_command_lines_output_wins_over_an_output_dir(recipe, tmp_path):
    """--output named the folder the docs promise; the experiment went to the output_dir given beside it."""
    wanted, other = tmp_path / "wanted", tmp_path / "other"
    given = ["--strategies", "single", "--set", f"output_dir={other}", "--output", str(wanted)]
    assert experiment_of(build_parser().parse_args(["compare", str(recipe), *given])).out_dir == wanted
    matrix = _matrix(tmp_path, recipe, strategies=["single"], set=[f"output_dir={other}"])
    assert experiment_of(build_parser().parse_args(["compare", str(matrix), "--output", str(wanted)])).out_dir \
        == wanted
    assert not other.exists() and not wanted.exists()  # nothing written before the arms run


def test_a_matrix_files_recipe_is_read_from_the_matrix_files_folder(recipe, tmp_path, monkeypatch, capsys):
    """`toolkit compare sub/m.yaml` with `recipe: r.yaml` read ./r.yaml: not found, or another recipe."""
    sub = tmp_path / "sub"
    sub.mkdir()
    beside = sub / "r.yaml"
    beside.write_text(recipe.read_text().replace("lr: 0.001", "lr: 0.002"))
    matrix = sub / "m.yaml"
    matrix.write_text(yaml.safe_dump({"recipe": "r.yaml", "strategies": ["single"]}))
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # holds no r.yaml
    args = ["compare", "../sub/m.yaml", "--output", str(tmp_path / "exp")]
    experiment = experiment_of(build_parser().parse_args(args))
    assert experiment.recipe == str(beside) and capsys.readouterr().err == ""
    monkeypatch.chdir(recipe.parent)  # holds an r.yaml too (lr 0.001): the matrix file's folder wins, said once
    experiment = experiment_of(build_parser().parse_args(["compare", "sub/m.yaml", *args[2:]]))
    assert experiment.recipe == str(beside)
    assert load_recipe(experiment.recipe, [*experiment.common, *experiment.arms[0].overrides]).optim.lr == 0.002
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"recipe: r.yaml is read from the matrix file's folder ({beside}), not from the " \
        f"current folder ({recipe})" in err[0], err


def test_a_matrix_recipe_found_only_from_the_current_folder_is_taken_with_a_note(recipe, tmp_path, monkeypatch,
                                                                                  capsys):
    """What compare read before: a matrix file written for it keeps working, and says how to write it now."""
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "m.yaml").write_text(yaml.safe_dump({"recipe": "r.yaml", "strategies": ["single"]}))
    monkeypatch.chdir(tmp_path)
    experiment = experiment_of(build_parser().parse_args(["compare", "sub/m.yaml", "--output", "exp"]))
    assert experiment.recipe == str(recipe)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"is not in the matrix file's folder; read {recipe} from the current folder" in err[0] \
        and "write recipe: ../r.yaml" in err[0], err
    (sub / "m.yaml").write_text(yaml.safe_dump({"recipe": "none.yaml", "strategies": ["single"]}))
    _one_line_exit_2(main(["compare", "sub/m.yaml", "--output", "exp"]), capsys,
                     (f"sub/m.yaml: recipe: none.yaml not found at {sub / 'none.yaml'}", "matrix file's folder"),
                     tmp_path / "exp")


@pytest.fixture
def two_arms(two_arm_compare):
    """The shared finished 2-arm compare: (its folder, the arguments that made it)."""
    _, out, args = two_arm_compare
    return out, args


def _damage(folder, arm, text, file="metrics.jsonl"):
    (folder / arm / file).write_text(text)


@pytest.mark.parametrize("file, text, words", [
    ("metrics.jsonl", "", "holds no step"), ("metrics.jsonl", '{"step": 1, "loss": 10.', "line 1 is no JSON"),
    ("metrics.jsonl", '{"step": 1}\n', "line 1 is no step record"),
    # cut at a line's end: its step 1 was read as the arm's final loss, and the arm "diverged"
    ("metrics.jsonl", "FIRST LINE", "ends at step 1 of the run's 3"),
    ("metrics.jsonl", "LOSS abc", "line 1: loss is 'abc', not a number"),  # was a TypeError in the verdict
    # the run's resolved recipe, which the report and a re-run's settings check read (before: a YAMLError)
    ("recipe.yaml", "model: {", "cannot be read"), ("recipe.yaml", "- a list\n", "cannot be read")])
def test_report_shows_an_arm_whose_files_are_damaged_and_the_others(two_arms, tmp_path, capsys, file, text, words):
    """An emptied metrics.jsonl was a StatisticsError; one cut mid-line a JSONDecodeError, and no report."""
    out, _ = two_arms
    copy = tmp_path / "exp"
    shutil.copytree(out, copy)
    if text == "FIRST LINE":  # the shared compare ran 1 step: its run.json says 3, as a 3-step run's cut to its first
        run_json = copy / "single@optim.lr=2e-3" / "run.json"
        run_json.write_text(json.dumps({**json.loads(run_json.read_text()), "total_steps": 3}))
        text = (copy / "single@optim.lr=2e-3" / file).read_text().splitlines(keepends=True)[0]
    if text == "LOSS abc":
        lines = (copy / "single@optim.lr=2e-3" / file).read_text().splitlines(keepends=True)
        text = "".join([json.dumps({**json.loads(lines[0]), "loss": "abc"}) + "\n", *lines[1:]])
    _damage(copy, "single@optim.lr=2e-3", text, file)
    assert main(["report", str(copy)]) == 0
    table = capsys.readouterr().out
    arms = {a["arm"]: a for a in json.loads((copy / "results.json").read_text())["arms"]}
    damaged = arms["single@optim.lr=2e-3"]
    assert damaged["status"] == damaged["verdict"] == "damaged"
    assert str(copy / "single@optim.lr=2e-3" / file) in damaged["error"] and words in damaged["error"]
    assert arms["single"]["verdict"] == "reference" and arms["single"]["tokens_per_s"] > 0
    # the console says it below its verdict table, wrapped at 120 characters; report.md in full
    printed = [line for line in table.splitlines() if not line.startswith("[report]")]
    assert f"single@optim.lr=2e-3 damaged: {damaged['error']}" in " ".join(line.strip() for line in printed)
    assert max(len(line) for line in printed) <= 120, printed
    assert f"**single@optim.lr=2e-3** damaged: {damaged['error']}" in (copy / "report.md").read_text()


def test_a_damaged_arm_json_or_failed_json_leaves_the_report_whole(two_arms, tmp_path, capsys):
    """arm.json holds only the arm's wall time, failed.json its error line: either damaged was a JSONDecodeError
    in `toolkit report` and in every re-run compare, which skipped the arm as completed and then could not
    report it."""
    out, _ = two_arms
    copy = tmp_path / "exp"
    shutil.copytree(out, copy)
    for text in ("{", '{"wall_s": "x"}'):  # cut short, or of the wrong type
        _damage(copy, "single@optim.lr=2e-3", text, "arm.json")
        assert main(["report", str(copy)]) == 0
        arms = {a["arm"]: a for a in json.loads((copy / "results.json").read_text())["arms"]}
        arm = arms["single@optim.lr=2e-3"]
        assert arm["status"] == "completed" and arm["tokens_per_s"] > 0, text
    (copy / "single@optim.lr=2e-3" / "run.json").unlink()  # the arm as a failed run leaves it
    _damage(copy, "single@optim.lr=2e-3", "{", "failed.json")
    assert main(["report", str(copy)]) == 0
    failed = {a["arm"]: a for a in json.loads((copy / "results.json").read_text())["arms"]}["single@optim.lr=2e-3"]
    assert failed["verdict"] == "failed" and "failed.json holds no error line" in failed["error"], failed
    capsys.readouterr()


def test_a_report_with_no_room_on_the_disk_is_one_line_after_its_table(two_arms, tmp_path, capsys):
    """`toolkit report` (and compare's own report) on a full disk (the file size limit: EFBIG where a full disk
    gives ENOSPC): before, matplotlib's traceback from the first plot. Now the verdict table is printed, then one
    line saying how to write the report once there is room, exit 1, and no file of the report left cut short."""
    out, _ = two_arms
    copy = tmp_path / "exp"
    shutil.copytree(out, copy)
    report_files = ("results.json", "report.md", "report.html", "curves.png", "memory.png")
    for name in report_files:
        (copy / name).unlink()

    def limit_file_size() -> None:  # below results.json (each arm's resolved recipe: several kB)
        resource.setrlimit(resource.RLIMIT_FSIZE, (2000, 2000))

    result = subprocess.run([sys.executable, "-m", "toolkit", "report", str(copy)], cwd=REPO, env=toolkit_env(),
                            capture_output=True, text=True, timeout=300, preexec_fn=limit_file_size)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.splitlines() == [
        f"toolkit: the report could not be written to {copy} (File too large (EFBIG)); each arm's results are kept "
        f"in its folder there; once the disk has room, toolkit report {copy} writes it"], result.stderr[-3000:]
    assert "single@optim.lr=2e-3" in result.stdout and "reference" in result.stdout  # the verdict table
    assert not [p.name for p in copy.iterdir() if p.name in report_files or p.name.endswith(".partial")]
    assert main(["report", str(copy)]) == 0  # with room: the report the line promised
    assert all((copy / name).is_file() for name in report_files)
    capsys.readouterr()


def test_a_compare_with_no_room_for_its_first_file_is_one_line(recipe, tmp_path):
    """experiment.json on a full disk (the file size limit, as above): before, a traceback and an experiment.json
    cut at the limit, which a re-run read as a damaged experiment. One line naming the file, exit 1, nothing cut
    short left (the net under every command for a write with no room: cli.py)."""
    out = tmp_path / "exp"

    def limit_file_size() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (300, 300))

    result = subprocess.run([sys.executable, "-m", "toolkit", "compare", str(recipe), "--strategies", "single,ddp",
                             "--steps", "1", "--output", str(out)], cwd=REPO, env=toolkit_env(), capture_output=True,
                            text=True, timeout=300, preexec_fn=limit_file_size)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.splitlines() == [
        f"toolkit: a file could not be written to {out / 'experiment.json'} (File too large (EFBIG)); once the disk "
        "has room, run the command again"], result.stderr[-3000:]
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("status", ["damaged", "pending"])
def test_a_reference_without_numbers_leaves_the_other_arms_unjudged(status, two_arms, tmp_path, capsys):
    """The other arms' `× ref` was nan, in the terminal, report.md and report.html alike."""
    out, _ = two_arms
    copy = tmp_path / "exp"
    shutil.copytree(out, copy)
    if status == "damaged":
        _damage(copy, "single", "")
    else:  # not run: its folder gone
        shutil.rmtree(copy / "single")
    assert main(["report", str(copy)]) == 0
    table = capsys.readouterr().out
    results = json.loads((copy / "results.json").read_text())
    arms = results["arms"]
    assert [a["verdict"] for a in arms] == [status if status == "damaged" else "not run",
                                            f"no reference (reference arm {status})"]
    assert arms[1]["tokens_per_s"] > 0
    head, rows = table_rows(results)
    assert rows[1][head.index("× ref")] == "–"
    note = f"× ref –: the reference arm single has no measurement ({status}), so no arm's tokens/s is shown"
    markdown, page = (copy / "report.md").read_text(), (copy / "report.html").read_text()
    assert note in table and note in markdown and html.escape(note) in page
    assert " nan " not in table and "| nan |" not in markdown and "<td>nan</td>" not in page


def test_a_rerun_compare_runs_the_damaged_arm_again(two_arms, tmp_path, capsys, forked_children):
    out, args = two_arms
    copy = tmp_path / "exp"
    shutil.copytree(out, copy)
    _damage(copy, "single@optim.lr=2e-3", '{"step": 1, "lo')
    assert main([*args[:-1], str(copy)]) == 0
    printed = capsys.readouterr().out
    assert "single: already completed, skipped" in printed and "single@optim.lr=2e-3: completed" in printed
    assert ("single@optim.lr=2e-3: the earlier run here (completed, its files damaged) is replaced: the arm runs "
            "afresh, so that its numbers come from one uninterrupted run") in printed
    verdicts = [a["verdict"] for a in json.loads((copy / "results.json").read_text())["arms"]]
    assert verdicts[0] == "reference" and verdicts[1] not in ("damaged", "failed")


def test_a_rerun_with_the_arms_reordered_names_the_reference_arm(two_arms, tmp_path, capsys):
    """The refusal named an internal key: (train.record_gradient_scale: False then, True now)."""
    out, args = two_arms
    code = main([*args[:3], "single@optim.lr=2e-3,single", *args[4:]])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert f"{out} holds arm single@optim.lr=2e-3 run with other settings" in err[0]
    assert "(not the reference (first) arm then, the reference now)" in err[0] and "record_gradient" not in err[0]
    code = main([*args[:3], "ddp,single", *args[4:]])  # single, the reference then, follows a new arm
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "arm single run with other settings (the reference (first) arm then, " \
        "ddp is now)" in err[0], err


def test_a_rerun_from_another_folder_reuses_the_arms(two_arms, tmp_path, monkeypatch, capsys):
    """A matrix file's relative recipe: and the saved experiment's recipe both resolve from any folder."""
    out, args = two_arms
    copy = tmp_path / "exp"
    shutil.copytree(out, copy)
    (tmp_path / "matrices").mkdir()
    matrix = tmp_path / "matrices" / "m.yaml"
    recipe = os.path.relpath(args[1], matrix.parent)
    matrix.write_text(yaml.safe_dump({"recipe": recipe, "strategies": args[3].split(","), "steps": 1}))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main(["compare", "../matrices/m.yaml", "--output", "../exp"]) == 0
    printed = capsys.readouterr().out
    assert "single: already completed, skipped" in printed and "single@optim.lr=2e-3: already completed" in printed
    assert json.loads((copy / "experiment.json").read_text())["recipe"] == args[1]  # absolute
    assert not (elsewhere / "exp").exists()


@pytest.fixture
def micro4_recipe(tmp_path, tiny_llama_dir):
    """Micro-batch 4, global batch 8, the accumulation derived."""
    return write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=tmp_path / "unused",
                        batch={"micro_batch_size": 4, "grad_accum_steps": None, "global_batch_size": 8})


def test_each_arm_splits_the_global_batch_over_its_own_data_parallel_ranks(micro4_recipe, tmp_path):
    """Compare refused `--set batch.global_batch_size=4 --strategies single,pp-gpipe,tp --nproc 2` as if all 2 ranks
    read separate samples (`4 is not a multiple of 2 ranks × micro 4`), where plan and validate accept each arm: a
    pipeline's stages and tp's ranks read the same samples."""
    args = ["compare", str(micro4_recipe), "--set", "batch.global_batch_size=4", "--strategies", "single,pp-gpipe,tp",
            "--nproc", "2", "--output", str(tmp_path / "exp")]
    experiment = experiment_of(build_parser().parse_args(args))
    plans = {}
    for arm in experiment.arms:
        recipe = load_recipe(experiment.recipe, [*experiment.common, *arm.overrides])
        plans[arm.name] = (arm.nproc, validate_strategy(recipe, world_size=arm.nproc))
    assert {name: (nproc, plan.world_size, plan.micro_batch_size, plan.grad_accum_steps, plan.global_batch_size)
            for name, (nproc, plan) in plans.items()} == \
        {"single": (1, 1, 4, 1, 4), "pp-gpipe": (2, 1, 4, 1, 4), "tp": (2, 1, 4, 1, 4),
         "calibration-rounding": (1, 1, 4, 1, 4)}  # the fp32 reference again from a rounding-perturbed start


@pytest.mark.parametrize("arms, nproc, words", [
    # pp-ddp at 4 ranks: 2 pipelines of 2 stages, 2 data-parallel ranks (compare said "4 ranks × micro 4 = 16")
    ("single,pp-ddp", "4", "arm pp-ddp (4 rank(s), 2 of them data-parallel): batch: global_batch_size 4 is not a "
                           "multiple of 2 ranks × micro 4 = 8"),
    ("single,ddp", "2", "arm ddp (2 rank(s), 2 of them data-parallel): batch: global_batch_size 4 is not a "
                        "multiple of 2 ranks × micro 4 = 8"),
])
def test_a_global_batch_an_arm_cannot_split_names_the_arm_and_its_data_parallel_ranks(micro4_recipe, tmp_path, capsys,
                                                                                     arms, nproc, words):
    out = tmp_path / "exp"
    _one_line_exit_2(main(["compare", str(micro4_recipe), "--set", "batch.global_batch_size=4", "--strategies", arms,
                           "--nproc", nproc, "--output", str(out)]), capsys, (words,), out)


def test_a_matrix_accumulation_the_global_batch_cannot_take_is_one_line(micro4_recipe, tmp_path, capsys):
    """global 8 over 2 ranks × accum 3 gave micro 1 and a refusal that offered grad_accum_steps=null."""
    path = _matrix(tmp_path, micro4_recipe, strategies=["single", "ddp"], grad_accum_steps=[1, 3])
    out = tmp_path / "exp"
    _one_line_exit_2(main(["compare", str(path), "--output", str(out)]), capsys,
                     ("arm single-accum3: global batch 8 does not split into 1 data-parallel rank(s) × accum 3",
                      "a multiple of 3"), out)


def test_a_pipeline_references_calibration_runs_take_its_data_parallel_batch(micro4_recipe, tmp_path):
    """bf16 calibration runs (the reference twice, micro batch halved) planned a pipeline reference's batch over
    all its ranks: refused `global_batch_size 4 is not a multiple of 2 ranks × micro 4`."""
    args = ["compare", str(micro4_recipe), "--set", "batch.global_batch_size=4", "--set", "precision=bf16",
            "--strategies", "pp-gpipe,single", "--nproc", "2", "--output", str(tmp_path / "exp")]
    experiment = experiment_of(build_parser().parse_args(args))
    calibration = {arm.name: arm for arm in experiment.arms if arm.name.startswith("calibration-")}
    micro = {name: load_recipe(experiment.recipe, [*experiment.common, *arm.overrides]).batch.micro_batch_size
             for name, arm in calibration.items()}
    assert micro == {"calibration-bf16-a": 4, "calibration-bf16-b": 2}
    assert {arm.nproc for arm in calibration.values()} == {2}


def test_both_arms_mfu_divide_by_the_higher_peak_either_measured(two_arms, tmp_path, capsys):
    """Each arm's MFU was divided by the CPU peak it measured at its start: the faster arm could show the lower MFU."""
    out, _ = two_arms
    copy = tmp_path / "exp"
    shutil.copytree(out, copy)
    # the rounding reference (a calibration run of the reference) measured a peak too: the lowest here. The peaks
    # are set far above any rate one CPU thread achieves: a peak below the achieved rate gives no MFU (mfu's doc),
    # and a fast machine ran these steps at 8.7 GFLOP/s
    for arm, flops_per_s in (("single", 4e11), ("single@optim.lr=2e-3", 8e11), ("calibration-rounding", 2e11)):
        run = json.loads((copy / arm / "run.json").read_text())
        run["cpu_matmul_peak"]["flops_per_s"] = flops_per_s
        (copy / arm / "run.json").write_text(json.dumps(run))
    assert main(["report", str(copy)]) == 0
    arms = json.loads((copy / "results.json").read_text())["arms"]
    assert [a["peak_flops_per_s"] for a in arms] == [8e11, 8e11]  # 1 rank each
    for a in arms:
        assert a["mfu"] == pytest.approx(a["tokens_per_s"] * a["flops"]["flops_per_token"] / 8e11)
    line = ("the highest per-rank peak of the 2 arms and the rounding reference's run that measured so, "
            "single@optim.lr=2e-3's 800.00 GFLOP/s")
    assert (copy / "report.md").read_text().count(line) == 1


def test_the_recommendation_names_its_baseline_plain_data_parallelism_read_from_the_strategy(two_arms, tmp_path):
    """Without a ddp arm, the per-arm lines were set against the multi-rank arm with the most model-state memory per
    rank (tp, a pipeline: no data parallelism), and nothing said which arm or why."""
    out, _ = two_arms
    copy = tmp_path / "exp"
    shutil.copytree(out, copy)
    run_json = copy / "single@optim.lr=2e-3" / "run.json"  # as if it ran as ddp: its strategy is what is read
    run_json.write_text(json.dumps({**json.loads(run_json.read_text()), "strategy": "ddp"}))
    assert main(["report", str(copy)]) == 0
    results = json.loads((copy / "results.json").read_text())
    assert results["plain_data_parallel"] == ["ddp"]
    assert [(a["arm"], a["plain_data_parallel"], a["verdict"]) for a in results["arms"]] == \
        [("single", False, "reference"), ("single@optim.lr=2e-3", True, "diverged in final weights")]
    assert "- each arm below is set against **single**: the reference arm, as plain data parallelism " \
           "(single@optim.lr=2e-3) is not recommended\n" in (copy / "report.md").read_text()


def test_a_one_step_compare_marks_its_speed_and_a_first_step_count_of_collectives(two_arms, tmp_path, capsys):
    """--steps 1: tokens/s and MFU were the first step's, and collectives counted on it were shown as one steady
    step's (a pipeline's shape exchange, DDP's first broadcast). One process counts none: nothing to mark there."""
    out, _ = two_arms
    copy = tmp_path / "exp"
    shutil.copytree(out, copy)
    run_json = copy / "single@optim.lr=2e-3" / "run.json"  # as if it had sent 1 MiB on its (first) counted step
    run = json.loads(run_json.read_text())
    run["comm_per_step"].update(total_bytes=2 ** 20, bytes_by_op={"broadcast": 2 ** 20}, calls_by_op={"broadcast": 1})
    run_json.write_text(json.dumps(run))
    assert main(["report", str(copy)]) == 0
    table = capsys.readouterr().out
    results = json.loads((copy / "results.json").read_text())
    assert [(a["comm"]["step"], a["comm"]["includes_setup"]) for a in results["arms"]] == [(1, False), (1, True)]
    head, rows = table_rows(results)
    for row in rows:
        cells = dict(zip(head, row))
        assert all(cells[c].endswith(" (no steady step)") for c in ("tokens/s", "× ref", "step ms (p10–p90)", "MFU"))
    assert [dict(zip(head, row))["comm MiB/step"] for row in rows] == ["0.00", "1.00 (incl. set-up)"]
    assert "(no steady step): single, single@optim.lr=2e-3 ran no step past the warm-up" in table
    assert "- single@optim.lr=2e-3 (step 1, incl. set-up, rank 0): broadcast 1.00 MiB in 1 call(s)" in \
        (copy / "report.md").read_text()


@pytest.mark.parametrize("report_to, tracking_dir", [("[]", False), ("tensorboard", True)])
def test_compare_points_an_arm_at_the_experiment_folder_only_when_it_tracks(recipe, tmp_path, monkeypatch, report_to,
                                                                            tracking_dir):
    """The recipe refuses train.tracking_dir without train.report_to: an untracked arm is not given one."""
    from toolkit.compare import runner
    from toolkit.compare.experiment import Arm, Experiment

    commands = []

    def launcher(recipe, overrides, *, nproc, log):  # the arm's overrides, and a failed launch
        commands.append(overrides)
        log.write_text("toolkit: launch failed: rank 0 exit code 1\n")
        return 1

    monkeypatch.setattr(runner, "_run_launcher", launcher)
    experiment = Experiment(recipe=str(recipe), out_dir=tmp_path, arms=[Arm(name="a", overrides=(), nproc=1)],
                            common=[f"train.report_to={report_to}"])
    assert runner.run_arm(experiment, experiment.arms[0]) == "failed"
    assert (f"train.tracking_dir={tmp_path}" in commands[0]) is tracking_dir


@pytest.mark.parametrize("raised, status", [(ValueError("a bug"), "failed"), (KeyboardInterrupt(), "interrupted")])
def test_an_arms_launch_that_raises_fails_or_stops_that_arm_and_gives_the_output_back(recipe, tmp_path, monkeypatch,
                                                                                     capfd, raised, status):
    """compare runs each arm's launch in its own process, its output sent to the arm's launch.log: an exception
    out of it fails that arm (the others go on, as when the launch was a process of its own), Ctrl-C stops the
    experiment, and either way this process's output is its own again."""
    from toolkit.launch import launcher as launch
    from toolkit.compare import runner
    from toolkit.compare.experiment import Arm, Experiment

    def launch_recipe(recipe_path, overrides, *, nproc):
        print("the arm's own output")
        raise raised

    monkeypatch.setattr(launch, "launch_recipe", launch_recipe)
    experiment = Experiment(recipe=str(recipe), out_dir=tmp_path, arms=[Arm(name="a", overrides=(), nproc=1)])
    assert runner.run_arm(experiment, experiment.arms[0]) == status
    print("compare's own output")
    assert capfd.readouterr().out == "compare's own output\n"
    log = (tmp_path / "a" / "launch.log").read_text()
    assert log.startswith("the arm's own output\n")
    if status == "failed":
        assert "Traceback" in log and json.loads((tmp_path / "a" / "failed.json").read_text())["error"] == \
            "ValueError: a bug"


def test_compare_says_where_it_turns_dropout_off(tmp_path, tiny_llama_dir):
    """A recipe leaving the model's own dropout: compare turns it off in every arm (masks depend on the batch
    split) and says so, with the way to keep it; where the recipe sets dropout itself, nothing is said."""
    from toolkit.compare.experiment import dropout_note
    from toolkit.compare.report_render import render_markdown

    own = write_recipe(tmp_path / "own.yaml", model_dir=tiny_llama_dir, output_dir=tmp_path / "unused",
                       model={"path": str(tiny_llama_dir), "task": "causal-lm", "dropout": None})
    args = ["compare", str(own), "--strategies", "single,ddp", "--nproc", "2", "--output", str(tmp_path / "exp")]
    note = dropout_note(experiment_of(build_parser().parse_args(args)).common)
    assert note is not None and "model.dropout=0.0" in note and "--set model.dropout=P" in note
    kept = write_recipe(tmp_path / "kept.yaml", model_dir=tiny_llama_dir, output_dir=tmp_path / "unused")  # 0.0
    args = ["compare", str(kept), "--strategies", "single,ddp", "--nproc", "2", "--output", str(tmp_path / "exp2")]
    assert dropout_note(experiment_of(build_parser().parse_args(args)).common) is None
    arms = [{"arm": "single", "status": "failed", "world_size": 1, "error": "x", "verdict": "failed"}]
    results = {"recipe": str(own), "reference": "single", "machine": {}, "arms": arms, "dropout_note": note,
               "tolerances": "", "plain_data_parallel": ["ddp"]}
    top = render_markdown(results, []).split("| ")[0]  # before the verdict table
    assert f"Note: {note}." in top


def test_a_compare_interrupted_while_it_measures_the_machine_says_every_arm_is_kept(two_arms, tmp_path, capsys,
                                                                                   monkeypatch):
    """Ctrl-C after the last arm, while the machine was measured for the step-time predictions: only "toolkit:
    interrupted", and no word that the arms were kept or how to write the report."""
    from toolkit.compare import predictions

    out, args = two_arms
    copy = tmp_path / "exp"
    shutil.copytree(out, copy)
    (copy / predictions.PROFILE).unlink()

    def interrupted(*_, **__):
        raise KeyboardInterrupt
    monkeypatch.setattr(predictions, "measure_profile", interrupted)
    monkeypatch.setattr("sys.argv", ["toolkit", *args[:-1], str(copy)])
    assert main([*args[:-1], str(copy)]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"toolkit: compare interrupted while measuring this machine for the step-time predictions; every "
                   f"arm ran and is kept in {copy}; measure it and write the report with: toolkit "
                   f"{' '.join([*args[:-1], str(copy)])}"], err
    arms = sorted(p.name for p in copy.iterdir() if p.is_dir())
    assert arms == ["calibration-rounding", "single", "single@optim.lr=2e-3"], arms
    assert all((copy / arm / "model").is_dir() for arm in arms)
