"""toolkit launch, torchrun and accelerate launch run the same job and log the same metrics; each of their plain
multi-rank runs (ddp through torchrun, fsdp and ZeRO-2 through accelerate launch) also ends cleanly: exit 0, no
"terminate called" (a gloo thread outliving interpreter teardown), run.json completed, no /dev/shm segment left
(test_clean_exit holds the rest of those checks)."""

import json
import subprocess
import sys

import pytest

from conftest import REPO, metrics, toolkit_env
from toolkit.process.leftovers import shm_segments

COMPARED = ("step", "loss", "lr", "grad_norm", "tokens", "samples")


def _run(cmd, out):
    """`cmd`, a plain launch of the ranks writing into `out`, as a user starts it: it finished and ended cleanly."""
    before = set(shm_segments())
    result = subprocess.run(cmd, cwd=REPO, env=toolkit_env(), capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    assert "terminate called" not in output, output[-5000:]
    assert json.loads((out / "run.json").read_text())["status"] == "completed"
    # DeepSpeed's CPU shared-memory collectives, which the toolkit does not start, make a 66 MB /dev/shm segment
    # per rank and never unlink it (toolkit/strategies/zero/comm.py skip_shm_collectives)
    assert set(shm_segments()) - before == set()


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
          "--set", "batch.micro_batch_size=4", "--set", f"output_dir={out}"], out)
    got, want = metrics(out), metrics(reference)
    assert [{k: m[k] for k in COMPARED} for m in got] == [{k: m[k] for k in COMPARED} for m in want]


def test_accelerates_own_fsdp_example_config_runs_as_it_is_on_fsdp2(llama_runs, tmp_path):
    """Accelerate's example FSDP file (version 1 keys, no fsdp_version, bf16) gives the run a plain fsdp recipe
    with precision bf16 gives, and says how each of its keys maps."""
    import test_sharded

    reference = test_sharded.bf16_run(llama_runs, "fsdp")
    out = tmp_path / "acc"
    result = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                             str(REPO / "recipes" / "accelerate" / "fsdp-v1-example.yaml"), "-m", "toolkit", "train",
                             str(llama_runs.recipe), "--set", "precision=bf16",  # the test recipe says fp32: as the file
                             "--set", "batch.micro_batch_size=4", "--set", "train.max_steps=8",
                             "--set", "optim.lr=0.003", "--set", "optim.warmup_steps=0", "--set", f"output_dir={out}"],
                            cwd=REPO, env=toolkit_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-5000:]
    said = [line.removeprefix("[toolkit] accelerate: ") for line in result.stderr.splitlines()
            if line.startswith("[toolkit] accelerate: ")]
    # the test recipe says strategy single (the default): the file's plugin replaces it, and says so first
    assert said[0] == ("strategy.name=fsdp (fsdp_sharding_strategy FULL_SHARD) replaces the recipe's "
                       "strategy.name=single (a config file without a plugin, such as ddp.yaml, leaves it)")
    assert said[1] == "fsdp_sharding_strategy FULL_SHARD → FSDP2 with strategy.reshard_after_forward=true"
    assert any(line.startswith("fsdp_state_dict_type SHARDED_STATE_DICT → affects checkpoints only") for line in said)
    for key in ("fsdp_backward_prefetch", "fsdp_use_orig_params", "fsdp_sync_module_states",
                "fsdp_cpu_ram_efficient_loading"):
        assert sum(line.startswith(f"{key} ") and "not applicable" in line for line in said) == 1, (key, said)
    got, want = metrics(out), metrics(reference)
    assert [{k: m[k] for k in COMPARED} for m in got] == [{k: m[k] for k in COMPARED} for m in want]


@pytest.mark.parametrize("strategy, expected", [
    ("SHARD_GRAD_OP", {"strategy.name": "fsdp", "strategy.reshard_after_forward": False}),
    ("2", {"strategy.name": "fsdp", "strategy.reshard_after_forward": False}),  # Accelerate's 1-based number
    ("HYBRID_SHARD", {"strategy.name": "fsdp", "strategy.reshard_after_forward": True,
                      "strategy.replicate_degree": 2}),
    ("HYBRID_SHARD_ZERO2", {"strategy.name": "fsdp", "strategy.reshard_after_forward": False,
                            "strategy.replicate_degree": 2}),
    ("NO_SHARD", {"strategy.name": "ddp", "train.activation_checkpointing": True}),
])
def test_fsdp1_sharding_strategies_map_onto_fsdp2(strategy, expected):
    from toolkit.launch.accelerate_env import launcher_settings

    # what Accelerate exports for a version-1 file on 2 nodes × 2 ranks: its defaults included
    environ = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1", "FSDP_SHARDING_STRATEGY": strategy,
               "FSDP_RESHARD_AFTER_FORWARD": "true", "FSDP_OFFLOAD_PARAMS": "false",
               "FSDP_ACTIVATION_CHECKPOINTING": "true", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}
    settings = {s.key: s.value for s in launcher_settings(environ) if s.key}
    if expected["strategy.name"] == "fsdp":
        expected = {**expected, "strategy.cpu_offload": False, "train.activation_checkpointing": True}
    assert settings == expected


def test_a_plugin_replacing_the_recipes_default_strategy_is_said():
    """fsdp.yaml / deepspeed.yaml choose the strategy of a recipe that says `single` (the default): said in one
    line, where it was silent (ddp.yaml has no plugin: the recipe's single stays, and 2 ranks refuse it)."""
    from toolkit.launch.accelerate_env import apply_launcher_settings, launcher_settings

    raw = {"strategy": {"name": "single"}}
    replaced = apply_launcher_settings(raw, launcher_settings({"ACCELERATE_USE_DEEPSPEED": "true"}))
    assert raw["strategy"]["name"] == "zero"
    assert replaced == ["strategy.name=zero (ACCELERATE_USE_DEEPSPEED) replaces the recipe's strategy.name=single "
                        "(a config file without a plugin, such as ddp.yaml, leaves it)"]
    untouched = {"strategy": {"name": "zero"}}
    assert apply_launcher_settings(untouched, launcher_settings({"ACCELERATE_USE_DEEPSPEED": "true"})) == []


def test_accelerate_config_contradicting_recipe_exits_2(llama_runs, tmp_path):
    result = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                             str(REPO / "recipes" / "accelerate" / "fsdp.yaml"), "-m", "toolkit", "train",
                             str(llama_runs.recipe), "--set", "strategy.name=ddp",
                             "--set", f"output_dir={tmp_path / 'x'}"],
                            cwd=REPO, env=toolkit_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode != 0
    assert "toolkit: error: accelerate launch sets strategy.name='fsdp' (ACCELERATE_USE_FSDP) but the recipe has " \
           "strategy.name='ddp'" in result.stderr
    assert result.stderr.count("toolkit: error:") == 1  # every rank finds it; the first one says it
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
    _run(cmd, out)
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


def test_a_launch_leaves_nothing_in_the_temporary_folder(llama_runs, tmp_path):
    # torch's agent makes a torchelastic_* log folder in the temporary folder unless told where; the ranks'
    # say_once markers go there too: the launch gives both a folder of its own and removes it when done
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {**toolkit_env(), "TMPDIR": str(temp)}
    # the degrees alone choose the layout, through the launcher as a user starts it
    result = subprocess.run([sys.executable, "-m", "toolkit", "launch", "--nproc", "2", str(llama_runs.recipe),
                             "--set", "parallel.dp_replicate=2", "--set", "train.max_steps=1",
                             "--set", f"output_dir={tmp_path / 'out'}"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in temp.iterdir()) == []
    assert "[toolkit] strategy ddp (dp_replicate 2) · world 2 · " in result.stderr
    info = json.loads((tmp_path / "out" / "run.json").read_text())
    assert info["strategy"] == "ddp" and info["parallel"]["dp_replicate"] == 2
