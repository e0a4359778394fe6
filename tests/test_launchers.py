"""toolkit launch, torchrun and accelerate launch run the same job and log the same metrics."""

import subprocess
import sys

import pytest

from conftest import REPO, metrics, toolkit_env

COMPARED = ("step", "loss", "lr", "grad_norm", "tokens", "samples")


def _run(cmd, tmp_path):
    result = subprocess.run(cmd, cwd=REPO, env=toolkit_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-5000:]
    assert "terminate called" not in result.stderr, result.stderr[-5000:]


@pytest.mark.parametrize("config, arm", [
    ("fsdp.yaml", ("fsdp", ("strategy.name=fsdp", "batch.micro_batch_size=4"))),
    ("deepspeed.yaml", ("zero2-json", ("strategy.name=zero", f"strategy.ds_config={REPO}/ds_configs/zero2.json",
                                       "batch.micro_batch_size=4"))),
])
def test_accelerate_plugin_configs_match_toolkit_launch(llama_runs, config, arm, tmp_path):
    name, overrides = arm
    reference = llama_runs.get(name, nproc=2, overrides=overrides)
    out = tmp_path / "acc"
    # the recipe names no strategy: the accelerate config file chooses FSDP / ZeRO-2
    _run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
          str(REPO / "recipes" / "accelerate" / config), "-m", "toolkit", "train", str(llama_runs.recipe),
          "--set", "batch.micro_batch_size=4", "--set", f"output_dir={out}"], tmp_path)
    got, want = metrics(out), metrics(reference)
    assert [{k: m[k] for k in COMPARED} for m in got] == [{k: m[k] for k in COMPARED} for m in want]


def test_accelerate_config_contradicting_recipe_exits_2(llama_runs, tmp_path):
    result = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                             str(REPO / "recipes" / "accelerate" / "fsdp.yaml"), "-m", "toolkit", "train",
                             str(llama_runs.recipe), "--set", "strategy.name=ddp",
                             "--set", f"output_dir={tmp_path / 'x'}"],
                            cwd=REPO, env=toolkit_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode != 0
    assert "toolkit: error: accelerate launch sets strategy.name='fsdp' (ACCELERATE_USE_FSDP) but the recipe has " \
           "strategy.name='ddp'" in result.stderr
    assert not (tmp_path / "x").exists()


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


def test_fsdp_runs_as_one_rank_without_a_launcher(llama_runs, tmp_path):
    from conftest import run_cli

    out = tmp_path / "one-rank"
    result = run_cli("train", str(llama_runs.recipe), "--set", "strategy.name=fsdp", "--set", f"output_dir={out}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[toolkit] fsdp on one rank (a process group of one); `toolkit launch --nproc N` runs N ranks" \
        in result.stderr
    # one rank holding every shard computes what the single-process reference computes
    got, want = metrics(out), metrics(llama_runs.get("single-m8"))
    assert [m["loss"] for m in got] == pytest.approx([m["loss"] for m in want], rel=1e-5)
