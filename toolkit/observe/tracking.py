"""Experiment trackers (train.report_to): TensorBoard and MLflow get exactly the records metrics.jsonl gets,
on rank 0, through the libraries' own writers (torch's SummaryWriter, MLflow's client).

Where they write: <tracking_dir>/tensorboard/<run> and MLflow's $MLFLOW_TRACKING_URI (its experiment:
$MLFLOW_EXPERIMENT_NAME, else Default), else the SQLite store <tracking_dir>/mlflow.db; tracking_dir defaults
to output_dir and <run> is output_dir's folder name (more of its path where another run's events hold that
name). output_dir/tracking.json says where, and holds the TensorBoard folder and MLflow run that --resume
continues. On resume TensorBoard hides the events of the steps the checkpoint does not
hold (SummaryWriter's purge_step); MLflow keeps every value it was sent, so such steps appear twice there.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Protocol

from toolkit.config.files import dump_recipe, recipe_to_dict
from toolkit.config.recipe import Recipe
from toolkit.errors import RecipeError, first_line
from toolkit.observe.metrics import JsonlWriter
from toolkit.process.cleanup import entries, remove_made
from toolkit.process.stopping import Stopped

TRACKING_FILE = "tracking.json"  # in output_dir: where this run's trackers write, and its MLflow run


class Tracker(Protocol):
    name: str  # as train.report_to names it

    def write(self, step: int, values: dict[str, float]) -> None: ...

    def close(self, status: str) -> None: ...

    def drop(self) -> None:
        """After a failure: let go of what it holds, asking its store nothing (it just failed)."""

    def discard(self) -> None:
        """After a user's mistake ended the run (closed already): remove what this run began writing, as rank 0
        does in output_dir (toolkit.process.cleanup.remove_made), where that is a folder of its own."""


def run_name(recipe: Recipe) -> str:
    """The run's name in every tracker: output_dir's folder name (a compare arm's name)."""
    return Path(recipe.output_dir).resolve().name


def tracking_root(recipe: Recipe) -> Path:
    return Path(recipe.train.tracking_dir or recipe.output_dir)


def tensorboard_dir(root: Path, name: str) -> Path:
    """One TensorBoard run per folder: `tensorboard --logdir <root>/tensorboard` overlays every run under it."""
    return root / "tensorboard" / name


def holds_events(log_dir: Path) -> bool:
    return log_dir.is_dir() and any(log_dir.glob("events.out.tfevents.*"))


def fresh_tensorboard_name(root: Path, out_dir: Path) -> str:
    """A new run's TensorBoard folder name: output_dir's folder name, unless another run's events are there
    (sweepA/seed0 and sweepB/seed0 in one tracking_dir): then more of output_dir's path (sweepB-seed0), then a
    number. Shared, the later run's purge_step hid the earlier one's curves. tracking.json keeps the name, for
    --resume to write on in the same folder."""
    parts = out_dir.resolve().parts[1:]  # without the root, "/"
    candidates = ["-".join(parts[-count:]) for count in range(1, len(parts) + 1)]
    candidates += [f"{candidates[0]}-{number}" for number in range(2, 1000)]
    return next(name for name in candidates if not holds_events(tensorboard_dir(root, name)))


def mlflow_tracking_uri(recipe: Recipe) -> str:
    """$MLFLOW_TRACKING_URI, as MLflow reads it itself; else a SQLite file in tracking_dir, MLflow's own local
    default (its file store ./mlruns is in maintenance mode: MLflow refuses it unless MLFLOW_ALLOW_FILE_STORE)."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(tracking_root(recipe) / 'mlflow.db').resolve()}"


def store_fix(recipe: Recipe) -> str:
    """How to point MLflow at another store: the variable that named this one, or the folder it is made in."""
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return "fix or unset MLFLOW_TRACKING_URI"
    return f"choose another {'train.tracking_dir' if recipe.train.tracking_dir else 'output_dir'}"


def experiment_name() -> str:
    return os.environ.get("MLFLOW_EXPERIMENT_NAME", "Default")


def deleted_experiment(name: str) -> RecipeError:
    # MLflow keeps a deleted experiment's name taken (its runs can be restored) and refuses new runs in it
    named = "(MLFLOW_EXPERIMENT_NAME)" if os.environ.get("MLFLOW_EXPERIMENT_NAME") else "(MLflow's default)"
    return RecipeError(f"train.report_to mlflow: the experiment {name!r} {named} is deleted in the store; restore "
                       "it (mlflow experiments restore) or set MLFLOW_EXPERIMENT_NAME to another name")


def numbers(record: dict) -> dict[str, float]:
    """What a tracker plots of a record: every number but the step itself (flags and nulls are not numbers)."""
    return {key: float(value) for key, value in record.items()
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)}


class TensorBoard:
    name = "tensorboard"

    def __init__(self, log_dir: Path, *, done_steps: int):
        from torch.utils.tensorboard import SummaryWriter

        # what this run makes: its files in its folder (which a resumed run had already), and tensorboard/ or
        # tracking_dir itself where they are new; a user's mistake removes them again (discard)
        self.log_dir, self.before = log_dir, entries(log_dir)
        self.new_parents = [path for path in (log_dir.parent, log_dir.parent.parent) if not path.exists()]
        # purge_step: a resumed run's events from the steps after its checkpoint (written before the stop,
        # run again now) are hidden, as metrics.jsonl drops those records
        try:
            self.writer = SummaryWriter(str(log_dir), purge_step=done_steps + 1)
        except OSError as exc:  # checked before the run (check_trackers); a folder that changed since
            raise RecipeError(f"train.report_to tensorboard: cannot write {log_dir} ({exc.strerror}); choose "
                              "another train.tracking_dir") from None
        quiet_writer_threads()

    def log_recipe(self, recipe: Recipe) -> None:
        text = "".join(f"    {line}\n" for line in dump_recipe(recipe).splitlines())  # a Markdown code block
        self.writer.add_text("recipe", text, global_step=0)

    def write(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()  # every step, like metrics.jsonl: a crash loses at most the step in flight

    def close(self, status: str) -> None:
        self.writer.close()

    def drop(self) -> None:
        with contextlib.suppress(Exception):  # closes the event file; its flush fails again, as the write did
            self.writer.close()

    def discard(self) -> None:
        remove_made(self.log_dir, before=self.before)
        for parent in self.new_parents:  # only if empty: another run sharing tracking_dir may write beside it
            with contextlib.suppress(OSError):
                parent.rmdir()


def quiet_writer_threads() -> None:
    """TensorBoard writes events in a thread of its own, which keeps a write's error for the next add_scalar or
    flush to raise (MetricsLog says it in one line) and also lets it end the thread, which Python prints as
    a traceback of its own. That print is left out, for TensorBoard's writer threads only."""
    previous = threading.excepthook
    if getattr(previous, "quiets_tensorboard", False):
        return

    def hook(args) -> None:
        if not type(args.thread).__module__.startswith("tensorboard.summary.writer"):
            previous(args)

    hook.quiets_tensorboard = True  # type: ignore[attr-defined]
    threading.excepthook = hook


class Mlflow:
    name = "mlflow"

    def __init__(self, client, run_id: str):
        self.client, self.run_id = client, run_id

    def log_recipe(self, recipe: Recipe) -> None:
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        params = [Param(key, value[:MAX_PARAM_VAL_LENGTH]) for key, value in flat_params(recipe_to_dict(recipe))]
        for start in range(0, len(params), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[start:start + MAX_PARAMS_TAGS_PER_BATCH])

    def write(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(key, value, now_ms, step) for key, value in values.items()])

    def close(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status=status)

    def drop(self) -> None:
        pass  # the run stays RUNNING in the store: a server that failed would be retried for minutes to mark it

    def discard(self) -> None:
        pass  # a run in a store, not files: it stays there, marked FAILED by close


def flat_params(tree: dict, prefix: str = "") -> list[tuple[str, str]]:
    """`optim.lr` -> "0.001": the recipe's leaves with dotted keys (as --set names them), values as YAML/JSON."""
    out = []
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out += flat_params(value, f"{prefix}{key}.")
        else:
            out.append((f"{prefix}{key}", value if isinstance(value, str) else json.dumps(value)))
    return out


def open_mlflow(recipe: Recipe, *, out_dir: Path, saved: dict, name: str | None = None) -> tuple[Mlflow, dict]:
    """A new run named after output_dir, or on resume the run tracking.json names (if its store still has it).
    A store that cannot be opened (a server that does not answer, a URI MLflow refuses, a file its SQL driver
    cannot read or make) is one line: the run stops before its first step, and rank 0 removes what the run had
    begun (toolkit.launch.rank). Any exception: MLflow passes its driver's (OSError, SQLAlchemy's) through unwrapped."""
    try:
        return _open_mlflow_run(recipe, out_dir=out_dir, saved=saved, name=name or run_name(recipe))
    except RecipeError:
        raise
    except Exception as exc:
        raise RecipeError(f"train.report_to mlflow: the store {mlflow_tracking_uri(recipe)} cannot be opened "
                          f"({type(exc).__name__}: {first_line(exc)}); {store_fix(recipe)}") from None


def _open_mlflow_run(recipe: Recipe, *, out_dir: Path, saved: dict, name: str) -> tuple[Mlflow, dict]:
    import logging

    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    for logger in ("mlflow", "alembic"):  # the SQL store's table creation says each migration at INFO
        logging.getLogger(logger).setLevel(logging.WARNING)
    uri = mlflow_tracking_uri(recipe)
    client = MlflowClient(tracking_uri=uri)
    run_id = saved.get("run_id") if saved.get("tracking_uri") == uri else None
    if run_id is not None:
        try:
            client.update_run(run_id, status="RUNNING")
            return Mlflow(client, run_id), {**saved, "continued": True}
        except MlflowException:  # the store no longer has it: a new run
            pass
    named = experiment_name()
    experiment = client.get_experiment_by_name(named)
    if experiment is not None and experiment.lifecycle_stage == "deleted":  # a server's store, too
        raise deleted_experiment(named)
    experiment_id = experiment.experiment_id if experiment else client.create_experiment(named)
    run = client.create_run(experiment_id, run_name=name, tags={"toolkit.output_dir": str(out_dir)})
    tracker = Mlflow(client, run.info.run_id)
    tracker.log_recipe(recipe)
    return tracker, {"tracking_uri": uri, "experiment_id": experiment_id, "run_id": run.info.run_id}


def open_trackers(recipe: Recipe, *, out_dir: Path, done_steps: int) -> list[Tracker]:
    """Rank 0: the trackers of train.report_to, opened (or continued on resume); tracking.json says where."""
    path = out_dir / TRACKING_FILE
    saved = json.loads(path.read_text()) if done_steps and path.is_file() else {}
    trackers: list[Tracker] = []
    where: dict[str, Any] = {}
    name = run_name(recipe)
    if "tensorboard" in recipe.train.report_to:
        log_dir = tensorboard_log_dir(recipe, saved=saved.get("tensorboard", {}))
        name = log_dir.name
        board = TensorBoard(log_dir, done_steps=done_steps)
        if not done_steps:
            board.log_recipe(recipe)
        trackers.append(board)
        where["tensorboard"] = {"log_dir": str(log_dir)}
        print(f"[toolkit] tensorboard: {log_dir} (view: tensorboard --logdir {log_dir.parent})", file=sys.stderr,
              flush=True)
    if "mlflow" in recipe.train.report_to:
        try:
            run, where["mlflow"] = open_mlflow(recipe, out_dir=out_dir, saved=saved.get("mlflow", {}), name=name)
        except RecipeError:  # its store cannot be used: the TensorBoard folder just begun goes too
            for tracker in trackers:
                tracker.close("FAILED")
                tracker.discard()
            raise
        trackers.append(run)
        what = "continued" if where["mlflow"].pop("continued", False) else "new"
        print(f"[toolkit] mlflow: run {run.run_id} ({what}) in {where['mlflow']['tracking_uri']}", file=sys.stderr,
              flush=True)
    if where:
        path.write_text(json.dumps(where, indent=2))
    return trackers


def tensorboard_log_dir(recipe: Recipe, *, saved: dict) -> Path:
    """A resumed run's own folder (tracking.json's, while tracking_dir is the same); else a fresh name."""
    root, leaf = tracking_root(recipe), run_name(recipe)
    if "log_dir" in saved:
        own = Path(saved["log_dir"])
        if own == tensorboard_dir(root, own.name):
            return own
    name = fresh_tensorboard_name(root, Path(recipe.output_dir))
    if name != leaf:
        print(f"[toolkit] tensorboard: {tensorboard_dir(root, leaf)} holds another run's events; this run is "
              f"{name}", file=sys.stderr, flush=True)
    return tensorboard_dir(root, name)


class MetricsLog:
    """Rank 0's destinations of each step's record: metrics.jsonl first, then every tracker.

    A tracker is a copy of metrics.jsonl for viewing: one that fails mid-run (its disk full, its store or
    server gone) is switched off with one warning line and the run goes on. It used to end the run with a
    traceback, and rank 0 leaving made every other rank fail too: hours of training lost to a plot. Those
    switched off are listed (`switched_off`, run.json's `trackers_switched_off`): a plot that stops at step N
    says why there too."""

    def __init__(self, jsonl: JsonlWriter, trackers: list[Tracker]):
        self.jsonl, self.trackers = jsonl, trackers
        self.switched_off: list[dict] = []

    def write(self, record: dict) -> None:
        self.jsonl.write(record)
        values = numbers(record)
        for tracker in list(self.trackers):
            try:
                tracker.write(record["step"], values)
            except Exception as exc:  # whatever its library raises (OSError, MlflowException, a driver's error)
                self.trackers.remove(tracker)
                tracker.drop()
                self.switched_off.append({"tracker": tracker.name, "step": record["step"],
                                          "error": f"{type(exc).__name__}: {first_line(exc)}"})
                self._warn(tracker, exc, when=f"at step {record['step']}", then="it is off for the rest of the run")

    def close(self, status: str) -> None:
        self.jsonl.close()
        for tracker in self.trackers:
            try:
                tracker.close(status)
            except Exception as exc:  # every step is in it already: the run's outcome stands
                self._warn(tracker, exc, when="when it was closed", then="it may show the run as still running")

    def _warn(self, tracker: Tracker, exc: Exception, *, when: str, then: str) -> None:
        print(f"[toolkit] warning: train.report_to {tracker.name} failed {when} ({type(exc).__name__}: "
              f"{first_line(exc)}); {then}, and {self.jsonl.path} has every step", file=sys.stderr, flush=True)


@contextlib.contextmanager
def metrics_log(recipe: Recipe, *, out_dir: Path, done_steps: int, main: bool) -> Iterator[MetricsLog | None]:
    """Rank 0: the metrics log, closed however the run ends (a tracker's run marked FINISHED, KILLED by a stop
    signal or Ctrl-C, else FAILED). Other ranks: None."""
    if not main:
        yield None
        return
    log = MetricsLog(JsonlWriter(out_dir / "metrics.jsonl", append=done_steps > 0),
                     open_trackers(recipe, out_dir=out_dir, done_steps=done_steps))
    status, mistake = "FAILED", False
    try:
        yield log
        status = "FINISHED"
    except (Stopped, KeyboardInterrupt):
        status = "KILLED"  # stopped after a checkpoint: --resume continues it
        raise
    except RecipeError:
        mistake = True
        raise
    finally:
        log.close(status)
        if mistake:  # what the run began in the trackers' folders goes, as in output_dir
            for tracker in log.trackers:
                tracker.discard()
