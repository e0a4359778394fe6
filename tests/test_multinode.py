"""More than one machine: `toolkit launch --nnodes 2` meets at torchrun's c10d rendezvous. Two launchers of one
rank each on 127.0.0.1 act as two nodes and must train exactly what one node of two ranks trains."""

import json
import os
import shlex
import socket
import subprocess
import sys

import pytest
import torch

import test_sharded
from conftest import REPO, metrics, toolkit_env
from toolkit.cli import main
from toolkit.process import faults

COMPARED = ("step", "loss", "lr", "grad_norm", "tokens", "samples")
ARMS = {"ddp-m4": ("strategy.name=ddp", "batch.micro_batch_size=4"), "fsdp": test_sharded.ARMS["fsdp"]}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def two_nodes(args: list[str], *, env: dict | None = None) -> tuple[list[int], list[str]]:
    """`python -m toolkit launch ARGS` as two machines of one rank each on 127.0.0.1: exit codes and outputs.
    ARGS name NODE_RANK where each gives its own --node-rank."""
    nodes = [subprocess.Popen([sys.executable, "-m", "toolkit", *[str(rank) if a == "NODE_RANK" else a for a in args],
                               "--local-addr", "127.0.0.1"], cwd=REPO, env=env or toolkit_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    logs = [node.communicate(timeout=600)[0] for node in nodes]
    return [node.returncode for node in nodes], logs


@pytest.mark.parametrize("name", list(ARMS))
def test_two_nodes_of_one_rank_train_as_one_node_of_two(llama_runs, name, tmp_path):
    reference = llama_runs.get(name, nproc=2, overrides=ARMS[name])
    out = tmp_path / "two-nodes"
    sets = [a for o in (*ARMS[name], f"output_dir={out}") for a in ("--set", o)]
    codes, logs = two_nodes(["launch", "--nnodes", "2", "--node-rank", "NODE_RANK", "--nproc", "1", "--rdzv-endpoint",
                             f"127.0.0.1:{free_port()}", str(llama_runs.recipe), *sets])
    assert codes == [0, 0], "\n".join(log[-3000:] for log in logs)
    assert sum("[toolkit] strategy" in log for log in logs) == 1  # one global rank 0, on whichever node
    got, want = metrics(out), metrics(reference)
    assert [{k: m[k] for k in COMPARED} for m in got] == [{k: m[k] for k in COMPARED} for m in want]


def test_a_job_preempted_on_one_machine_stops_on_both_and_resumes_from_the_line_it_printed(llama_runs, tmp_path):
    reference = llama_runs.get("ddp-m4", nproc=2, overrides=ARMS["ddp-m4"])
    out, endpoint = tmp_path / "preempted", f"127.0.0.1:{free_port()}"
    sets = [a for o in (*ARMS["ddp-m4"], f"output_dir={out}") for a in ("--set", o)]
    env = toolkit_env()
    env[faults.SIGTERM_LAUNCHER_AT_STEP] = "2"  # rank 0 has its own machine's launcher sent SIGTERM after step 2
    codes, logs = two_nodes(["launch", "--nnodes", "2", "--node-rank", "NODE_RANK", "--nproc", "1", "--rdzv-endpoint",
                             endpoint, "--rdzv-id", "job 7", str(llama_runs.recipe), *sets], env=env)
    assert codes == [143, 143], "\n".join(log[-3000:] for log in logs)  # every rank stopped after the same step
    lines = sorted((l for log in logs for l in log.splitlines() if l.startswith("toolkit:")), key=len)
    assert len(lines) == 2 and "Traceback" not in "".join(logs), "\n".join(logs)
    # the other machine (whichever holds rank 1: ranks go in arrival order) says the job stopped, not that it failed
    assert lines[0] == ("toolkit: this machine's ranks stopped with the job (SIGTERM) after writing their part of the "
                        "checkpoint; the first rank's output says how to resume")
    note = "resume with, on each of the 2 machines (NODE_RANK its own, and --local-addr if it set one): "
    assert lines[1].startswith("toolkit: stopped by SIGTERM at step ") and note in lines[1], lines[1]
    command = shlex.split(lines[1].split(note)[1])
    assert command[:12] == ["toolkit", "launch", "--nproc", "1", "--nnodes", "2", "--rdzv-endpoint", endpoint,
                            "--rdzv-id", "job 7", "--node-rank", "NODE_RANK"] and command[-1] == "--resume"
    command[7] = f"127.0.0.1:{free_port()}"  # the first rendezvous's port may still be held by the system
    codes, logs = two_nodes(command[1:])
    assert codes == [0, 0], "\n".join(log[-3000:] for log in logs)
    assert sum("[toolkit] resume: weights and optimizer state from" in log for log in logs) == 1
    got, want = metrics(out), metrics(reference)  # the steps after the checkpoint were dropped and run again
    assert [m["step"] for m in got] == [m["step"] for m in want] == [1, 2, 3, 4, 5]
    torch.testing.assert_close(torch.tensor([m["loss"] for m in got], dtype=torch.float64),
                               torch.tensor([m["loss"] for m in want], dtype=torch.float64), rtol=1e-6, atol=0.0)


def test_rank_0_killed_on_one_machine_leaves_a_run_json_that_says_the_run_failed(llama_runs, tmp_path):
    """SIGKILL (the out-of-memory killer's) gives rank 0 no time to write how the run ended: the launcher of its
    machine, whose ranks are all gone, turns run.json's "running" into "failed" (one machine: test_clean_exit).
    The other machine's launcher leaves it to that one: there, rank 0 might still be writing."""
    out = tmp_path / "killed"
    sets = [a for o in (*ARMS["ddp-m4"], "checkpoint.every_steps=1", f"output_dir={out}") for a in ("--set", o)]
    env = toolkit_env()
    env[faults.KILL_RANK_AT_STEP] = "0:1"  # after step 1 and its checkpoint
    codes, logs = two_nodes(["launch", "--nnodes", "2", "--node-rank", "NODE_RANK", "--nproc", "1", "--rdzv-endpoint",
                             f"127.0.0.1:{free_port()}", str(llama_runs.recipe), *sets], env=env)
    assert codes == [1, 1], "\n".join(log[-3000:] for log in logs)
    assert sum("toolkit: launch failed: rank 0 killed by SIGKILL" in log for log in logs) == 1, "\n".join(logs)
    run = json.loads((out / "run.json").read_text())
    assert run["status"] == "failed", run.get("ended")
    assert run["ended"]["reason"].startswith("launch failed: rank 0 killed by SIGKILL"), run["ended"]
    assert (run["ended"]["steps_done"], run["ended"]["checkpoint"]) == (1, str(out / "checkpoints" / "step-00000001"))


@pytest.mark.parametrize("args, words", [
    (["--nnodes", "2"], "--nnodes > 1 needs --rdzv-endpoint HOST:PORT"),
    (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1"], "a node rank from 0 to nnodes-1"),
    (["--nnodes", "2", "--rdzv-endpoint", "node001"], "'node001' is not HOST:PORT"),
])
def test_bad_node_arguments_are_one_line(llama_runs, args, words, capsys):
    assert main(["launch", *args, str(llama_runs.recipe)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err


def test_a_stopped_job_of_several_machines_is_resumed_by_a_launch_on_each(monkeypatch):
    from toolkit.launch.launcher import NODES_ENV, Nodes, resume_hint

    def command(hint: str) -> list[str]:  # what follows "resume with...:" must be a shell command as it stands
        return shlex.split(hint.split(": ", 1)[1])

    # what a rank of `toolkit launch --nnodes 2 --node-rank 1 --nproc 4 ...` sees: torch's launcher's machine
    # count and local world size, and the options `toolkit launch` shares with its ranks
    argv = ["toolkit", "train", "recipes/llama-tiny.yaml", "--set", "strategy.name=fsdp", "--resume"]
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv(NODES_ENV, Nodes(count=2, rank=1, endpoint="[::1]:29500", run_id="job 7").shared_launch_args())
    hint = resume_hint(8)
    assert hint.startswith("resume with, on each of the 2 machines (NODE_RANK its own, and --local-addr if it set one): ")
    assert command(hint) == ["toolkit", "launch", "--nproc", "4", "--nnodes", "2", "--rdzv-endpoint", "[::1]:29500",
                             "--rdzv-id", "job 7", "--node-rank", "NODE_RANK", "recipes/llama-tiny.yaml", "--set",
                             "strategy.name=fsdp", "--resume"]
    assert "'[::1]:29500'" in hint  # quoted: a shell would take the brackets for a pattern
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")  # machines of different sizes: each gives its own
    assert command(resume_hint(8))[:4] == ["toolkit", "launch", "--nproc", "NPROC"]
    assert "(NODE_RANK and NPROC its own" in resume_hint(8)
    monkeypatch.delenv(NODES_ENV)  # started by torchrun itself: the rendezvous endpoint is not known to the ranks
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job7")
    assert command(resume_hint(8))[4:10] == ["--nnodes", "2", "--rdzv-endpoint", "HOST:PORT", "--rdzv-id", "job7"]
    monkeypatch.setenv("GROUP_WORLD_SIZE", "1")  # one machine
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert resume_hint(8) == "resume with: toolkit launch --nproc 8 recipes/llama-tiny.yaml --set strategy.name=fsdp --resume"
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "eight")  # not a number: still a line, no traceback
    assert resume_hint(8).startswith("resume with: toolkit launch --nproc 8 ")
    monkeypatch.delenv("GROUP_WORLD_SIZE")  # DeepSpeed's launcher names them CROSS_SIZE and LOCAL_SIZE
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setenv("CROSS_SIZE", "2")
    monkeypatch.setenv("LOCAL_SIZE", "4")
    assert command(resume_hint(8))[:6] == ["toolkit", "launch", "--nproc", "4", "--nnodes", "2"]


def test_toolkit_launch_hands_its_machines_options_to_its_ranks(monkeypatch):
    import torch.distributed.run

    import toolkit.launch.launcher
    from toolkit.launch.launcher import NODES_ENV, Nodes, launch

    seen = []
    monkeypatch.setenv(NODES_ENV, "before")  # restored after the test
    monkeypatch.setattr(toolkit.launch.launcher, "prepare_environment", lambda: None)  # the ranks' settings: not for pytest
    monkeypatch.setattr(torch.distributed.run, "run", lambda args: seen.append(os.environ[NODES_ENV]))
    nodes = Nodes(count=2, rank=1, endpoint="node001:29500", run_id="job7", local_addr="10.0.0.2")
    assert launch("recipe.yaml", nproc=4, overrides=[], nodes=nodes) == 0
    assert launch("recipe.yaml", nproc=4, overrides=[]) == 0
    assert seen == ["--nnodes 2 --rdzv-endpoint node001:29500 --rdzv-id job7", ""]
