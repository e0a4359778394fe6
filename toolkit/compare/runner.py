"""Runs each arm as `toolkit launch` does (its own ranks, its own output dir). A failed arm is
recorded with its error and the others go on; a re-run skips the arms already completed with the same
settings, and refuses a folder whose completed arms ran with others."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

import yaml

from toolkit.checkpoint.store import read_run_info
from toolkit.compare.experiment import RECORD_GRADIENT_SCALE, Arm, Experiment
from toolkit.compare.verdict import flatten
from toolkit.config.files import load_recipe, path_keys, recipe_to_dict
from toolkit.errors import INTERRUPTED_EXIT_CODE as INTERRUPTED, USER_ERROR_EXIT_CODE, RecipeError, error_line
from toolkit.observe.metrics import read_record
from toolkit.observe.tracking import tensorboard_dir
from toolkit.process import folder_lock

TAIL_LINES = 15


def arm_dir(experiment: Experiment, arm: Arm) -> Path:
    return experiment.out_dir / arm.name


def arm_status(path: Path) -> str:
    """completed | damaged | failed | pending, read from what the arm left on disk (a damaged run.json: pending;
    a completed run whose metrics.jsonl or recipe.yaml cannot be read: damaged; either runs again in a re-run
    compare)."""
    if (read_run_info(path) or {}).get("status") == "completed" and (path / "model").is_dir():
        return "completed" if arm_damage(path) is None else "damaged"
    return "failed" if (path / "failed.json").is_file() else "pending"


def earlier_attempt(path: Path, status: str) -> str | None:
    """What an arm's folder holds from an earlier attempt a re-run does not reuse (an arm stopped by Ctrl-C, with
    its checkpoint; a failed or damaged one), in words; None where it holds no run."""
    info = read_run_info(path)
    if info is None:
        return "the earlier failed attempt here" if status == "failed" else None
    ended = info.get("ended") or {}
    if status == "damaged":
        return "the earlier run here (completed, its files damaged)"
    if ended.get("steps_done") is not None:
        kept = f", checkpoint {ended['checkpoint']}" if ended.get("checkpoint") else ""
        return (f"the earlier attempt here ({info.get('status')} after step {ended['steps_done']} of "
                f"{info.get('total_steps')}{kept})")
    if info.get("status") == "running":  # its process was killed outright: nothing wrote how it ended
        return "the earlier attempt here (killed: its run.json still says running)"
    return f"the earlier attempt here ({info.get('status')})"


def arm_damage(path: Path) -> str | None:
    """What is wrong with a completed arm's files the report reads, naming the file; None where nothing is."""
    records, damage = read_metrics(path)
    total = (read_run_info(path) or {}).get("total_steps")
    last = max((r["step"] for r in records if isinstance(r.get("step"), int)), default=0)
    if damage is None and isinstance(total, int) and last < total:
        # cut at a line's end (a copy stopped short, a file trimmed by hand): its last loss was read as the run's.
        # A step missing in the middle is not this: a record a full disk kept from being written (docs/checkpoints.md)
        damage = f"{path / 'metrics.jsonl'} ends at step {last} of the run's {total} (cut short?)"
    if damage is None and read_arm_recipe(path) is None:
        damage = f"{path / 'recipe.yaml'} cannot be read"
    return damage


def read_arm_recipe(path: Path) -> dict | None:
    """The arm's resolved recipe (recipe.yaml, written by its run), or None where it is missing or not a mapping."""
    try:
        recipe = yaml.safe_load((path / "recipe.yaml").read_text(encoding="utf-8"))
    except (OSError, ValueError, yaml.YAMLError):
        return None
    return recipe if isinstance(recipe, dict) else None


def read_json_file(path: Path) -> dict:
    """A small JSON file the runner wrote beside an arm (arm.json, failed.json), or {} where it is missing or
    damaged: what it holds is shown, not needed."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


STEP_KEYS = ("loss", "grad_norm", "step_time_s", "tokens_per_s", "samples_per_s")  # what the report reads per step


def read_metrics(path: Path) -> tuple[list[dict], str | None]:
    """The arm's metrics.jsonl, one record per optimizer step, and None; or what is wrong with it, naming the file
    (emptied, cut short mid-line, written by hand), and no records."""
    file = path / "metrics.jsonl"
    try:
        lines = [line for line in file.read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, ValueError) as exc:  # missing, or not UTF-8
        return [], f"{file} cannot be read ({type(exc).__name__})"
    records = []
    for number, line in enumerate(lines, start=1):
        try:
            record = read_record(line)  # NaN and ±inf back where the loop wrote null
        except ValueError:
            return [], f"{file} line {number} is no JSON (cut short?)"
        if not isinstance(record, dict) or not all(key in record for key in STEP_KEYS):
            return [], f"{file} line {number} is no step record ({', '.join(STEP_KEYS)})"
        wrong = next((key for key in (*STEP_KEYS, "step") if key in record and (
            isinstance(record[key], bool) or not isinstance(record[key], (int, float)))), None)
        if wrong is not None:  # written by hand: the verdict's arithmetic was a TypeError
            return [], f"{file} line {number}: {wrong} is {record[wrong]!r}, not a number"
        records.append(record)
    return (records, None) if records else ([], f"{file} holds no step")




def check_reusable(experiment: Experiment) -> None:
    """An arm completed in the experiment folder is reused only when it ran with the settings this experiment
    gives it (recipe, overrides, ranks): else its numbers would be reported as this experiment's. Checked for
    every arm before anything runs or is written; a difference is one line naming the setting."""
    for arm in experiment.arms:
        path = arm_dir(experiment, arm)
        difference = settings_difference(experiment, arm, path) if arm_status(path) == "completed" else None
        if difference:
            raise RecipeError(f"{experiment.out_dir} holds arm {arm.name} run with other settings ({difference}); "
                              f"pass a new --output, or remove {experiment.out_dir} to run the experiment afresh")


WHERE_KEYS = ("output_dir", "train.tracking_dir")  # where an arm writes (see run_arm), not what it computes


def settings_difference(experiment: Experiment, arm: Arm, path: Path) -> str | None:
    """How the completed run in `path` differs from `arm` in this experiment, in words; None when it does not."""
    recipe = read_arm_recipe(path)
    if recipe is None:
        return "its recipe.yaml is missing"
    ran = flatten(recipe)
    # a run saved before paths were expanded when the recipe is built holds `~/...` where the recipe now gives
    # the home folder's path: the same file
    ran.update({key: os.path.expanduser(ran[key]) for key in path_keys() if isinstance(ran.get(key), str)})
    wanted = flatten(recipe_to_dict(load_recipe(experiment.recipe, [*experiment.common, *arm.overrides])))
    # a key the toolkit did not have when the arm ran: its default now is what that run computed
    ran.update({key: value for key, value in wanted.items() if key not in ran and _is_default(key, value)})
    if wanted.get("strategy.split_by") == "time" and wanted.get("strategy.block_time_ratio") is None:
        wanted["strategy.block_time_ratio"] = ran.get("strategy.block_time_ratio")  # what the run measured
    changed = [_difference(experiment, key, ran.get(key), wanted.get(key)) for key in sorted(set(ran) | set(wanted))
               if key not in WHERE_KEYS and ran.get(key) != wanted.get(key)]
    world_size = (read_run_info(path) or {}).get("world_size")
    if world_size != arm.nproc:
        changed.append(f"ranks: {world_size} then, {arm.nproc} now")
    if not changed:
        return None
    return ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")


def _is_default(key: str, value) -> bool:
    """Whether a recipe's `section.key` holds the value a recipe that leaves it out gets (its dataclass default)."""
    import dataclasses
    import typing

    from toolkit.config.recipe import Recipe

    section, _, name = key.partition(".")
    kind = typing.get_type_hints(Recipe).get(section)
    fields = {f.name: f for f in dataclasses.fields(kind)} if dataclasses.is_dataclass(kind) else {}
    field = fields.get(name)
    if field is None or field.default is dataclasses.MISSING:
        return False
    default = field.default
    return value == (list(default) if isinstance(default, tuple) else default)


def _difference(experiment: Experiment, key: str, then, now) -> str:
    if key == RECORD_GRADIENT_SCALE:  # set by compare on the first arm only: the arms' order changed
        return (f"the reference (first) arm then, {experiment.arms[0].name} is now" if then
                else "not the reference (first) arm then, the reference now")
    return f"{key}: {then!r} then, {now!r} now"


# toolkit/launch/launcher.py's words when a rank exits non-zero: a summary of exit codes pointing at the ranks' lines
LAUNCH_FAILED = "toolkit: launch failed"
SEE_ABOVE = " (see the rank output above)"


def check_arm_free(experiment: Experiment, arm: Arm) -> None:
    """Before an arm's folder is replaced: no process holds it. This compare holds the experiment folder, so a
    holder is a run typed into the arm's folder by hand, whose files the arm's fresh start would delete."""
    out = arm_dir(experiment, arm)
    folders = [out, *(Path(top) / name for top, names, _ in os.walk(out) for name in names
                      if not os.path.islink(Path(top) / name))] if out.is_dir() else []  # a link: only unlinked
    for folder in folders:  # the arm's folder, or one in it (EXP/ARM/sub: a run typed there before the arm ran)
        who = folder_lock.in_use(folder)
        if who is not None:
            raise RecipeError(f"arm {arm.name}'s folder {out} is being written by a run that is not this compare's "
                              f"({who}{'' if folder == out else f', in {folder}'}); let it end or stop it, or run "
                              "the experiment elsewhere with --output OTHER")


def run_arm(experiment: Experiment, arm: Arm) -> str:
    out = arm_dir(experiment, arm)
    # trackers (train.report_to) write into the experiment folder, each arm a run named after it: one
    # `tensorboard --logdir <experiment>/tensorboard` overlays the arms' curves. Without trackers the recipe
    # refuses train.tracking_dir (nothing reads it)
    tracked = load_recipe(experiment.recipe, [*experiment.common, *arm.overrides]).train.report_to
    where = (f"output_dir={out}", *([f"train.tracking_dir={experiment.out_dir}"] if tracked else []))
    shutil.rmtree(out, ignore_errors=True)  # what an earlier, unfinished attempt left: the arm runs afresh
    shutil.rmtree(tensorboard_dir(experiment.out_dir, out.name), ignore_errors=True)  # and its curves
    out.mkdir(parents=True)
    start = time.perf_counter()
    code = _run_launcher(experiment.recipe, [*experiment.common, *arm.overrides, *where], nproc=arm.nproc,
                         log=out / "launch.log")
    if code == INTERRUPTED:
        return "interrupted"
    if code == 0 and arm_status(out) == "completed":
        (out / "arm.json").write_text(json.dumps({"wall_s": time.perf_counter() - start}))  # its cost, in the report
        return "completed"
    lines = (out / "launch.log").read_text(errors="replace").strip().splitlines()
    (out / "failed.json").write_text(json.dumps({"exit_code": code, "error": failure_line(lines),
                                                 "log_tail": lines[-TAIL_LINES:],
                                                 "wall_s": time.perf_counter() - start}, indent=2))
    return "failed"


def failure_line(lines: list[str]) -> str:
    """Why an arm failed, from its launch.log: the ranks' own one line (`toolkit: error: ...`, `toolkit: non-finite
    loss (nan) at step 2; ...`), not the launcher's summary of their exit codes, which points at output a report
    does not hold; else the last line that says error, else the last line."""
    said = [line.strip() for line in lines if line.startswith("toolkit: ") and not line.startswith(LAUNCH_FAILED)]
    # a rank killed outright (SIGKILL: the out-of-memory killer) says nothing itself: the others' line is what its
    # end did to them ("another rank left the run"); the launcher's summary names it, first
    summary = next((line for line in reversed(lines) if line.startswith(LAUNCH_FAILED)), "")
    killed = re.findall(r"rank \d+ killed by (?:SIG\w+|signal \d+)", summary)
    if said and killed:
        return f"{'; '.join(killed)}; then {said[-1]}"
    if said:
        return said[-1]
    error = next((line for line in reversed(lines) if "error" in line.lower() and line.strip()),
                 lines[-1] if lines else "")
    return error.strip().replace(SEE_ABOVE, "")


def _run_launcher(recipe_path: str, overrides: list[str], *, nproc: int, log: Path) -> int:
    """The arm's `toolkit launch`, run in this process (its checks, then torch's agent, whose ranks are processes
    of their own), what it and its ranks print written to `log`. A new `toolkit launch` process per arm cost
    ~4.5 s of imports and checks before its ranks started (13 s instead of 8.5 s for a 2-step arm of the tiny
    Llama). Returns the exit code, INTERRUPTED when a stop signal ended it. The agent forwards what this process
    gets to the ranks, as under `toolkit launch`: after Ctrl-C (which a terminal sends them too) and SIGTERM they
    stop after their step; a hang-up (the terminal or ssh session gone) ends them. The arm runs afresh in a
    re-run either way."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from toolkit.launch.launcher import launch_recipe

    # until torch's agent takes them over (and after it gives them back), SIGTERM and a hang-up stop the arm as
    # Ctrl-C does
    previous = {signum: signal.signal(signum, _interrupt) for signum in (signal.SIGTERM, signal.SIGHUP)}
    try:
        with _output_to(log):
            try:
                code = launch_recipe(recipe_path, overrides, nproc=nproc)
            except RecipeError as exc:  # the arm's own mistake: its one line in its log, as its launch says it
                print(error_line(exc), file=sys.stderr, flush=True)
                code = USER_ERROR_EXIT_CODE
            except SignalException:  # a stop signal around torch's agent (see below)
                raise
            except Exception:  # noqa: BLE001 - a failure of this arm's launch fails the arm, not the experiment
                traceback.print_exc()
                code = 1
    except (KeyboardInterrupt, SignalException):
        return INTERRUPTED
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
    return INTERRUPTED if code in STOPPED else code


STOPPED = {128 + int(signum) for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}  # launch's exit codes


@contextlib.contextmanager
def _output_to(path: Path) -> Iterator[None]:
    """This process's stdout and stderr (the file descriptors, which the ranks inherit, and sys.stdout/stderr)
    written to `path` inside, given back after."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "w", buffering=1) as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                yield
        finally:
            log.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


class Interrupted(Exception):
    """Ctrl-C stopped the experiment during arm `arm`; `completed` lists the arms whose runs are kept."""

    def __init__(self, arm: str, completed: list[str]):
        super().__init__(arm)
        self.arm, self.completed = arm, completed


def run_experiment(experiment: Experiment, *, log=print) -> dict[str, str]:
    check_reusable(experiment)
    experiment.save()
    statuses: dict[str, str] = {}
    for index, arm in enumerate(experiment.arms, start=1):
        status = arm_status(arm_dir(experiment, arm))
        if status == "completed":
            log(f"[compare] {index}/{len(experiment.arms)} {arm.name}: already completed, skipped")
        else:
            check_arm_free(experiment, arm)
            earlier = earlier_attempt(arm_dir(experiment, arm), status)
            if earlier:
                log(f"[compare] {index}/{len(experiment.arms)} {arm.name}: {earlier} is replaced: the arm runs "
                    "afresh, so that its numbers come from one uninterrupted run")
            log(f"[compare] {index}/{len(experiment.arms)} {arm.name}: running on {arm.nproc} rank(s)...")
            start = time.perf_counter()
            status = run_arm(experiment, arm)
            if status == "interrupted":
                raise Interrupted(arm.name, [name for name, done in statuses.items() if done == "completed"])
            log(f"[compare] {index}/{len(experiment.arms)} {arm.name}: {status} "
                f"({time.perf_counter() - start:.0f} s, log {arm_dir(experiment, arm) / 'launch.log'})")
        statuses[arm.name] = status
    return statuses
