"""More than one machine: `toolkit launch --nnodes 2` meets at torchrun's c10d rendezvous. Two launchers of one
rank each on 127.0.0.1 act as two nodes and must train exactly what one node of two ranks trains."""

import os
import shlex
import socket
import subprocess
import sys

import pytest

import test_sharded
from conftest import REPO, metrics, toolkit_env
from toolkit.cli import main

COMPARED = ("step", "loss", "lr", "grad_norm", "tokens", "samples")
ARMS = {"ddp-m4": ("strategy.name=ddp", "batch.micro_batch_size=4"), "fsdp": test_sharded.ARMS["fsdp"]}


@pytest.mark.parametrize("name", list(ARMS))
def test_two_nodes_of_one_rank_train_as_one_node_of_two(llama_runs, name, tmp_path):
    reference = llama_runs.get(name, nproc=2, overrides=ARMS[name])
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = tmp_path / "two-nodes"
    sets = [a for o in (*ARMS[name], f"output_dir={out}") for a in ("--set", o)]
    nodes = [subprocess.Popen([sys.executable, "-m", "toolkit", "launch", "--nnodes", "2", "--node-rank", str(rank),
                               "--nproc", "1", "--rdzv-endpoint", f"127.0.0.1:{port}", "--local-addr", "127.0.0.1",
                               str(llama_runs.recipe), *sets], cwd=REPO, env=toolkit_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    logs = [node.communicate(timeout=600)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(log[-3000:] for log in logs)
    assert sum("[toolkit] strategy" in log for log in logs) == 1  # one global rank 0, on whichever node
    got, want = metrics(out), metrics(reference)
    assert [{k: m[k] for k in COMPARED} for m in got] == [{k: m[k] for k in COMPARED} for m in want]


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
    from toolkit.launch import NODES_ENV, Nodes, resume_hint

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


def test_toolkit_launch_hands_its_machines_options_to_its_ranks(monkeypatch):
    import torch.distributed.run

    import toolkit.launch
    from toolkit.launch import NODES_ENV, Nodes, launch

    seen = []
    monkeypatch.setenv(NODES_ENV, "before")  # restored after the test
    monkeypatch.setattr(toolkit.launch, "prepare_environment", lambda: None)  # the ranks' settings: not for pytest
    monkeypatch.setattr(torch.distributed.run, "run", lambda args: seen.append(os.environ[NODES_ENV]))
    nodes = Nodes(count=2, rank=1, endpoint="node001:29500", run_id="job7", local_addr="10.0.0.2")
    assert launch("recipe.yaml", nproc=4, overrides=[], nodes=nodes) == 0
    assert launch("recipe.yaml", nproc=4, overrides=[]) == 0
    assert seen == ["--nnodes 2 --rdzv-endpoint node001:29500 --rdzv-id job7", ""]
