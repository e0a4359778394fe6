"""User-facing errors: the CLI prints them as one line and exits 2."""

import contextlib
import errno
import hashlib
import os
import signal
import sys
import tempfile


class RecipeError(ValueError):
    """A mistake in what the user asked for (recipe, overrides, data, model path).

    The message names the problem and the fix. Raised anywhere; the CLI turns it
    into one line on stderr and exit code 2, and removes a half-made output dir.
    """


USER_ERROR_EXIT_CODE = 2
REPLICA_DRIFT_EXIT_CODE = 3  # replicas that should be equal are not (toolkit.observe.consistency); every rank says so
# a non-finite loss or gradient norm stopped the run (toolkit.process.stopping.NonFinite); rank 0 said where, in one line
NONFINITE_EXIT_CODE = 4
INTERRUPTED_EXIT_CODE = 128 + 2  # Ctrl-C (SIGINT), as shells report it


def error_line(exc: RecipeError) -> str:
    """The one line a user mistake is reported in. A line break in it (from a path or value the user gave) is
    shown escaped, as \\n, so that the message stays one line."""
    return "toolkit: error: " + str(exc).replace("\r", "\\r").replace("\n", "\\n")


def first_line(exc: BaseException) -> str:
    """An exception's first line (at most 200 characters, cut after a word and marked '…'), for a one-line
    report of a library's error."""
    text = str(exc).strip().splitlines()
    line = text[0] if text else type(exc).__name__
    if len(line) <= 200:
        return line
    cut = line[:199]
    return (cut[:cut.rfind(" ")] if " " in cut[100:] else cut).rstrip(" ,;:") + "…"


def os_error_text(exc: OSError) -> str:
    """An OSError as a user reads it: 'No space left on device (ENOSPC)'."""
    name = errno.errorcode.get(exc.errno, str(exc.errno)) if exc.errno else None
    return f"{exc.strerror or exc} ({name})" if name else str(exc.strerror or exc)


NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)  # a write the disk has no room (or no write) for


def no_room_line(exc: OSError) -> str:
    """The one line of a command that stopped on a full disk where nothing more particular says it (cli.py)."""
    where = f" to {exc.filename}" if exc.filename else ""
    return (f"toolkit: a file could not be written{where} ({os_error_text(exc)}); once the disk has room, run the "
            "command again")


def os_error_under(error: BaseException | None) -> OSError | None:
    """The OSError under `error` (a library's own exception raised from it): itself, its cause or its context,
    and so on; None where none has an errno."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError) and error.errno:
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def under_accelerate() -> bool:
    """Whether `accelerate launch` started this process: it exports ACCELERATE_MIXED_PRECISION to every process
    it starts, whatever its config file says."""
    return "ACCELERATE_MIXED_PRECISION" in os.environ


def ranks_option(count: int | str) -> str:
    """The option setting the number of ranks, for a message's fix, in the launcher the user ran: accelerate
    launch has no --nproc (its own is --num_processes, or num_processes in its config file)."""
    return f"--num_processes {count}" if under_accelerate() else f"--nproc {count}"


SAID_DIR_ENV = "TOOLKIT_SAID_DIR"  # where say_once's markers go (toolkit launch: a folder of its own)


def say_once(line: str) -> None:
    """Print `line` to stderr once per launch, whichever rank gets there first: a mistake in the recipe is found
    by every rank of a torchrun / accelerate launch alike. The first rank creates a marker file named for the
    launch (the launcher's process, the parent of its ranks on a node) and the line (O_EXCL: exactly one wins);
    outside a launch it just prints. One rank too: `--max-restarts` restarts the ranks whatever their exit code
    (torch's elastic agent has no policy by exit code), and under plain torchrun each attempt finds the same
    mistake again (under `toolkit launch` a restart ends at once: end_restart_after_final_stop). Under
    `toolkit launch` the marker goes in a folder the launcher removes when the ranks are done (SAID_DIR_ENV);
    under another launcher, in the temporary folder."""
    launch = os.environ.get("TORCHELASTIC_RUN_ID")
    if launch is None:
        print(line, file=sys.stderr, flush=True)
        return
    key = f"{launch}:{os.environ.get('MASTER_PORT')}:{os.getppid()}:{line}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:24]
    try:
        folder = os.environ.get(SAID_DIR_ENV) or tempfile.gettempdir()
        os.close(os.open(os.path.join(folder, f"toolkit-said-{digest}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    except OSError:  # no marker can be made (the folder is gone): said again rather than not at all
        pass
    print(line, file=sys.stderr, flush=True)


# in SAID_DIR_ENV: a rank of this launch ended so that a restart would end the same way (same recipe, data, seed
# and checkpoint): a user's mistake, or a non-finite loss the resumed run reaches again
FINAL_MARKS = {USER_ERROR_EXIT_CODE: "toolkit-user-error", NONFINITE_EXIT_CODE: "toolkit-nonfinite"}


def say_user_error(exc: RecipeError) -> None:
    """A user's mistake found in a process: its one line, once per launch (say_once), and the launch's mark that
    ends the restarts that would find it again (mark_final)."""
    say_once(error_line(exc))
    mark_final(USER_ERROR_EXIT_CODE)


def mark_final(code: int) -> None:
    """In a rank of `toolkit launch`: a mark in the launch's folder that the run ended with `code` (a key of
    FINAL_MARKS), which ends the restarts that would end so again (end_restart_after_final_stop)."""
    _mark_launch(FINAL_MARKS[code])


def mark_failure_said() -> None:
    """In the rank of `toolkit launch` that said in one line why the run failed (a checkpoint that cannot be
    written: exit 1, as a crash): a mark named for this process, so that the launcher does not add its own
    "launch failed" line under it (failure_said). Named for the process, not the launch: a restarted rank that
    then crashes gets the launcher's line."""
    _mark_launch(_failure_said_mark(os.getpid()))


def failure_said(pid: int) -> bool:
    """In the launcher, while its ranks' folder exists: whether the rank process `pid` marked its failure said."""
    folder = os.environ.get(SAID_DIR_ENV)
    return folder is not None and os.path.exists(os.path.join(folder, _failure_said_mark(pid)))


def _failure_said_mark(pid: int) -> str:
    return f"toolkit-failure-said-{pid}"


def _mark_launch(name: str) -> None:
    """In a rank of `toolkit launch`: an empty file `name` in the launch's folder, which its launcher reads."""
    folder = os.environ.get(SAID_DIR_ENV)
    if folder and "TORCHELASTIC_RUN_ID" in os.environ:
        with contextlib.suppress(OSError):  # the folder is gone: the launch is ending anyway
            os.close(os.open(os.path.join(folder, name), os.O_CREAT | os.O_WRONLY))


def end_restart_after_final_stop() -> None:
    """First thing in a rank: a rank that torch's agent restarted (--max-restarts, which restarts whatever the
    exit code) after a rank of the same launch stopped on a user's mistake, or on a non-finite loss, exits with
    that code at once. The recipe, data and seed are the same, and the restart resumes the same checkpoint, so
    the attempt would load the model and data to end the same way; the one line is said already, and the launch
    ends with it (launch._run_ranks) in seconds instead of R full starts."""
    folder = os.environ.get(SAID_DIR_ENV)
    if not folder or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        return
    for code, mark in FINAL_MARKS.items():
        if os.path.exists(os.path.join(folder, mark)):
            raise SystemExit(code)


_ctrl_c = {"seen": False}


def note_ctrl_c() -> None:
    """From a command's start: Ctrl-C raises KeyboardInterrupt as Python's own handler does, and is remembered.
    Raised inside a library's lazy import, KeyboardInterrupt can come out as another exception (transformers'
    lazy module reports a ModuleNotFoundError for the class it was importing, numpy a RecursionError): after a
    Ctrl-C such an error is the interrupt, said as one (ctrl_c_seen), not a bug's traceback. The training
    steps install their own handler (StopSignals) and give this one back."""
    _ctrl_c["seen"] = False  # a command's own: not an earlier one's in the same process (a notebook)
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:  # a caller's own handler stays
        return

    def note(signum, frame) -> None:
        _ctrl_c["seen"] = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, note)


def ctrl_c_seen() -> bool:
    return _ctrl_c["seen"]
