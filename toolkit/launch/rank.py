"""`toolkit train`: one rank of a run, and how it ends. A user's mistake, a stop signal, replica drift or a
non-finite loss is one line and its own exit code; a checkpoint that cannot be written is one line and exit 1;
a bug is its traceback; a rank that fails because another rank left says only that."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

from toolkit.errors import (INTERRUPTED_EXIT_CODE, NONFINITE_EXIT_CODE, REPLICA_DRIFT_EXIT_CODE, USER_ERROR_EXIT_CODE,
                            RecipeError, ctrl_c_seen, first_line, mark_failure_said, mark_final, say_once,
                            say_user_error)
from toolkit.process.cleanup import entries, make_folders, remove_empty, remove_made
from toolkit.process.folder_lock import FolderInUse, FolderLock, hold, in_use, run_in_use

if TYPE_CHECKING:
    from toolkit.checkpoint.run import Resume
    from toolkit.config.recipe import Recipe
    from toolkit.strategies.base import Strategy


def run_rank(recipe_path: str, overrides: list[str], resume: Resume | None) -> int:
    """`toolkit train`: this process's rank of the run, from the recipe (and, under `accelerate launch`, its
    plugin settings) to the exit code; every outcome a user causes is one line."""
    say_native_crashes()
    recipe, notes = rank_recipe(recipe_path, overrides, os.environ)
    if os.environ.get("RANK", "0") == "0":  # how a version-1 FSDP config runs on FSDP2, a line per key
        for note in notes:
            print(f"[toolkit] accelerate: {note}", file=sys.stderr, flush=True)
    quiet_libraries()
    from toolkit.process.dist import exit_process, init_distributed, peer_lost, shutdown

    env = init_distributed(deepspeed=_may_import_deepspeed(recipe.strategy.name))
    code, strategy = 1, None
    try:
        code, strategy = train_rank(recipe, env, resume)
    except KeyboardInterrupt:  # Ctrl-C outside the steps (inside them it is a stop signal: see loop)
        code = interrupted(recipe, env)
    except Exception as exc:  # a bug, not a user's mistake: the whole traceback, then the same end as any rank
        if ctrl_c_seen():  # a Ctrl-C that a library's lazy import turned into another error (note_ctrl_c)
            code = interrupted(recipe, env)
        elif peer_lost(exc, env):  # the consequence of another rank's failure, which that rank reports
            print(f"toolkit: rank {env.rank}: stopped, another rank left the run ({first_line(exc)})",
                  file=sys.stderr, flush=True)
        else:
            traceback.print_exc()
    finally:
        release = strategy.close if strategy is not None else None
        left_cleanly = shutdown(completed=code == 0, release=release)
    return exit_process(code if left_cleanly else 1)


def say_native_crashes() -> None:
    """A rank that dies of a native fault (SIGSEGV, SIGABRT from glibc's heap checks or std::terminate, SIGBUS,
    SIGFPE, SIGILL) prints where each of its Python threads was, on its stderr, before it dies of the same signal:
    the launcher's "rank N killed by SIGABRT" alone says neither which step nor which collective or kernel it was in.
    faulthandler's own handler, a few lines of C that need no GIL; the exit status is unchanged."""
    import faulthandler

    if not faulthandler.is_enabled():  # PYTHONFAULTHANDLER / -X faulthandler: the user's own setting stays
        faulthandler.enable(file=sys.stderr, all_threads=True)


def rank_recipe(recipe_path: str, overrides: list[str], environ) -> tuple[Recipe, list[str]]:
    """The recipe a rank of `toolkit train` runs, in the environment `environ`: the file with its overrides and,
    under `accelerate launch`, its plugin settings; with the lines that say what those settings replaced."""
    from toolkit.launch.accelerate_env import apply_launcher_settings, launcher_settings, named_source
    from toolkit.config.files import read_recipe_dict, recipe_from_dict

    raw = read_recipe_dict(recipe_path, overrides)
    settings = launcher_settings(environ)  # under `accelerate launch`: its plugin settings
    replaced = apply_launcher_settings(raw, settings)
    with named_source(settings):
        recipe = recipe_from_dict(raw)
        if any(s.key for s in settings):  # the strategy's checks too (train makes them again, cheaply)
            from toolkit.strategies import validate_strategy

            validate_strategy(recipe, world_size=int(environ.get("WORLD_SIZE", "1")))
    return recipe, [*replaced, *(s.note for s in settings if s.note)]


def _may_import_deepspeed(name: str) -> bool:
    """Whether a rank of strategy `name` may import DeepSpeed: one that runs on it (StrategyInfo.runtime_modules),
    or a name the toolkit does not know (its error comes later, from the strategy's checks)."""
    from toolkit.strategies import strategy_info, strategy_names

    return name not in strategy_names() or "deepspeed" in strategy_info(name).runtime_modules


def train_rank(recipe, env, resume) -> tuple[int, Strategy | None]:
    """Train this rank: (exit code, the strategy to release once every rank is done). A user's mistake or
    replica drift is one line and an exit code, not a traceback."""
    from toolkit.checkpoint.run import NothingToResume, after_restart
    from toolkit.checkpoint.store import CheckpointWriteError
    from toolkit.observe.consistency import ReplicaDriftError
    from toolkit.train.loop import train
    from toolkit.launch.launcher import RANKS_CHECK_ENV, resume_hint
    from toolkit.process.stopping import NonFinite, OutputWriteError, Stopped

    out_dir = Path(recipe.output_dir)
    before, lock, above = None, None, list[Path]()
    try:
        # first: a live run's folder is neither read as a finished run nor cleaned
        lock, before, above = hold_output_dir(out_dir, env)
        resume = after_restart(recipe, resume, env=env)  # a restart continues this launch's newest checkpoint
        if os.environ.get(RANKS_CHECK_ENV) == "1":  # `toolkit launch` on one machine left its checks to the ranks
            from toolkit.checkpoint.run import starting_point
            from toolkit.train.checks import check_recipe

            plan = check_recipe(recipe, world_size=env.world_size)
            # an existing run without --resume, or nothing to resume: said before the data is tokenized and a
            # checkpoint's bytes are hashed (train's own call, which follows, hashes them)
            starting_point(recipe, resume, plan=plan)
        result = train(recipe, env, resume=resume)
    except FolderInUse as exc:  # another run's folder: nothing of it is touched; rank 0 alone knows who holds it
        if str(exc):
            say_user_error(exc)
        else:
            mark_final(USER_ERROR_EXIT_CODE)
        return USER_ERROR_EXIT_CODE, None
    except RecipeError as exc:
        if env.is_main:
            remove_made(out_dir, before=before)  # nothing half-written for a user mistake
        if ctrl_c_seen():  # a Ctrl-C that a library's import turned into the error a check refuses
            return interrupted(recipe, env), None
        say_user_error(exc)  # the first rank that finds it prints the one line
        if not env.is_main:  # the first rank to exit gets the others stopped: rank 0 first removes what it made
            _let_rank_0_clean(out_dir)
        return USER_ERROR_EXIT_CODE, None
    except NothingToResume as done:  # every rank finds it alike: one line, nothing written
        say_once(str(done))
        return 0, None
    except ReplicaDriftError as exc:
        print(f"toolkit: replica drift: {exc}", file=sys.stderr)
        return REPLICA_DRIFT_EXIT_CODE, None
    except Stopped as stop:  # every rank stops after the same step; rank 0 says how to go on
        if env.is_main:
            what = (f"interrupted at step {stop.step} of {stop.total}; outputs so far in {out_dir}"
                    if stop.signum == signal.SIGINT else f"stopped by {stop}")
            print(f"toolkit: {what}; checkpoint {stop.checkpoint}; {resume_hint(env.world_size)}",
                  file=sys.stderr, flush=True)
        return 128 + stop.signum, None
    except NonFinite as exc:
        if env.is_main:
            print(f"toolkit: {nonfinite_line(exc, out_dir)}", file=sys.stderr, flush=True)
        mark_final(NONFINITE_EXIT_CODE)  # a restart would resume before the step and reach it again
        return NONFINITE_EXIT_CODE, None
    except (CheckpointWriteError, OutputWriteError) as exc:  # a full disk: a failed run (exit 1) in one line
        if env.is_main:  # every rank's failure is in rank 0's line (DCP gathers them)
            from toolkit.process import faults

            faults.before_failure_line()
            end = f"; {after_write_failure(out_dir, exc, env=env)}" if isinstance(exc, OutputWriteError) else ""
            if isinstance(exc, OutputWriteError) and exc.before_first_step:
                remove_made(out_dir, before=before)  # nothing trained: nothing of this run kept
            say_once(f"toolkit: {exc}{end}")
            mark_failure_said()  # the launcher adds no line of its own
        if isinstance(exc, OutputWriteError) or exc.on_every_rank:  # every rank has it: they leave once rank 0
            from toolkit.process.dist import barrier  # said it (the first rank to exit gets the others stopped)

            with contextlib.suppress(RuntimeError):  # a rank gone already: the launcher's line says which
                barrier(env)
        return 1, None
    finally:
        if lock is not None:  # every write of this rank's run is done
            lock.release()
            if before is None:  # a folder made for the lock and left empty (a crash before the first write) goes
                with contextlib.suppress(OSError, ValueError):  # ValueError: a NUL in the path (refused already)
                    out_dir.rmdir()
            remove_empty(above)  # and the folders its making made above it, where that left them empty
    return 0, result.strategy


def hold_output_dir(out_dir: Path, env) -> tuple[FolderLock | None, set[str] | None, list[Path]]:
    """Rank 0 holds output_dir while it trains (process/folder_lock.py), making the folder if the run is to make it;
    every rank learns whether it could, in one all-reduce. A restarted rank waits up to 30 s for its predecessor to
    be gone. Returns the lock and, on rank 0 (the one rank that removes what the run made: remove_made), what the
    folder held once it was held (`entries`; None where this run made it), and the folders above it its making
    made (removed at the end where left empty); (None, None, []) on the other ranks.
    FolderInUse where another run holds it: rank 0's names that run, the other ranks' is empty (rank 0 says it)."""
    import torch

    from toolkit.checkpoint.store import check_not_in_a_run
    from toolkit.process.dist import all_reduce_max, restarted

    lock, before, refused = None, None, None
    if env.is_main:
        made: list[Path] = []
        try:  # first: such a folder is neither made nor locked (nor, refused, removed as one this run made)
            check_not_in_a_run(out_dir, what="output_dir", fix="write this run elsewhere with --set output_dir=OTHER")
            made = make_folders(out_dir)
            lock = hold(out_dir, message=run_in_use(out_dir), wait_s=30 if restarted() else 0)
            # after any wait: what a predecessor wrote is not this run's
            before = None if made and made[-1] == out_dir else entries(out_dir)
        except RecipeError as exc:  # another run's folder or a part of one: nothing of it is touched
            refused = exc if isinstance(exc, FolderInUse) else FolderInUse(str(exc))
            remove_empty(made[::-1])  # what it made (`x` of x/../b, output_dir itself where it made it)
        above = [folder for folder in made[::-1] if folder != out_dir]
    if env.distributed and all_reduce_max(torch.tensor([float(refused is not None)]), env)[0] and refused is None:
        refused = FolderInUse("")
    if refused is not None:
        raise refused
    return lock, before, above if env.is_main else []


def _let_rank_0_clean(out_dir: Path, *, wait_s: float = 5.0) -> None:
    """A rank other than 0 that found a user's mistake waits (up to `wait_s`) for rank 0 to let go of output_dir,
    which it does once it removed what the run made there (the folder its lock made, at the least): an exit now
    would have torch's agent stop rank 0 before that. Rank 0 on another machine, or busy elsewhere (a mistake only
    this rank found): the wait ends, or the probe finds the folder free at once."""
    import time

    deadline = time.monotonic() + wait_s
    while in_use(out_dir) is not None and time.monotonic() < deadline:
        time.sleep(0.05)


def after_write_failure(out_dir: Path, exc, *, env) -> str:
    """What an OutputWriteError's line says after it: where the run stopped, the checkpoint that holds it and
    the command that continues it once the disk has room (or the file can be written)."""
    from toolkit.checkpoint.store import complete_checkpoints, step_of
    from toolkit.launch.launcher import resume_hint

    if exc.before_first_step:
        return "no step was trained; once the disk has room (or the folder can be written), run the same command again"
    found = complete_checkpoints(out_dir)
    stopped = f"the run stopped after step {exc.step}" if exc.step is not None else "every step was trained"
    if not found:
        return f"{stopped}, and no checkpoint holds its weights (checkpoint.final: true keeps one)"
    step = step_of(found[-1])
    again = f", from where a resume trains steps {step + 1}-{exc.last_step} again" \
        if exc.last_step is not None and step < exc.last_step else ""
    return (f"{stopped}; the newest checkpoint is {found[-1]} (step {step}){again}; once the disk has room (or "
            f"the file can be written), {resume_hint(env.world_size)}")


def nonfinite_line(exc, out_dir: Path) -> str:
    """What a NonFinite stop says: the step, and the newest checkpoint to go back to. Under on_nonfinite skip
    (exc.skipped_from), the weights every skipped step ran on are those of the step before the first: the
    checkpoint to go back to is one from before them."""
    from toolkit.checkpoint.store import complete_checkpoints, step_of

    found = complete_checkpoints(out_dir)
    if exc.skipped_from is None:
        where = f"the newest checkpoint is {found[-1]} (--resume)" if found else "no checkpoint was written yet"
        return (f"{exc}; the run stopped before any checkpoint could hold it; {where}; train.on_nonfinite=skip "
                "skips such steps")
    last_update = exc.skipped_from - 1
    before = [path for path in found if step_of(path) < last_update]
    where = f"the newest checkpoint from before them is {before[-1]} (--resume PATH)" if before else \
        "no checkpoint from before them was written"
    return (f"{exc}: no step updated the weights since step {last_update}, so its weights give non-finite values "
            f"on every batch and skipping cannot recover (train.max_consecutive_skips); {where}; a lower optim.lr "
            "or gradient clipping (optim.max_grad_norm) avoids such an update")


def interrupted(recipe=None, env=None) -> int:
    """Ctrl-C outside the training steps: one line (rank 0), no traceback. Further Ctrl-Cs (the launcher
    forwards the terminal's to every rank) are ignored: this process is on its way out already."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if (env.is_main if env is not None else os.environ.get("RANK", "0") == "0"):
        where = ""
        if recipe is not None:
            out_dir = Path(recipe.output_dir)
            where = f"; outputs so far in {out_dir}" if out_dir.is_dir() and any(out_dir.iterdir()) else \
                "; nothing was written"
            where += _resume_from_newest(out_dir, world_size=env.world_size if env is not None else 1)
        print(f"toolkit: interrupted{where}", file=sys.stderr, flush=True)
    return INTERRUPTED_EXIT_CODE


def _resume_from_newest(out_dir: Path, *, world_size: int) -> str:
    """'; the newest checkpoint is PATH (step N); resume with: COMMAND' where output_dir holds one (a Ctrl-C at
    the export, after the last step's checkpoint: --resume exports it), else ''."""
    from toolkit.checkpoint.store import complete_checkpoints, step_of
    from toolkit.launch.launcher import resume_hint

    found = complete_checkpoints(out_dir)
    return f"; the newest checkpoint is {found[-1]} (step {step_of(found[-1])}); {resume_hint(world_size)}" \
        if found else ""


def quiet_libraries() -> None:
    import warnings

    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed")
    # DTensor's hint that a 2-D mesh's reduction or gather runs as 2 collectives (an expert-parallel or fsdp × tp
    # weight's norm at clipping, its gather at export): a few scalars or one export, said on every rank each time
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
