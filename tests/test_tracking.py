"""train.report_to: TensorBoard and MLflow hold every number of every metrics.jsonl record, written by rank 0
only, read back with the libraries' own readers. The 2-rank run is test_equivalence's ddp-m2a2 (it also
equals the single-process reference there); nothing here launches ranks of its own (one 3-step run trains
in-process)."""

import json
import math
import shutil
import sys

import pytest

import test_equivalence
from conftest import metrics, write_recipe
from test_cli_errors import _assert_one_line_exit_2
from toolkit.cli import main
from toolkit.config.files import load_recipe
from toolkit.errors import RecipeError
from toolkit.process.stopping import Stopped


def _numbers(record: dict) -> dict:
    return {k: v for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


def _tensorboard_scalars(log_dir) -> dict:
    """tag -> {step: value}, as TensorBoard's own loader reads the folder."""
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={SCALARS: 0})  # 0: keep every event
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def _mlflow_history(client, run_id: str, keys) -> dict:
    return {key: [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]
            for key in keys}


@pytest.fixture(scope="module")
def tracked_run(llama_runs):
    return llama_runs.get("ddp-m2a2", nproc=2, overrides=test_equivalence.DDP_M2A2)


def test_tensorboard_holds_every_number_of_metrics_jsonl_from_rank_0(tracked_run):
    records = metrics(tracked_run)
    assert len(records) == 5 and "eval_loss" in records[-1]  # the final evaluation is tracked too
    boards = list((tracked_run / "tensorboard").iterdir())
    assert [b.name for b in boards] == ["ddp-m2a2"]  # the run's name: output_dir's folder
    assert len(list(boards[0].glob("events.out.tfevents.*"))) == 1  # one writer: rank 0
    want: dict = {}
    for record in records:
        for key, value in _numbers(record).items():
            want.setdefault(key, {})[record["step"]] = value
    got = _tensorboard_scalars(boards[0])
    assert got.keys() == want.keys()
    for key, by_step in want.items():
        assert got[key].keys() == by_step.keys(), key
        for step, value in by_step.items():  # TensorBoard keeps float32
            assert got[key][step] == pytest.approx(value, rel=2**-23), (key, step)


def test_mlflow_holds_every_number_of_metrics_jsonl_in_one_run(tracked_run):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tracked_run / 'mlflow.db'}")
    experiments = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(experiments)
    assert len(runs) == 1  # rank 0 only
    run = runs[0]
    assert run.info.run_name == "ddp-m2a2" and run.info.status == "FINISHED"
    assert run.data.params["strategy.name"] == "ddp" and float(run.data.params["optim.lr"]) == 1.0e-3
    assert run.data.params["train.report_to"] == '["tensorboard", "mlflow"]'
    records = metrics(tracked_run)
    keys = {key for record in records for key in _numbers(record)}
    assert set(run.data.metrics) == keys
    history = _mlflow_history(client, run.info.run_id, keys)
    for key in keys:  # float64 both sides: exactly equal
        want = [(r["step"], float(r[key])) for r in records if key in _numbers(r)]
        assert history[key] == want, key


@pytest.fixture(scope="module")
def mlflow_store(tracked_run, tmp_path_factory):
    """The MLflow store of the tests below, named by $MLFLOW_TRACKING_URI as a user's server would be: a copy
    of the tracked run's (a new SQLite store spends seconds creating its tables)."""
    path = tmp_path_factory.mktemp("mlflow") / "mlflow.db"
    shutil.copy(tracked_run / "mlflow.db", path)
    return f"sqlite:///{path}"


def _recipe(tmp_path, *overrides):
    path = write_recipe(tmp_path / "recipe.yaml", model_dir=tmp_path, output_dir=tmp_path / "run")
    return load_recipe(path, ["train.report_to=[tensorboard,mlflow]", *overrides])


def _record(step: int, loss: float) -> dict:
    return {"step": step, "loss": loss, "lr": 0.1, "tokens": 64, "skipped": False, "loss_scale": None}


def _mlflow_run(out, store: str):
    from mlflow.tracking import MlflowClient

    saved = json.loads((out / "tracking.json").read_text())["mlflow"]
    assert saved["tracking_uri"] == store and not (out / "mlflow.db").exists()  # the environment's store
    client = MlflowClient(tracking_uri=store)
    return client, client.get_run(saved["run_id"])


def test_resume_continues_the_mlflow_run_and_tensorboard_hides_the_redone_steps(tmp_path, mlflow_store,
                                                                                monkeypatch):
    from toolkit.observe import tracking

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_store)
    recipe = _recipe(tmp_path)
    out = tmp_path / "run"
    out.mkdir()
    # a run stopped after step 4, its checkpoint at step 2: steps 3 and 4 are run again on resume
    with pytest.raises(Stopped):
        with tracking.metrics_log(recipe, out_dir=out, done_steps=0, main=True) as log:
            for step in range(1, 5):
                log.write(_record(step, loss=10.0 - step))
            raise Stopped(15, 4, 6, None)
    first = json.loads((out / "tracking.json").read_text())["mlflow"]["run_id"]
    with tracking.metrics_log(recipe, out_dir=out, done_steps=2, main=True) as log:
        for step in range(3, 7):
            log.write(_record(step, loss=100.0 - step))
    board = _tensorboard_scalars(out / "tensorboard" / "run")
    assert board["loss"] == {1: 9.0, 2: 8.0, 3: 97.0, 4: 96.0, 5: 95.0, 6: 94.0}
    assert set(board) == {"loss", "lr", "tokens"}  # a flag and a null are not plotted
    client, run = _mlflow_run(out, mlflow_store)
    assert run.info.run_id == first and run.info.status == "FINISHED"
    loss = _mlflow_history(client, first, ["loss"])["loss"]
    # MLflow keeps whatever it was sent: the redone steps twice (docs/launching.md says so)
    assert sorted(loss) == sorted([(1, 9.0), (2, 8.0), (3, 7.0), (4, 6.0),
                                   (3, 97.0), (4, 96.0), (5, 95.0), (6, 94.0)])


def test_a_stopped_run_is_marked_killed_a_crashed_one_failed(tmp_path, mlflow_store, monkeypatch):
    from toolkit.observe import tracking

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_store)
    recipe = _recipe(tmp_path, "train.report_to=mlflow")  # one name, not a list
    assert recipe.train.report_to == ("mlflow",)
    statuses = []
    for name, error in (("stopped", Stopped(15, 1, 2, None)), ("crashed", RuntimeError("boom"))):
        out = tmp_path / name
        out.mkdir()
        with pytest.raises(type(error)):
            with tracking.metrics_log(recipe, out_dir=out, done_steps=0, main=True) as log:
                log.write(_record(1, loss=math.pi))
                raise error
        client, run = _mlflow_run(out, mlflow_store)
        assert [m.value for m in client.get_metric_history(run.info.run_id, "loss")] == [math.pi]
        statuses.append(run.info.status)
    assert statuses == ["KILLED", "FAILED"]


@pytest.mark.parametrize("command", ["train", "validate"])
def test_unknown_tracker_is_one_line_naming_the_choices(command, tmp_path, tiny_llama_dir, capsys):
    out = tmp_path / "out"
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=out)
    code = main([command, str(recipe), "--set", "train.report_to=[tensorboard,wandb]"])
    _assert_one_line_exit_2(code, capsys, "train.report_to: unknown value 'wandb'; choose one of tensorboard, mlflow",
                            out)


@pytest.mark.parametrize("command", ["train", "validate"])
@pytest.mark.parametrize("tracker, module, install", [("tensorboard", "tensorboard", "pip install tensorboard"),
                                                      ("mlflow", "mlflow", "pip install mlflow-skinny")])
def test_a_missing_tracker_package_is_one_line_naming_the_pip_install(command, tracker, module, install, tmp_path,
                                                                      tiny_llama_dir, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, module, None)  # importlib finds no such module
    out = tmp_path / "out"
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=out)
    code = main([command, str(recipe), "--set", f"train.report_to={tracker}"])
    _assert_one_line_exit_2(code, capsys, install, out)


def test_a_tracker_switched_off_mid_run_is_in_run_json(tmp_path, tiny_llama_dir, monkeypatch):
    """The warning scrolls away; run.json says why the plot ends at step 2 (metrics.jsonl has every step)."""
    import torch

    from toolkit.observe import tracking
    from toolkit.process.dist import DistEnv
    from toolkit.train.loop import train

    def full_disk(self, step, values):
        if step == 2:
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(tracking.TensorBoard, "write", full_disk)
    out = tmp_path / "run"
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=out,
                                      train={"max_steps": 3, "report_to": "tensorboard"}))
    train(recipe, DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu")))
    assert [r["step"] for r in metrics(out)] == [1, 2, 3]
    assert json.loads((out / "run.json").read_text())["trackers_switched_off"] == [
        {"tracker": "tensorboard", "step": 2, "error": "OSError: [Errno 28] No space left on device"}]


def test_a_store_error_mlflow_does_not_wrap_is_one_line_naming_the_store(tmp_path, monkeypatch):
    """The SQL driver's errors (here SQLAlchemy's DatabaseError) reach the caller unwrapped by MLflow."""
    from toolkit.observe import tracking

    store = tmp_path / "notadb.db"
    store.write_text("garbage, not a database\n")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{store}")
    with pytest.raises(RecipeError, match=r"the store sqlite:///.*notadb.db cannot be opened \(DatabaseError: .*\); "
                                          r"fix or unset MLFLOW_TRACKING_URI$"):
        tracking.open_mlflow(_recipe(tmp_path, "train.report_to=mlflow"), out_dir=tmp_path, saved={})


def test_a_mistake_found_at_tracker_start_leaves_a_folder_made_beforehand_as_it_was(tmp_path, tiny_llama_dir,
                                                                                    monkeypatch, capsys):
    """A job script's `mkdir -p` made output_dir: the run's files go, the user's stay, and the rerun is not
    refused as "already holds a run"."""
    import torch

    from toolkit.observe import tracking
    from toolkit.process.dist import DistEnv
    from toolkit.launch.rank import train_rank

    def changed_since_checked(*args, **kwargs):
        raise RecipeError("train.report_to tensorboard: cannot write here")

    monkeypatch.setattr(tracking, "TensorBoard", changed_since_checked)
    out = tmp_path / "run"
    (out / "notes").mkdir(parents=True)
    (out / "notes" / "job.sh").write_text("mkdir -p run\n")
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=out,
                                      train={"max_steps": 1, "report_to": "tensorboard"}))
    env = DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    assert train_rank(recipe, env, None) == (2, None)
    assert "cannot write here" in capsys.readouterr().err
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == ["notes", "notes/job.sh"]


def test_a_deleted_experiment_is_one_line_naming_it_before_the_run_and_at_open(tmp_path, monkeypatch):
    """Read from the SQLite file before any rank starts; asked of the store (a server's too) when the run opens."""
    from mlflow.tracking import MlflowClient

    from toolkit.observe import tracking
    from toolkit.train import tracking_checks

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=store)
    client.delete_experiment(client.create_experiment("gone"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "gone")
    recipe = _recipe(tmp_path, "train.report_to=mlflow")
    words = r"the experiment 'gone' \(MLFLOW_EXPERIMENT_NAME\) is deleted in the store; restore it"
    with pytest.raises(RecipeError, match=words):
        tracking_checks.check_trackers(recipe)
    with pytest.raises(RecipeError, match=words):
        tracking.open_mlflow(recipe, out_dir=tmp_path, saved={})
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "kept")
    tracking_checks.check_trackers(recipe)  # another name: a new experiment


def test_a_new_run_whose_tensorboard_name_holds_another_runs_events_takes_more_of_its_path(tmp_path, capsys):
    """sweepA/seed0 and sweepB/seed0 in one tracking_dir: the later run's purge_step hid the earlier one's curves.
    A resume keeps the folder tracking.json names."""
    from toolkit.observe import tracking

    shared = tmp_path / "shared"

    def recipe_for(out):
        return load_recipe(write_recipe(tmp_path / "r.yaml", model_dir=tmp_path, output_dir=out),
                           ["train.report_to=tensorboard", f"train.tracking_dir={shared}"])

    first = tracking.tensorboard_log_dir(recipe_for(tmp_path / "sweepA" / "seed0"), saved={})
    assert first == shared / "tensorboard" / "seed0"
    first.mkdir(parents=True)
    assert tracking.tensorboard_log_dir(recipe_for(tmp_path / "sweepB" / "seed0"), saved={}) == first  # no events yet
    (first / "events.out.tfevents.1.host").write_bytes(b"")
    second = tracking.tensorboard_log_dir(recipe_for(tmp_path / "sweepB" / "seed0"), saved={})
    assert second == shared / "tensorboard" / "sweepB-seed0"
    assert f"{first} holds another run's events; this run is sweepB-seed0" in capsys.readouterr().err
    resumed = tracking.tensorboard_log_dir(recipe_for(tmp_path / "sweepA" / "seed0"), saved={"log_dir": str(first)})
    assert resumed == first


def test_a_mistake_after_the_trackers_opened_removes_this_runs_tensorboard_files_only(tmp_path, monkeypatch):
    """rank 0 removes what a run made in output_dir after a user's mistake (toolkit.launch.rank); the TensorBoard folder
    it began in a separate tracking_dir stayed, and made a rerun take another name (its events were there)."""
    from toolkit.observe import tracking

    shared = tmp_path / "shared"

    def recipe_for(out, report_to="tensorboard"):
        return load_recipe(write_recipe(tmp_path / "r.yaml", model_dir=tmp_path, output_dir=out),
                           [f"train.report_to={report_to}", f"train.tracking_dir={shared}"])

    def store_gone(*args, **kwargs):  # found at open (a server's deleted experiment), after TensorBoard began
        raise RecipeError("train.report_to mlflow: the store cannot be used")

    monkeypatch.setattr(tracking, "open_mlflow", store_gone)
    out = tmp_path / "a" / "run"
    out.mkdir(parents=True)
    with pytest.raises(RecipeError, match="cannot be used"):
        with tracking.metrics_log(recipe_for(out, "[tensorboard,mlflow]"), out_dir=out, done_steps=0, main=True):
            pass
    assert not shared.exists()  # tracking_dir, tensorboard/ and the run's folder were all this run's

    other = shared / "tensorboard" / "other"  # another run's, beside this one's in a shared tracking_dir
    other.mkdir(parents=True)
    (other / "events.out.tfevents.1.host").write_bytes(b"kept")
    mistake = RecipeError("found at step 1")
    with pytest.raises(RecipeError, match="found at step 1"):
        with tracking.metrics_log(recipe_for(out), out_dir=out, done_steps=0, main=True) as log:
            log.write(_record(1, loss=1.0))
            assert tracking.holds_events(shared / "tensorboard" / "run")  # written, before the mistake
            raise mistake
    assert sorted(p.name for p in (shared / "tensorboard").iterdir()) == ["other"]

    mine = shared / "tensorboard" / "run"  # a resumed run keeps the events of its earlier attempts
    mine.mkdir()
    (mine / "events.out.tfevents.0.host").write_bytes(b"steps 1-2")
    (out / "tracking.json").write_text(json.dumps({"tensorboard": {"log_dir": str(mine)}}))
    with pytest.raises(RecipeError):
        with tracking.metrics_log(recipe_for(out), out_dir=out, done_steps=2, main=True) as log:
            log.write(_record(3, loss=1.0))
            raise mistake
    assert [p.name for p in mine.iterdir()] == ["events.out.tfevents.0.host"]
