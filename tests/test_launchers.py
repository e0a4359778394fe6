"""toolkit launch, torchrun and accelerate launch run the same job and log the same metrics."""

import subprocess
import sys

import pytest

from conftest import REPO, metrics, toolkit_env

COMPARED = ("step", "loss", "lr", "grad_norm", "tokens", "samples")


def _run(cmd, tmp_path):
    result = subprocess.run(cmd, cwd=REPO, env=toolkit_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-5000:]


@pytest.mark.parametrize("launcher", ["torchrun", "accelerate"])
def test_launch_paths_give_the_same_metrics(llama_runs, launcher, tmp_path):
    reference = llama_runs.get("ddp-m4", nproc=2, overrides=("strategy.name=ddp", "batch.micro_batch_size=4"))
    out = tmp_path / launcher
    args = ["-m", "toolkit", "train", str(llama_runs.recipe), "--set", "strategy.name=ddp",
            "--set", "batch.micro_batch_size=4", "--set", f"output_dir={out}"]
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args]
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(REPO / "recipes" / "accelerate" / "ddp.yaml"), *args]
    _run(cmd, tmp_path)
    got, want = metrics(out), metrics(reference)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert {k: a[k] for k in COMPARED} == {k: b[k] for k in COMPARED}
