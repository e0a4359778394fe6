"""train.report_to checked before any rank starts: its trackers' packages are installed, their stores can open."""

from __future__ import annotations

import contextlib
import importlib.util
import os
from pathlib import Path

from toolkit.config.recipe import Recipe
from toolkit.errors import RecipeError
from toolkit.observe.tracking import deleted_experiment, experiment_name, mlflow_tracking_uri, store_fix, tracking_root


def required_packages(recipe: Recipe) -> dict[str, str]:
    """module -> pip package, for every tracker train.report_to names."""
    needed = {}
    if "tensorboard" in recipe.train.report_to:
        needed["tensorboard"] = "tensorboard"
    if "mlflow" in recipe.train.report_to:
        needed["mlflow"] = "mlflow-skinny"  # the client and stores, without the server and UI
        if mlflow_tracking_uri(recipe).startswith("sqlite:"):
            needed |= {"sqlalchemy": "sqlalchemy", "alembic": "alembic"}  # MLflow's SQL store
    return needed


def check_installed(recipe: Recipe) -> None:
    """Every package the recipe's trackers need can be imported: else one line naming the pip install."""
    missing = [pip for module, pip in required_packages(recipe).items() if importlib.util.find_spec(module) is None]
    if missing:
        raise RecipeError(f"train.report_to {', '.join(recipe.train.report_to)} needs packages that are not "
                          f"installed: pip install {' '.join(missing)}")


def check_trackers(recipe: Recipe) -> None:
    """Before any rank starts (and again on each rank, for torchrun/accelerate): the trackers of train.report_to
    can open where they will write. A tracker that fails only once the run has started leaves a traceback and
    a run folder behind."""
    if not recipe.train.report_to:
        return
    check_installed(recipe)
    from toolkit.checkpoint.store import check_creatable

    what = "train.tracking_dir" if recipe.train.tracking_dir else "output_dir"
    check_creatable(tracking_root(recipe) / "tensorboard", what=what)  # a file there: SummaryWriter's traceback
    if "mlflow" in recipe.train.report_to:
        uri = mlflow_tracking_uri(recipe)
        check_mlflow_store(uri)
        check_sqlite_store(uri, fix=store_fix(recipe))
        check_sqlite_experiment(uri, experiment_name())


def sqlite_path(uri: str) -> Path | None:
    """The database file of a sqlite: URI (SQLAlchemy's reading of it); None for another store or in memory."""
    if not uri.startswith("sqlite:"):
        return None
    from sqlalchemy.engine import make_url

    database = make_url(uri).database
    return None if database in (None, "", ":memory:") else Path(database)


SQLITE_HEADER = b"SQLite format 3\x00"  # the first 16 bytes of every SQLite database file


def check_sqlite_store(uri: str, *, fix: str) -> None:
    """A sqlite: store MLflow can open: its folder can be made (MLflow makes it) and its file, if there, is a
    SQLite database. Checked on the file itself, without opening the store: MLflow would create its tables (or
    migrate them), seconds of writing for a check. Without this the error came from the SQL driver mid-run."""
    from toolkit.checkpoint.store import check_creatable

    path = sqlite_path(uri)
    if path is None:
        return
    what = "its folder"
    try:
        check_creatable(path.parent, what=what)
    except RecipeError as exc:  # check_creatable's line less its own fix (another folder), which is not ours
        reason = str(exc).removesuffix(f"; choose another {what}")
        raise RecipeError(f"train.report_to mlflow: the store {uri} cannot be made: {reason}; {fix}") from None
    if path.is_dir():
        raise RecipeError(f"train.report_to mlflow: the store {uri} is a folder, not a SQLite file; {fix}")
    if path.is_file() and path.stat().st_size > 0:  # an empty file is an empty database to SQLite
        with path.open("rb") as head:
            if head.read(len(SQLITE_HEADER)) != SQLITE_HEADER:
                raise RecipeError(f"train.report_to mlflow: the store {uri} is not a SQLite database file; {fix}")


def check_mlflow_store(uri: str) -> None:
    """MLflow refuses its file store (a file: URI or a plain path, e.g. ./mlruns), which it keeps in maintenance
    mode, unless MLFLOW_ALLOW_FILE_STORE is true (mlflow/store/tracking/file_store.py): refused here in one line."""
    from mlflow.environment_variables import MLFLOW_ALLOW_FILE_STORE
    from mlflow.utils.uri import get_uri_scheme

    if get_uri_scheme(uri) not in ("", "file"):  # the schemes MLflow opens its file store for
        return

    try:
        allowed = MLFLOW_ALLOW_FILE_STORE.get()
    except ValueError:  # MLflow's own reading: true, false, 1 or 0
        raise RecipeError(f"MLFLOW_ALLOW_FILE_STORE={os.environ.get('MLFLOW_ALLOW_FILE_STORE')!r} is not true, "
                          "false, 1 or 0; set it to one of those") from None
    if not allowed:
        raise RecipeError(f"MLFLOW_TRACKING_URI={uri} is MLflow's file store, which MLflow refuses (maintenance "
                          "mode); point it at a SQLite file (sqlite:///PATH/mlflow.db) or a server, unset it for "
                          "<tracking_dir>/mlflow.db, or set MLFLOW_ALLOW_FILE_STORE=true to write the file store")


def check_sqlite_experiment(uri: str, name: str) -> None:
    """A sqlite: store's experiment of that name is not deleted: read from the file, read-only (the store's
    own client would create or migrate its tables). A file MLflow has not made its tables in yet says nothing."""
    import sqlite3

    path = sqlite_path(uri)
    if path is None or not path.is_file():
        return
    try:
        with contextlib.closing(sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)) as db:
            row = db.execute("SELECT lifecycle_stage FROM experiments WHERE name = ?", (name,)).fetchone()
    except sqlite3.Error:  # no such table yet, a locked file: MLflow's own open says it
        return
    if row is not None and row[0] == "deleted":
        raise deleted_experiment(name)
