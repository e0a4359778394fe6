"""Toolkit processes forked from one that imported the toolkit once, for the tests' launches (conftest's
run_cli and run_torchrun): a plain `python -m toolkit` spends ~3 s importing torch, transformers and the
toolkit before it trains a tiny model for a second or two, and the suite starts over 300 of them. Measured
here: a 2-rank ddp run of the tiny Llama through torchrun 7.0-7.5 s plain, 4.1-4.6 s forked; the suite
25:04 -> 17:46 min.

    python tests/forked_ranks.py serve SOCKET      the server: imports what every rank imports, then serves
    python [-u] tests/forked_ranks.py ARGS...      the client: `python [-u] -m toolkit ARGS`, run in a fork of
                                                   the server (or exec'd as it is, below)

What torchrun (or run_cli) starts is the client, with SOCKET in FORKED_RANKS_ENV. It hands the server its
arguments, folder, environment and standard streams (SCM_RIGHTS); the server forks a supervisor, which forks
the process: `python -m toolkit ARGS` as the interpreter runs it (runpy, `__main__`, sys.path[0] the folder),
in that folder, with that environment and those streams, in a session of its own (torch's agent starts ranks
with start_new_session). The client stays where torchrun sees its rank: it forwards every signal the agent
sends (SIGTERM to its process group, SIGINT, ...) to the process, follows the agent as a plain rank does (a
SIGTERM when it dies, toolkit.process.orphans) and ends as the process ended, with its exit code or by its signal. A
client killed outright (SIGKILL, a test's timeout) closes its socket, and the supervisor then kills the process
with SIGKILL. Numbers are those of a plain process: a 2-rank ddp run's losses, peak RSS (662.0 vs 661.8 MB)
and the plan's runtime bytes (505.2 vs 504.9 MB) alike (but for transformers' table of checkpoint key
conversions, 1.4 MiB, which the server builds and a plain rank builds as its model loads: a forked rank's
runtime holds it). What stays the server's: the hash seed of str keys
(every forked process shares one, where plain ones each draw their own: an order of a set of names that
differed between ranks would not show here; it would in the plain ranks of `toolkit launch` and compare),
umask, rlimits and CPU affinity, and objects the imports made are never collected (gc.freeze).

The ranks of a strategy that runs on DeepSpeed are forked from a second server (_serve_deepspeed), a fork of
the first that imported what such a rank imports before it measures its runtime, beside the toolkit (~45 % of a
2-rank ZeRO run's CPU time).

What a fork cannot give is exec'd instead: a client whose environment differs from the server's (with the
toolkit's own defaults, which every process adds) in a variable that C libraries or Python may read as the
process starts (anything but the launch's per-rank variables, the toolkit's TOOLKIT_* and pytest's, which are
read when used) runs `python -m toolkit ARGS` itself, as does one that finds no server; the server lists each
in SOCKET.exec-log and the test session's summary counts them. The tests of how ranks start, stop, exit or
die start theirs themselves (Popen of `python -m toolkit`, plain torchrun: test_clean_exit,
test_launch_robustness, test_first_hour, test_multinode). What a forked process starts in turn is forked too:
a `python [-u] -m toolkit ARGS` that inherits FORKED_RANKS_ENV (the ranks of `toolkit launch` and of a compare's
arms, a benchmark's runs) becomes a client as it starts, through tests/forking/sitecustomize.py, and runs plain
where the server refuses it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import struct
import sys

from toolkit.errors import SAID_DIR_ENV, _failure_said_mark
from toolkit.process.orphans import _set_parent_death_signal  # prctl(PR_SET_PDEATHSIG) through libc, as a rank asks

FORKED_RANKS_ENV = "TOOLKIT_TEST_RANK_SERVER"
# set per rank by torch's agent, per launch by the tests or per test by pytest (PYTEST_CURRENT_TEST), and read
# only when used: a difference in these between a client and the server does not stop the fork
RUNTIME_PREFIXES = ("TORCHELASTIC_", "TOOLKIT_", "TORCH_NCCL_", "NCCL_", "PYTEST_")
RUNTIME_NAMES = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "OMP_NUM_THREADS",  # the rank sets its threads from it (torch.set_num_threads)
                 # read by Intel's OpenMP as it loads (torch's CPU build links GNU's) and by inductor's C++
                 # builder when it compiles; scikit-learn sets it as it is imported (in the tests' process)
                 "KMP_DUPLICATE_LIB_OK",
                 # set by `import deepspeed` (in the tests' process once a test imported it; the server does not),
                 # read by torch.cuda.is_available at each call, not as torch loads
                 "PYTORCH_NVML_BASED_CUDA_CHECK",
                 # set by `import mlflow` (DeepSpeed imports it; so do the tracking tests), read by its telemetry
                 "_MLFLOW_TELEMETRY_SESSION_ID",
                 "PYTHONUNBUFFERED", "PWD", "OLDPWD", "SHLVL", "_"}
_SERVER_ENV: dict[str, str] = {}  # the server's environment once it imported: what a client's is set against
_DEFAULTS: dict[str, str] = {}  # what the toolkit's settings and the imports added to it (a rank adds the same)
_LOG = [""]  # the server's list of the processes it did not fork, and why: SOCKET.exec-log
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def _runtime(name: str) -> bool:
    return name in RUNTIME_NAMES or name.startswith(RUNTIME_PREFIXES)


def _send(conn: socket.socket, message: dict, fds: tuple[int, ...] = ()) -> None:
    data = json.dumps(message).encode()
    payload = struct.pack("!I", len(data)) + data
    sent = socket.send_fds(conn, [payload], list(fds)) if fds else 0
    conn.sendall(payload[sent:])


class _Messages:
    """The length-prefixed messages of one connection, in order: bytes read past one are kept for the next."""

    def __init__(self, conn: socket.socket):
        self.conn, self.buffer, self.fds = conn, b"", []

    def next(self, *, max_fds: int = 0) -> dict | None:
        """The next message; None when the peer closed (or reset) the connection first."""
        try:
            while len(self.buffer) < 4 or len(self.buffer) < 4 + struct.unpack("!I", self.buffer[:4])[0]:
                chunk, fds, _, _ = socket.recv_fds(self.conn, 1 << 16, max_fds) if max_fds else \
                    (self.conn.recv(1 << 16), [], 0, 0)
                self.fds += fds
                if not chunk:
                    return None
                self.buffer += chunk
        except OSError:
            return None
        end = 4 + struct.unpack("!I", self.buffer[:4])[0]
        message, self.buffer = self.buffer[4:end], self.buffer[end:]
        return json.loads(message)


# ---------------------------------------------------------------------------------------------------- client


def client(args: list[str], *, started: bool = False) -> None:
    """A rank as torchrun sees it: its fork in the server, or `python [-u] -m toolkit ARGS` exec'd. `started`:
    this process is that command already (tests/forking/sitecustomize.py, before the toolkit runs), which goes on
    as it is instead of the exec. A forked process keeps FORKED_RANKS_ENV, so that the toolkit processes it starts
    in turn (the ranks of a `toolkit launch` or of a compare's arms, a benchmark's runs) are forked too; one that
    is not forked clears it for itself and what it starts (they would be refused the same)."""
    unbuffered = bool(getattr(sys.stdout, "write_through", False))  # what -u gives
    # a signal that comes before the rank exists waits for it (forwarded below) instead of ending this process
    signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    messages = _Messages(conn)
    request = {"args": args, "cwd": os.getcwd(), "env": dict(os.environ), "unbuffered": unbuffered,
               "client": os.getpid()}
    try:
        conn.connect(os.environ[FORKED_RANKS_ENV])
        _send(conn, request, (0, 1, 2))
        reply = messages.next()
        if reply and "redirect" in reply:  # a rank of a strategy on DeepSpeed: the server that imported it forks it
            conn.close()
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            messages = _Messages(conn)
            conn.connect(reply["redirect"])
            _send(conn, request, (0, 1, 2))
            reply = messages.next()
    except (KeyError, OSError):
        reply = None
    if not reply or "pid" not in reply:  # no server, or an environment a fork cannot give
        conn.close()
        os.environ[FORKED_RANKS_ENV] = ""
        signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)  # the mask would outlive the exec
        if started:
            return
        os.execv(sys.executable, [sys.executable, *(["-u"] if unbuffered else []), "-m", "toolkit", *args])
    rank = reply["pid"]
    for forwarded in SIGNALS:
        signal.signal(forwarded, lambda signum, _frame: _forward(rank, signum))
    # SIGTERM (forwarded to the rank) when torch's agent dies, as a plain rank asks for its own (toolkit.process.orphans)
    _set_parent_death_signal(signal.SIGTERM)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
    ended = messages.next()  # a signal's handler runs while this waits (PEP 475 resumes the wait)
    if ended is None:  # the supervisor is gone: so is the rank, as if the client had been killed outright
        _forward(rank, signal.SIGKILL)
        status = signal.SIGKILL  # a wait status: killed by that signal
    else:
        status = ended["status"]
    _carry_failure_said(rank)
    if os.WIFSIGNALED(status):  # as the rank died: torchrun reports -N
        signum = os.WTERMSIG(status)
        if signum in SIGNALS:  # ours forward it; SIGKILL, SIGSEGV, SIGABRT have their default action already
            signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


def _carry_failure_said(rank: int) -> None:
    """A rank of `toolkit launch` that said its failure in one line marks it under its own pid
    (toolkit.errors.mark_failure_said), where its launcher looks for the pid of the process it started: this
    client's. The mark is renamed to it, as the rank's getppid is the client's parent (_become_rank)."""
    folder = os.environ.get(SAID_DIR_ENV)
    if folder:
        with contextlib.suppress(OSError):  # no mark (the usual case), or the launch's folder is gone
            os.rename(os.path.join(folder, _failure_said_mark(rank)),
                      os.path.join(folder, _failure_said_mark(os.getpid())))


def _forward(rank: int, signum: int) -> None:
    try:
        os.kill(rank, signum)
    except ProcessLookupError:
        pass


# ---------------------------------------------------------------------------------------------------- server


def serve(path: str) -> None:
    """Import what every rank imports, then fork a supervisor per client until the tests end."""
    _set_parent_death_signal(signal.SIGTERM)  # ends with the test session that started it
    _LOG[0] = f"{path}.exec-log"
    sys.path[0] = os.getcwd()  # as under `python -m`: the folder it runs in, not this file's
    started = dict(os.environ)
    _preload()
    _SERVER_ENV.update(os.environ)
    _DEFAULTS.update({name: value for name, value in os.environ.items() if name not in started})
    import gc

    gc.freeze()  # the imported objects stay out of the collector's sweeps: their pages stay shared, not copied
    if os.fork() == 0:  # the DeepSpeed server (_serve_deepspeed), in the background; ends with this one
        _serve_deepspeed(f"{path}.deepspeed")
        return  # in a rank it forked
    _DEEPSPEED_SERVER[0] = f"{path}.deepspeed"
    _listen(path, say_ready=True)


def _serve_deepspeed(path: str) -> None:
    """A second server, forked from the first once that imported the toolkit: it imports the zero strategy's
    runtime_modules too (DeepSpeed, with mlflow where installed, and its Muon optimizer's module, with torch's
    inductor), which every rank of a ZeRO run imports before it measures its runtime (toolkit.train.loop's
    import_runtime_modules), and forks the ranks of the strategies that run on DeepSpeed, which the first server
    sends here (_runs_on_deepspeed). Measured: a 2-rank ZeRO-2 run of the tiny Llama 5.8 s and 10.1 s of CPU forked
    from the first server, 3.6 s and 5.6 s from here. The first server forks no other rank from here: it would carry
    DeepSpeed's ~100 MiB, which the memory tests count. Listening only once ready (a rename), so that until then, or
    where the imports printed something (a rank would not print it again), the first server forks those ranks itself."""
    _set_parent_death_signal(signal.SIGTERM)  # ends with the first server
    said = f"{path}.stderr"
    with open(said, "w") as output:  # not the first server's streams, which the tests read
        os.dup2(output.fileno(), 1)
        os.dup2(output.fileno(), 2)
    before = dict(os.environ)
    from toolkit.strategies import strategy_info
    from toolkit.strategies.base import import_runtime_module

    for name in strategy_info("zero").runtime_modules:
        import_runtime_module(name)

    sys.stdout.flush()
    sys.stderr.flush()
    if os.path.getsize(said):  # a rank would not print it again: the first server forks them all (plain imports)
        os._exit(0)
    # what the import sets (PYTORCH_NVML_BASED_CUDA_CHECK; mlflow's telemetry session), which a plain rank has once
    # it imported DeepSpeed: a rank forked here gets it where its client's environment lacks it (_become_rank)
    _IMPORT_SET.update({name: value for name, value in os.environ.items() if before.get(name) != value})
    _DEFAULTS.update(_IMPORT_SET)
    _SERVER_ENV.update(os.environ)
    import gc

    gc.freeze()
    _listen(path)


_DEEPSPEED_SERVER = [""]  # in the first server: where the DeepSpeed server listens once it is ready
_IMPORT_SET: dict[str, str] = {}  # what importing DeepSpeed set in the environment


def _listen(path: str, *, say_ready: bool = False) -> None:
    """Serve clients at `path` (bound under another name, then renamed: a client that finds `path` finds it ready)
    until the tests end; `say_ready`: print "ready" once listening, for the tests' process that started it."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(f"{path}.binding")
    listener.listen(128)
    os.rename(f"{path}.binding", path)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # supervisors are reaped by the kernel
    if say_ready:
        print("ready", flush=True)
    while True:
        conn, _ = listener.accept()
        if os.fork() == 0:
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            _supervise(conn)  # returns only in the rank, which then runs the toolkit
            return
        conn.close()


def _preload() -> None:
    """The modules every rank of a tiny-model test imports before it trains (not DeepSpeed: a rank of another
    strategy would carry its ~50-100 MiB, which the memory tests would count), in a rank's order: the toolkit's
    settings first (offline hubs, the allocator's threshold: toolkit.cli's _main), as libraries read them when
    they load."""
    from toolkit.launch.launcher import prepare_environment

    prepare_environment()
    import torch

    torch.set_num_threads(1)  # no OpenMP team before a fork: a forked child's next parallel region would hang
    import transformers.models.bert.modeling_bert  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401

    import toolkit.cli  # noqa: F401
    import toolkit.train.loop  # noqa: F401
    # and what a rank imports before it measures its runtime (toolkit.train.loop: the base of its memory
    # prediction), a plain rank's as much as a forked one's: the data library (with pandas and pyarrow) it reads
    # rows with, and every strategy's module (the recipe checks ask each for its options); ~1.2 s a process
    import datasets  # noqa: F401

    import toolkit.compare.cli  # noqa: F401
    import toolkit.launch.accelerate_env  # noqa: F401
    from toolkit.strategies import strategy_info, strategy_names

    for name in strategy_names():
        strategy_info(name)
    # transformers' table of checkpoint key conversions, built at a process's first from_pretrained (~1,000 regular
    # expressions compiled: 0.2-0.4 s of every rank's CPU, 1.4 MiB) and kept for the process: built here once. A
    # forked rank's runtime bytes (measured before its model loads) hold it, a plain rank's load adds it.
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    get_checkpoint_conversion_mapping("llama")


def _supervise(conn: socket.socket) -> None:
    """In the supervisor: fork the rank, tell the client its pid, wait for its end or the client's."""
    messages = _Messages(conn)
    request, fds = messages.next(max_fds=3), messages.fds
    differ = _differences(request["env"]) if request and len(fds) == 3 else ["(no request)"]
    if differ:
        with open(_LOG[0], "a") as log:  # for a look at why a suite runs slower than it could
            log.write(f"exec'd: {' '.join(request['args'][:1]) if request else ''}: {', '.join(differ)}\n")
        try:
            _send(conn, {})
        finally:
            os._exit(0)
    deepspeed_server = _DEEPSPEED_SERVER[0]
    if deepspeed_server and os.path.exists(deepspeed_server) and _runs_on_deepspeed(request):
        try:
            _send(conn, {"redirect": deepspeed_server})
        finally:
            os._exit(0)
    rank = os.fork()
    if rank == 0:
        conn.close()
        _become_rank(request, fds)
        return
    for fd in fds:
        os.close(fd)
    try:
        _send(conn, {"pid": rank})
        _wait(rank, conn)
    except OSError:  # the client is gone (reset, broken pipe): so is its rank, as if it had been killed outright
        os.kill(rank, signal.SIGKILL)
    _, status, usage = os.wait4(rank, 0)
    try:
        _send(conn, {"status": status})
    except OSError:
        pass
    with contextlib.suppress(Exception):  # a diagnostic: never in the way of the rank's end
        _log_cpu(request, usage)
    os._exit(0)


CPU_LOG_ENV = "TOOLKIT_TEST_CPU_LOG"  # a file: each forked process's CPU seconds are added to it, with its test


def _log_cpu(request: dict, usage) -> None:
    """Where the test session names a CPU log (CPU_LOG_ENV, `TOOLKIT_TEST_CPU_LOG=FILE make test`): one JSON line
    per forked process, with the test that started it and the CPU seconds it (and what it waited for) used: where
    a suite's time goes, on a machine whose cores the suite keeps busy. The file adds up every session that names
    it."""
    path = request["env"].get(CPU_LOG_ENV)
    if not path:
        return
    line = json.dumps({"test": request["env"].get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0],
                       "args": request["args"][:1], "rank": request["env"].get("RANK"),
                       "cpu_s": round(usage.ru_utime + usage.ru_stime, 3)})
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, (line + "\n").encode())  # one write of a short line: whole among the other processes'
    finally:
        os.close(fd)


def _wait(rank: int, conn: socket.socket) -> None:
    """Until the rank ends, or the client closes its socket (killed outright): then the rank is killed too."""
    import select

    watch = select.poll()
    pidfd = os.pidfd_open(rank)
    watch.register(pidfd, select.POLLIN)
    watch.register(conn, select.POLLIN)
    while True:
        ready = {fd for fd, _ in watch.poll()}
        if pidfd in ready:
            return
        if conn.fileno() in ready and not conn.recv(1):
            os.kill(rank, signal.SIGKILL)
            return


def _runs_on_deepspeed(request: dict) -> bool:
    """Whether the request is a rank (`train RECIPE ...`) of a strategy that runs on DeepSpeed, as the rank itself
    decides it (toolkit.launch.rank's rank_recipe and _may_import_deepspeed). A recipe that cannot be read says so
    in the rank, forked here."""
    import io

    if request["args"][:1] != ["train"]:
        return False
    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            from toolkit.cli import build_parser
            from toolkit.launch.rank import _may_import_deepspeed, rank_recipe

            args = build_parser().parse_args(request["args"])
            os.chdir(request["cwd"])  # a recipe path relative to the client's folder (this process ends soon)
            recipe, _ = rank_recipe(args.recipe, args.overrides, request["env"])
            return _may_import_deepspeed(recipe.strategy.name)
    except BaseException:  # noqa: BLE001 - a mistake in the recipe: the rank, forked here, says it
        return False


def _differences(env: dict[str, str]) -> list[str]:
    """The variables a fork cannot give: set, unset or other in `env` (with the defaults the rank would add, as
    the server did: toolkit.launch.launcher.prepare_environment's) than in the server's environment."""
    effective = {**_DEFAULTS, **env}
    names = (set(effective) | set(_SERVER_ENV)) - {FORKED_RANKS_ENV}
    return sorted(n for n in names if not _runtime(n) and effective.get(n) != _SERVER_ENV.get(n))


def _become_rank(request: dict, fds: list[int]) -> None:
    """In the rank: what `python [-u] -m toolkit ARGS` would be, in the client's folder, environment and
    streams, with the client's parent (torch's agent) as its parent."""
    import runpy

    import numpy
    import torch

    os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    _standard_streams(unbuffered=request["unbuffered"])
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for name, value in _IMPORT_SET.items():
        os.environ.setdefault(name, value)
    # libgomp read the server's OMP_NUM_THREADS as it loaded; without one, a process uses every CPU it may run on
    try:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or len(os.sched_getaffinity(0))))
    except ValueError:  # a value libgomp reads and int() does not ("2,1"): left as the server's
        pass
    numpy.random.seed()  # a new process's numpy draws its seed from the system, as Python's `random` does here
    # The rank's parent is its supervisor; what the toolkit asks of its parent (follow_launcher's watch,
    # say_once's key, the preemption fault) is about the process that started the client: torch's agent.
    client = request["client"]
    os.getppid = lambda: _parent_of(client)
    sys.argv = ["-m", *request["args"]]
    sys.path[0] = os.getcwd()
    runpy.run_module("toolkit", run_name="__main__", alter_sys=True)


def _parent_of(pid: int) -> int:
    """The parent of `pid` (/proc), or 1 once `pid` is gone: as getppid reads after a parent died."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 1


def _standard_streams(*, unbuffered: bool) -> None:
    """sys.stdin/stdout/stderr over descriptors 0-2 as the interpreter makes them: with -u, written through;
    else stdout buffered (by line on a terminal) and stderr by line."""
    import io

    encoding, errors = sys.stdout.encoding, sys.stdout.errors

    def writer(fd: int, *, line_buffering: bool, errors: str) -> io.TextIOWrapper:
        raw = io.FileIO(fd, "w", closefd=False)
        if unbuffered:
            return io.TextIOWrapper(raw, encoding=encoding, errors=errors, write_through=True)
        return io.TextIOWrapper(io.BufferedWriter(raw), encoding=encoding, errors=errors,
                                line_buffering=line_buffering)

    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)),
                                                 encoding=encoding, errors=errors)
    sys.stdout = sys.__stdout__ = writer(1, line_buffering=os.isatty(1), errors=errors)
    sys.stderr = sys.__stderr__ = writer(2, line_buffering=True, errors="backslashreplace")


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        serve(sys.argv[2])
    else:
        client(sys.argv[1:])
