"""More than one machine: `toolkit launch --nnodes 2` meets at torchrun's c10d rendezvous. Two launchers of one
rank each on 127.0.0.1 act as two nodes and must train exactly what one node of two ranks trains."""

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
