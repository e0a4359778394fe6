"""`toolkit launch`: checks the recipe, then hands the ranks to torch's own launcher (torch.distributed.run)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

from toolkit.errors import (NONFINITE_EXIT_CODE, REPLICA_DRIFT_EXIT_CODE, SAID_DIR_ENV, USER_ERROR_EXIT_CODE,
                            RecipeError, failure_said, first_line, ranks_option, under_accelerate)
from toolkit.launch.agent_log import AgentWatch
from toolkit.launch.exits import Failure, describe_failures, failed_ranks, nonfinite_elsewhere, stopped_together
from toolkit.process.orphans import LAUNCHED_AT_ENV, LAUNCHER_PID_ENV


def worker_args(recipe_path: str, overrides: list[str], extra: list[str] | None = None) -> list[str]:
    args = ["-m", "toolkit", "train", recipe_path]
    for item in overrides:
        args += ["--set", item]
    return args + list(extra or [])


@dataclass(frozen=True, kw_only=True)
class Nodes:
    """Where the ranks are: one machine (torchrun --standalone: a free local port), or `count` machines that meet
    at a c10d rendezvous on `endpoint` (HOST:PORT, on one of them), each running this same command."""

    count: int = 1
    rank: int = 0  # this machine's --node-rank (with c10d, ranks are given in arrival order all the same)
    endpoint: str | None = None
    run_id: str = "toolkit"  # the rendezvous id: every node of one job passes the same
    local_addr: str | None = None  # the address this node advertises (e.g. 127.0.0.1 for nodes on one host)

    def torchrun_args(self) -> list[str]:
        if self.count == 1 and self.endpoint is None:
            return ["--standalone"]
        assert self.endpoint is not None  # the CLI asks for it with --nnodes > 1
        args = [f"--nnodes={self.count}", f"--node-rank={self.rank}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={self.endpoint}", f"--rdzv-id={self.run_id}"]
        return args + ([f"--local-addr={self.local_addr}"] if self.local_addr else [])

    def shared_launch_args(self) -> str:
        """The `toolkit launch` options every machine of this job passes alike ('' on one machine): what a
        rank's resume command needs (each machine adds its own --node-rank, and --local-addr if it set one)."""
        if self.count == 1 and self.endpoint is None:
            return ""
        return (f"--nnodes {self.count} --rdzv-endpoint {shlex.quote(str(self.endpoint))} "
                f"--rdzv-id {shlex.quote(self.run_id)}")


def check_endpoint(endpoint: str, *, hosted_here: bool = False) -> None:
    """--rdzv-endpoint is HOST:PORT with a port in 1..65535 and a host this machine resolves: torch's agent would
    raise a ValueError for the port, and for the host log C++ stack frames for minutes before it gives up.
    `hosted_here` (a one-machine job): the port must be free where the host is this machine."""
    import socket

    form = f"--rdzv-endpoint {endpoint!r}"
    match = re.fullmatch(r"(\[[0-9A-Fa-f:.]+\]|[\w.\-]+):(\d+)", endpoint)
    if match is None:
        raise RecipeError(f"{form} is not HOST:PORT (e.g. node001:29500, or [::1]:29500 for an IPv6 address)")
    host, port = match.group(1).strip("[]"), int(match.group(2))
    if not 1 <= port <= 65535:
        raise RecipeError(f"{form}: port {port} is outside 1..65535; give a free port such as 29500")
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:  # UnicodeError: a label longer than 63 characters
        raise RecipeError(f"{form}: this machine cannot resolve the host {host!r} ({exc}); give a hostname or "
                          "address of the first machine that every machine reaches") from None
    if hosted_here:
        _check_port_free(form, port, addresses)


def _check_port_free(form: str, port: int, addresses: list) -> None:
    """One machine with --rdzv-endpoint: its launcher hosts the rendezvous store on that port. torch's agent,
    finding the port taken, joins whatever listens there as a client and waits out its timeout (more than
    150 s) before it fails. A bind to one of the endpoint's addresses tells at once; an address that is not
    this machine's (EADDRNOTAVAIL) is left to the rendezvous, whose failure is one line too (launch)."""
    import errno
    import socket

    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free to a server
            try:
                probe.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise RecipeError(f"{form}: port {port} is already in use on this machine; give a free port, "
                                      "or leave --rdzv-endpoint out on one machine (a free one is then chosen)") \
                        from None
                if exc.errno == errno.EACCES:
                    raise RecipeError(f"{form}: port {port} is reserved for privileged processes on this machine; "
                                      "give a port above 1023, such as 29500") from None


NODES_ENV = "TOOLKIT_NODES"  # Nodes.shared_launch_args, for the ranks (resume_hint)
RANKS_CHECK_ENV = "TOOLKIT_RANKS_CHECK"  # "1": the ranks run the recipe's checks, not the launcher (launch_recipe)


def resume_hint(world_size: int) -> str:
    """'resume with: COMMAND', the command that continues this run: this rank's arguments after `train`, plus
    --resume. A job over several machines is continued by a `toolkit launch` on each: the job's shared options
    (known where `toolkit launch` started it), each machine's own --node-rank (and --local-addr, if it set one)."""
    from toolkit.process.dist import machines_of

    args = list(sys.argv[2:])
    while "--resume-weights-only" in args:
        args.remove("--resume-weights-only")
    if "--resume" in args:  # --resume [PATH]: the newest checkpoint is what to continue from now
        index = args.index("--resume")
        del args[index:index + (2 if index + 1 < len(args) and not args[index + 1].startswith("--") else 1)]
    tail = f"{' '.join(shlex.quote(a) for a in args)} --resume"
    if under_accelerate():  # its config file (the strategy's plugin) and process count are the launch's own
        return (f"resume with: the same accelerate launch command (config file, {ranks_option(world_size)}) and "
                f"`-m toolkit train {tail}`")
    num_machines, local_world_size = machines_of(world_size)
    if num_machines <= 1:
        launcher = f"toolkit launch --nproc {world_size}" if world_size > 1 else "toolkit train"
        return f"resume with: {launcher} {tail}"
    even = local_world_size * num_machines == world_size  # every machine runs as many ranks as this one
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "ID")
    shared = os.environ.get(NODES_ENV) or \
        f"--nnodes {num_machines} --rdzv-endpoint HOST:PORT --rdzv-id {shlex.quote(run_id)}"
    own = "NODE_RANK" if even else "NODE_RANK and NPROC"
    return (f"resume with, on each of the {num_machines} machines ({own} its own, and --local-addr if it set one): "
            f"toolkit launch --nproc {local_world_size if even else 'NPROC'} {shared} --node-rank NODE_RANK {tail}")


def torchrun_args(recipe_path: str, *, nproc: int, overrides: list[str], extra: list[str] | None = None,
                  max_restarts: int = 0, nodes: Nodes = Nodes()) -> list[str]:
    """The torch.distributed.run command line: `nproc` ranks on this machine (one node: a free local port, or
    several meeting at a rendezvous), this interpreter; with max_restarts, torch's elastic agent restarts every
    rank when one dies (they resume, see loop)."""
    return [*nodes.torchrun_args(), f"--nproc_per_node={nproc}", f"--max-restarts={max_restarts}", "--no-python",
            sys.executable, *worker_args(recipe_path, overrides, extra)]


def prepare_environment() -> None:
    """Settings every rank inherits: offline hubs, DeepSpeed's CPU accelerator when no GPU is seen."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # ranks share the cores; torchrun would set it too


def launch_recipe(recipe_path: str, overrides: list[str], *, nproc: int, nodes: Nodes = Nodes(),
                  max_restarts: int = 0, resume=None) -> int:
    """`toolkit launch`: the recipe's checks (a mistake: RecipeError, one line), then its ranks (launch); returns
    the exit code. `resume`: a checkpoint.run.Resume, or None to start afresh.

    Where the checks run. On one machine, in the ranks (RANKS_CHECK_ENV), first thing after they join the group:
    they import torch, transformers and datasets anyway, so the checks cost them ~0.15 s, where the launcher paid
    ~2 s of the same imports before any rank started (a 2-rank, 1-step llama-tiny launch: 9.3 s -> see the
    README's start-up line). Every rank finds the same mistake; the first says its line (say_user_error), every rank
    exits 2 before writing anything, and so does the launch. With more machines, each machine's launcher checks
    before it joins the rendezvous, so that a machine whose files differ is refused there, not in a group that
    waits for it."""
    from pathlib import Path

    from toolkit.checkpoint import store
    from toolkit.config.parallel import resolve
    from toolkit.config.files import load_recipe
    from toolkit.process import folder_lock

    recipe = resolve(load_recipe(recipe_path, overrides), world_size=nproc * nodes.count)  # degrees -> preset
    # a live run's output_dir: said before any rank starts (rank 0 then holds it for the run: launch/rank.py)
    folder_lock.check_free(Path(recipe.output_dir), message=folder_lock.run_in_use(Path(recipe.output_dir)))
    in_ranks = nodes.count == 1
    if not in_ranks:
        from toolkit.checkpoint.run import NothingToResume, starting_point
        from toolkit.train.checks import check_recipe

        plan = check_recipe(recipe, world_size=nproc * nodes.count)  # on every node, before its ranks start
        try:  # an existing run without --resume, or nothing to resume: one line
            starting_point(recipe, resume, plan=plan)
        except NothingToResume as done:
            print(done, file=sys.stderr, flush=True)
            return 0
    if max_restarts and recipe.checkpoint.every_steps is None and recipe.checkpoint.every_minutes is None:
        print(f"[toolkit] warning: --max-restarts {max_restarts} restarts the ranks from the run's newest "
              "checkpoint, and neither checkpoint.every_steps nor every_minutes is set (only a final checkpoint): a "
              "restart trains again from step 1; set one of them to lose at most that many steps or minutes",
              file=sys.stderr, flush=True)
    extra = [] if resume is None else ["--resume", *([resume.path] if resume.path else [])] + \
        (["--resume-weights-only"] if resume.weights_only else [])
    started, failures = time.time(), list[Failure]()
    watch = AgentWatch(one_machine=nodes.count == 1)
    code = launch(recipe_path, nproc=nproc, overrides=overrides, extra=extra, max_restarts=max_restarts,
                  nodes=nodes, failures=failures, check_in_ranks=in_ranks, watch=watch)
    out_dir = Path(recipe.output_dir)
    run_info = out_dir / "run.json"
    if code == 0 or not run_info.is_file() or run_info.stat().st_mtime < started:
        return code
    from toolkit.train import runinfo

    info = store.read_run_info(out_dir) or {}
    status, signalled = info.get("status"), code > 128 and watch.stop_signal is not None
    if status == "completed":
        # a rank that dies after the outputs are written is still a failure, but the outputs are good
        when = "its last step before it could stop" if signalled else "before that"
        print(f"toolkit: the run itself completed {when}: outputs in {recipe.output_dir} are complete",
              file=sys.stderr)
    elif status == "running" and signalled and nodes.count == 1:
        # the agent forwarded a stop signal and the ranks ended before rank 0 wrote how: killed when they had not
        # stopped by its timeout (one blocked in a collective whose peer hangs), or before they could take it
        found = store.complete_checkpoints(out_dir)
        why = (f"the ranks had not finished their step {watch.timeout_s} s after it and were killed" if watch.killed
               else "the ranks ended before rank 0 recorded the stop") + " (no checkpoint of the stop)"
        runinfo.mark_left_running(out_dir, stopped_by=watch.stop_signal, reason=f"{watch.stop_signal}: {why}")
        blocked = " (a rank blocked in a collective: its peer hung or stopped)" if watch.killed else ""
        where = (f"the newest checkpoint is {found[-1]} (step {store.step_of(found[-1])}); resume with: "
                 f"{relaunch_command(recipe_path, overrides, nproc=nproc)}") if found else "no checkpoint was written"
        print(f"toolkit: stopped by {watch.stop_signal}, but {why}{blocked}; {where}", file=sys.stderr, flush=True)
    elif status == "running" and (nodes.count == 1 or (failures and 0 in failures[-1].ranks)):
        # rank 0 was killed before it could write how the run ended. With more machines, only rank 0's own
        # launcher (its failure is among this machine's ranks, all gone) knows it will write nothing more.
        runinfo.mark_left_running(out_dir, reason=f"launch failed: {failures[-1].how}" if failures else
                                  f"the ranks ended (launch exit code {code}) before rank 0 recorded why")
    elif status == "failed" and failures and nodes.count == 1 and (info.get("ended") or {}).get("peer_lost"):
        # rank 0 recorded only that a connection closed: the launch knows which rank failed and how
        runinfo.name_failed_rank(out_dir, reason=f"launch failed: {failures[-1].how}")
    return code


def relaunch_command(recipe_path: str, overrides: list[str], *, nproc: int) -> str:
    """The `toolkit launch` command (on one machine) that continues this launch's run from its newest checkpoint."""
    sets = "".join(f" --set {shlex.quote(item)}" for item in overrides)
    return f"toolkit launch --nproc {nproc} {shlex.quote(recipe_path)}{sets} --resume"


AGENT_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")  # the handlers torch's agent installs


def launch(recipe_path: str, *, nproc: int, overrides: list[str], extra: list[str] | None = None,
           max_restarts: int = 0, nodes: Nodes = Nodes(), failures: list[Failure] | None = None,
           check_in_ranks: bool = False, watch: AgentWatch | None = None) -> int:
    """Run the recipe on `nproc` local ranks (of `nodes`) through torch.distributed.run; returns the exit code.
    `failures` gets which ranks failed and how, where the launch failed ("rank 0 killed by SIGKILL; ...").
    `check_in_ranks`: the ranks run the launcher's checks of the recipe (launch_recipe) before they train.
    `watch`: what torch's agent did (restarts said as they happen; the ranks it killed after a stop signal)."""
    import signal

    from torch.distributed.run import get_args_parser, run

    prepare_environment()
    quiet_agent_logs()
    watch = watch or AgentWatch(one_machine=nodes.count == 1)
    args = get_args_parser().parse_args(torchrun_args(recipe_path, nproc=nproc, overrides=overrides,
                                                        extra=extra, max_restarts=max_restarts, nodes=nodes))
    # the launch's own temporary folder: the ranks' say_once markers and torch's agent logs (its default is a
    # torchelastic_* folder of its own in the temporary folder, left there), all gone with the launch
    said = tempfile.mkdtemp(prefix="toolkit-launch-")
    if not args.log_dir:
        args.log_dir = os.path.join(said, "agent")
    # SIGUSR1 (SLURM's warning before a kill) is handled like SIGTERM: torch's agent forwards that to every
    # rank, and the ranks checkpoint and stop after their current step
    usr1 = signal.signal(signal.SIGUSR1, lambda *_: os.kill(os.getpid(), signal.SIGTERM))
    # torch's agent turns these into its SignalException for as long as it runs, and leaves them so: a caller that
    # goes on (compare, between its arms) gets its own handlers back
    handlers = {signum: signal.getsignal(signum) for signum in
                (getattr(signal, name) for name in AGENT_SIGNALS if hasattr(signal, name))}
    # the ranks inherit these; this process gets its own back
    before = {name: os.environ.get(name) for name in (NODES_ENV, SAID_DIR_ENV, LAUNCHER_PID_ENV, RANKS_CHECK_ENV,
                                                      LAUNCHED_AT_ENV)}
    # LAUNCHED_AT_ENV: a restarted rank resumes the newest checkpoint saved since (checkpoint.run.after_restart)
    os.environ.update({NODES_ENV: nodes.shared_launch_args(), SAID_DIR_ENV: said, LAUNCHED_AT_ENV: str(time.time())})
    if check_in_ranks:
        os.environ[RANKS_CHECK_ENV] = "1"
    else:
        os.environ.pop(RANKS_CHECK_ENV, None)
    if threading.current_thread() is threading.main_thread():
        # the ranks end with this process (toolkit.process.orphans): torch's agent starts them from the thread that
        # calls run(), and a rank's death signal fires when that thread ends, which for the main thread is
        # when the process does
        os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    try:
        watch.attach(quiet="LOGLEVEL" not in os.environ)
        return _run_ranks(run, args, nodes, failures=failures)
    finally:
        watch.detach()
        signal.signal(signal.SIGUSR1, usr1)
        for signum, handler in handlers.items():
            if handler is not None:  # None: not set from Python, nothing to give back
                signal.signal(signum, handler)
        shutil.rmtree(said, ignore_errors=True)
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _run_ranks(run, args, nodes: Nodes, *, failures: list[Failure] | None = None) -> int:
    """torch.distributed.run's run(args), its outcome as the launcher's exit code (see launch)."""
    import signal

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    try:
        run(args)
    except SignalException as exc:  # the ranks said where they stopped and how to resume
        outlive_other_machines(nodes)
        return 128 + int(exc.sigval)
    except ChildFailedError as exc:
        codes = {rank: failure.exitcode for rank, failure in exc.failures.items()}
        failed = {codes[rank] for rank in failed_ranks(codes)}
        if failed == {USER_ERROR_EXIT_CODE}:  # rank 0 said it in one line
            return USER_ERROR_EXIT_CODE
        if failed == {REPLICA_DRIFT_EXIT_CODE}:  # every rank said which tensor drifted
            outlive_other_machines(nodes)
            return REPLICA_DRIFT_EXIT_CODE
        if failed == {NONFINITE_EXIT_CODE}:  # every rank stopped at the same step; rank 0 said where (rank.py)
            if codes.get(0) != NONFINITE_EXIT_CODE:
                print(nonfinite_elsewhere(codes), file=sys.stderr, flush=True)
            outlive_other_machines(nodes)
            return NONFINITE_EXIT_CODE
        stopped = stopped_together(codes)
        if stopped:  # a stop signal reached the ranks (on another machine, or not through this launcher)
            if 0 not in codes:  # rank 0, on another machine, says where the checkpoint is and how to resume
                name = signal.Signals(stopped - 128).name
                what = "" if name == "SIGINT" else " after writing their part of the checkpoint"
                print(f"toolkit: this machine's ranks stopped with the job ({name}){what}; the first rank's output "
                      "says how to resume", file=sys.stderr, flush=True)
            outlive_other_machines(nodes)
            return stopped
        failed_how = describe_failures(codes)
        if failures is not None:
            failures.append(Failure(failed_how, frozenset(codes)))
        # a rank that said the failure in one line (rank 0, which may then be stopped by the first rank to exit)
        if failed == {1} and any(failure_said(failure.pid) for failure in exc.failures.values()):
            return 1
        # a rank SIGKILLed says nothing (a rank that faulted prints its Python stacks, one that raised its error)
        above = "" if all(codes[rank] == -signal.SIGKILL for rank in failed_ranks(codes)) else \
            " (see the rank output above)"
        print(f"toolkit: launch failed: {failed_how}{above}", file=sys.stderr)
        return 1
    except RendezvousError as exc:  # the machine that hosts the rendezvous is gone
        if nodes.count == 1:  # this machine is the only one: the endpoint is not one it can host
            raise RecipeError(f"--rdzv-endpoint {nodes.endpoint}: the rendezvous failed there ({type(exc).__name__}: "
                              f"{first_line(exc)}); give this machine's address and a free port, or leave "
                              "--rdzv-endpoint out on one machine") from None
        print(f"toolkit: lost the job's rendezvous at {nodes.endpoint} ({type(exc).__name__}): the machine there "
              "stopped or failed; its output says why", file=sys.stderr, flush=True)
        return 1
    return 0


RENDEZVOUS_GRACE_S = 3.0


def outlive_other_machines(nodes: Nodes) -> None:
    """A stopping machine of a multi-machine job waits a few seconds before its launcher exits: the launcher that
    hosts the rendezvous store takes the store with it, and another machine's agent, which reads the store about
    once a second while its ranks run, would otherwise fail with a RendezvousConnectionError while its ranks
    are still exiting after the same stop."""
    if nodes.count > 1:
        time.sleep(RENDEZVOUS_GRACE_S)


def quiet_agent_logs() -> None:
    """torch's elastic agent logs each signal it forwards and each rank that failed; the toolkit says the same
    in one line (describe_failures) after the ranks' own lines. LOGLEVEL (torch's switch) keeps them on."""
    import logging

    if "LOGLEVEL" in os.environ:
        return
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher")):
            logging.getLogger(name).setLevel(logging.CRITICAL)
