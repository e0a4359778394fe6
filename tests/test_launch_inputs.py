"""What a user gives `toolkit validate` / `toolkit launch` beside the recipe's own keys (paths with `~`, trackers'
stores, the rendezvous endpoint, checks only the ranks used to make): exit code 2, one line naming the fix, before
anything is written. `toolkit launch` on one machine leaves these checks to its ranks (they import what the checks
need anyway), which say the line themselves: those tests read the file descriptors (capfd), as a terminal shows
them, not only what the launcher's Python printed."""

from __future__ import annotations

import os
import signal

import pytest
import yaml

from conftest import TRAIN, write_recipe
from toolkit.cli import main


def _recipe(tmp_path, model_dir, **sections):
    out = tmp_path / "out"
    return write_recipe(tmp_path / "r.yaml", model_dir=model_dir, output_dir=out, **sections), out


def _one_line_exit_2(code, captured, words, out=None):
    """`captured`: capsys, or capfd where the ranks of a launch say the line."""
    err = captured.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("toolkit: error:") and words in err[0], err
    assert out is None or not out.exists()


# --- paths -----------------------------------------------------------------------------------------------------

def test_tilde_is_the_home_folder_in_every_path_key(tmp_path, tiny_llama_dir, monkeypatch, capsys):
    home = tmp_path / "home"
    home.mkdir()
    (home / "train.jsonl").write_text(open(TRAIN).read())
    monkeypatch.setenv("HOME", str(home))
    recipe, _ = _recipe(tmp_path, tiny_llama_dir)
    sets = ["data.train=~/train.jsonl", "data.eval=~/train.jsonl", "output_dir=~/run", "train.tracking_dir=~/tb",
            "train.report_to=tensorboard"]
    assert main(["validate", str(recipe), *[a for s in sets for a in ("--set", s)]]) == 0
    resolved = yaml.safe_load(capsys.readouterr().out)
    assert resolved["data"]["train"] == resolved["data"]["eval"] == str(home / "train.jsonl")
    assert resolved["output_dir"] == str(home / "run")
    assert resolved["train"]["tracking_dir"] == str(home / "tb")
    assert not (tmp_path / "~").exists() and not os.path.exists("~")
    from toolkit.config.files import load_recipe, path_keys

    every = load_recipe(recipe, [*(f"{key}=~/{key}" for key in path_keys() if key != "model.path"),
                                 "train.report_to=tensorboard"])
    assert every.strategy.ds_config == str(home / "strategy.ds_config")
    assert every.model.tokenizer == str(home / "model.tokenizer")


@pytest.mark.parametrize("key", ["output_dir", "data.eval", "train.tracking_dir", "model.tokenizer"])
def test_an_empty_path_is_one_line(key, tmp_path, tiny_llama_dir, capsys):
    recipe, out = _recipe(tmp_path, tiny_llama_dir)
    _one_line_exit_2(main(["validate", str(recipe), "--set", f"{key}="]), capsys, f"{key} is empty", out)


def test_compare_takes_a_saved_tilde_path_for_the_same_setting(tmp_path, tiny_llama_dir, monkeypatch):
    """An arm saved before `~` was expanded when the recipe is built is still the same run."""
    from toolkit.compare.experiment import Arm, Experiment
    from toolkit.compare.runner import settings_difference
    from toolkit.config.files import dump_recipe, load_recipe

    monkeypatch.setenv("HOME", str(tiny_llama_dir.parent))
    recipe, _ = _recipe(tmp_path, tiny_llama_dir)
    arm_dir = tmp_path / "arm"
    arm_dir.mkdir()
    saved = dump_recipe(load_recipe(recipe)).replace(str(tiny_llama_dir), f"~/{tiny_llama_dir.name}")
    assert f"~/{tiny_llama_dir.name}" in saved
    (arm_dir / "recipe.yaml").write_text(saved)
    (arm_dir / "run.json").write_text('{"world_size": 1, "status": "completed"}')
    experiment = Experiment(recipe=str(recipe), out_dir=tmp_path, arms=[Arm(name="arm", overrides=(), nproc=1)],
                            common=[])
    assert settings_difference(experiment, experiment.arms[0], arm_dir) is None


def test_compare_takes_an_arm_saved_before_a_key_existed_at_its_default(tmp_path, tiny_llama_dir):
    """A run saved by a toolkit without a recipe key (train.tiled_loss, here) computed what its default computes; the
    same key set away from its default is a difference."""
    import yaml

    from toolkit.compare.experiment import Arm, Experiment
    from toolkit.compare.runner import settings_difference
    from toolkit.config.files import dump_recipe, load_recipe

    recipe, _ = _recipe(tmp_path, tiny_llama_dir)
    arm_dir = tmp_path / "arm"
    arm_dir.mkdir()
    saved = yaml.safe_load(dump_recipe(load_recipe(recipe)))
    del saved["train"]["tiled_loss"]
    (arm_dir / "recipe.yaml").write_text(yaml.safe_dump(saved))
    (arm_dir / "run.json").write_text('{"world_size": 1, "status": "completed"}')
    experiment = Experiment(recipe=str(recipe), out_dir=tmp_path, arms=[Arm(name="arm", overrides=(), nproc=1)],
                            common=[])
    assert settings_difference(experiment, experiment.arms[0], arm_dir) is None
    tiled = Experiment(recipe=str(recipe), out_dir=tmp_path, arms=[Arm(name="arm", overrides=(), nproc=1)],
                       common=["train.tiled_loss=true"])
    assert settings_difference(tiled, tiled.arms[0], arm_dir) == "train.tiled_loss: None then, True now"



def test_compare_takes_a_measured_block_time_ratio_as_the_arm_it_asked_for(tmp_path, tiny_llama_dir):
    """An arm under strategy.split_by=time records the ratio it measured in its recipe.yaml; rerun into the same
    --output, that arm is the one asked for (no ratio given), and a ratio asked for that differs is not."""
    import yaml

    from toolkit.compare.experiment import Arm, Experiment
    from toolkit.compare.runner import settings_difference
    from toolkit.config.files import dump_recipe, load_recipe

    recipe, _ = _recipe(tmp_path, tiny_llama_dir)
    arm_dir = tmp_path / "arm"
    arm_dir.mkdir()
    timed = ("strategy.name=pipeline", "strategy.split_by=time")
    saved = yaml.safe_load(dump_recipe(load_recipe(recipe, list(timed))))
    saved["strategy"]["block_time_ratio"] = 1.3
    (arm_dir / "recipe.yaml").write_text(yaml.safe_dump(saved))
    (arm_dir / "run.json").write_text('{"world_size": 2, "status": "completed"}')
    experiment = Experiment(recipe=str(recipe), out_dir=tmp_path, arms=[Arm(name="arm", overrides=timed, nproc=2)],
                            common=[])
    assert settings_difference(experiment, experiment.arms[0], arm_dir) is None
    pinned = Experiment(recipe=str(recipe), out_dir=tmp_path, common=[],
                        arms=[Arm(name="arm", overrides=(*timed, "strategy.block_time_ratio=2"), nproc=2)])
    assert settings_difference(pinned, pinned.arms[0], arm_dir) == "strategy.block_time_ratio: 1.3 then, 2.0 now"

# --- trackers --------------------------------------------------------------------------------------------------

def test_mlflow_file_store_is_one_line_before_anything_is_written(tmp_path, tiny_llama_dir, monkeypatch, capfd):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path}/mlruns")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    recipe, out = _recipe(tmp_path, tiny_llama_dir, train={"report_to": ["mlflow"]})
    _one_line_exit_2(main(["launch", str(recipe)]), capfd, "MLFLOW_ALLOW_FILE_STORE=true", out)
    assert not (tmp_path / "mlruns").exists()


@pytest.mark.parametrize("store, words", [
    ("/proc/nope/mlflow.db", "cannot be made: its folder /proc/nope: no folder can be made in /proc"),
    ("notadb.db", "is not a SQLite database file"),
    (".", "is a folder, not a SQLite file; fix or unset MLFLOW_TRACKING_URI"),
])
def test_mlflow_sqlite_store_mlflow_cannot_open_is_one_line_before_ranks_start(store, words, tmp_path,
                                                                               tiny_llama_dir, monkeypatch, capsys):
    (tmp_path / "notadb.db").write_text("garbage, not a database\n")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{(tmp_path / store).resolve()}")
    recipe, out = _recipe(tmp_path, tiny_llama_dir, train={"report_to": ["mlflow"]})
    _one_line_exit_2(main(["validate", str(recipe)]), capsys, words, out)
    assert (tmp_path / "notadb.db").read_text() == "garbage, not a database\n"  # the user's file, untouched


def test_tracking_dir_that_is_a_file_is_one_line(tmp_path, tiny_llama_dir, capfd):
    (tmp_path / "afile").write_text("")
    recipe, out = _recipe(tmp_path, tiny_llama_dir,
                          train={"report_to": ["tensorboard"], "tracking_dir": str(tmp_path / "afile")})
    _one_line_exit_2(main(["launch", str(recipe)]), capfd, "is a file, not a folder; choose another "
                     "train.tracking_dir", out)


# --- the rendezvous endpoint -----------------------------------------------------------------------------------

@pytest.mark.parametrize("nodes, endpoint, words", [
    ((), "127.0.0.1:99999", "port 99999 is outside 1..65535"),
    ((), "nosuchhost.invalid:29500", "cannot resolve the host 'nosuchhost.invalid'"),
    (("--nnodes", "2"), "nosuchhost.invalid:29500", "cannot resolve the host 'nosuchhost.invalid'"),
])
def test_bad_rdzv_endpoint_is_one_line_before_the_recipe_is_read(nodes, endpoint, words, tmp_path, capsys):
    out = tmp_path / "out"
    code = main(["launch", *nodes, "--rdzv-endpoint", endpoint, str(tmp_path / "no-recipe.yaml")])
    _one_line_exit_2(code, capsys, words, out)


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_busy_port_on_one_machine_is_one_line_at_once(tmp_path, capsys):
    """A one-machine launch hosts the rendezvous: on a port another server holds, torch's agent would join that
    server and wait out its timeout. Before: minutes, then the line; now the line before the recipe is read."""
    import socket

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        code = main(["launch", "--rdzv-endpoint", f"127.0.0.1:{port}", str(tmp_path / "no-recipe.yaml")])
    _one_line_exit_2(code, capsys, f"port {port} is already in use on this machine", tmp_path / "out")
    # a job over machines: the port may be the other launcher's store on this host, so it is not probed
    code = main(["launch", "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", str(tmp_path / "no-recipe.yaml")])
    _one_line_exit_2(code, capsys, "no-recipe.yaml", tmp_path / "out")


def test_a_failed_rendezvous_on_one_machine_is_one_line(tmp_path, tiny_llama_dir, monkeypatch, capsys):
    import torch.distributed.run
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    from toolkit.launch.launcher import NODES_ENV

    def refused(args):
        raise RendezvousConnectionError("The connection to the C10d store has failed.")

    monkeypatch.setattr(torch.distributed.run, "run", refused)
    monkeypatch.delenv(NODES_ENV, raising=False)
    recipe, out = _recipe(tmp_path, tiny_llama_dir)
    usr1 = signal.getsignal(signal.SIGUSR1)
    code = main(["launch", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", str(recipe)])
    _one_line_exit_2(code, capsys, "the rendezvous failed there (RendezvousConnectionError", out)
    # what the launcher set for its ranks (SIGUSR1 forwarded as SIGTERM, the job's node options) is undone
    assert signal.getsignal(signal.SIGUSR1) == usr1 and NODES_ENV not in os.environ


# --- what `accelerate launch` exports ----------------------------------------------------------------------------

DEEPSPEED = {"ACCELERATE_USE_DEEPSPEED": "true"}
FSDP2 = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}


@pytest.mark.parametrize("environ, words", [
    ({**DEEPSPEED, "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "nvme"},
     "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE=nvme, but the recipe's offload switches offload to CPU only"),
    ({**DEEPSPEED, "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "nvme"}, "OFFLOAD_PARAM_DEVICE=nvme"),
    ({**DEEPSPEED, "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "gpu"}, "'gpu', which is not none, cpu or nvme"),
    ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "3"}, "FSDP_VERSION='3'; Accelerate has FSDP versions 1 and 2"),
    ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2.0"}, "FSDP_VERSION='2.0'"),
    ({**FSDP2, "FSDP_RESHARD_AFTER_FORWARD": "maybe"}, "FSDP_RESHARD_AFTER_FORWARD='maybe', which is not true or"),
    ({**FSDP2, "FSDP_OFFLOAD_PARAMS": "ture"}, "FSDP_OFFLOAD_PARAMS='ture'"),
    ({**FSDP2, **DEEPSPEED}, "sets both ACCELERATE_USE_FSDP and ACCELERATE_USE_DEEPSPEED"),
    ({**DEEPSPEED, "ACCELERATE_DEEPSPEED_ZERO_STAGE": "5"},
     "strategy.stage must be 0, 1, 2 or 3, got 5 (the value comes from accelerate launch: "
     "ACCELERATE_DEEPSPEED_ZERO_STAGE"),
    ({**DEEPSPEED, "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "0"}, "from accelerate launch: "
     "ACCELERATE_GRADIENT_ACCUMULATION_STEPS"),
    ({**DEEPSPEED, "ACCELERATE_GRADIENT_CLIPPING": "inf"}, "from accelerate launch: ACCELERATE_GRADIENT_CLIPPING"),
    # an accumulation that contradicts the recipe's global batch: the fix is in the accelerate config, not the recipe
    ({**DEEPSPEED, "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "16"}, "the accumulation is accelerate launch's "
     "(ACCELERATE_GRADIENT_ACCUMULATION_STEPS); remove gradient_accumulation_steps from the accelerate config file"),
])
def test_an_accelerate_value_the_toolkit_cannot_take_is_one_line_naming_it(environ, words, tmp_path, tiny_llama_dir,
                                                                           monkeypatch, capsys):
    import toolkit.process.dist

    def no_rank():  # a value taken as given would train here, and end this process (dist.exit_process)
        raise AssertionError("the rank started")

    monkeypatch.setattr(toolkit.process.dist, "init_distributed", no_rank)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    recipe, out = _recipe(tmp_path, tiny_llama_dir)
    raw = yaml.safe_load(recipe.read_text())  # accumulation and clipping left to the launcher, as it may set them
    del raw["optim"]["max_grad_norm"], raw["batch"]["grad_accum_steps"]
    raw["batch"]["global_batch_size"] = 8
    recipe.write_text(yaml.safe_dump(raw))
    _one_line_exit_2(main(["train", str(recipe)]), capsys, words, out)


def test_accelerates_own_switch_spellings_are_read_as_it_reads_them():
    from toolkit.launch.accelerate_env import launcher_settings

    settings = {s.key: s.value for s in launcher_settings({**FSDP2, "FSDP_RESHARD_AFTER_FORWARD": "off",
                                                           "FSDP_OFFLOAD_PARAMS": "Y"})}
    assert settings["strategy.reshard_after_forward"] is False and settings["strategy.cpu_offload"] is True
    settings = {s.key: s.value for s in launcher_settings({**DEEPSPEED,
                                                           "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu",
                                                           "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "none"})}
    assert settings["strategy.offload_optimizer"] is True and settings["strategy.offload_param"] is False


# --- what only the ranks found ----------------------------------------------------------------------------------

@pytest.mark.parametrize("sets, words", [
    (("model.path=null", "model.config={model_type: llama, vocab_size: 10, hidden_size: 16, intermediate_size: 32, "
      "num_hidden_layers: 1, num_attention_heads: 2}", "model.tokenizer={model}"),
     "tokenizer has 30522 tokens but the model's vocab_size is 10"),
    (("data.max_length=1",), "data.max_length 1 leaves no room for text"),
    (("strategy.name=fsdp", "strategy.blocks=[Foo]"), "no transformer blocks found (looked for ['Foo'])"),
    # DistilBERT names no blocks of its own (_no_split_modules): the line names the class its layer stack holds
    (("model.path=null", "model.task=sequence-classification", "data.label_column=label", "model.tokenizer={model}",
      "model.config={model_type: distilbert, vocab_size: 30522, dim: 32, hidden_dim: 64, n_layers: 2, n_heads: 2}",
      "strategy.name=fsdp"), "set strategy.blocks to the block class name (this model's layer stack holds "
                             "TransformerBlock: [TransformerBlock])"),
])
@pytest.mark.parametrize("command", ["validate", "launch", "compare"])
def test_what_the_ranks_found_is_checked_before_they_write(command, sets, words, tmp_path, tiny_llama_dir, capfd):
    recipe, out = _recipe(tmp_path, tiny_llama_dir)
    sets = [s.replace("{model}", str(tiny_llama_dir)) for s in sets]
    arms = []
    if command == "compare":  # the fsdp arm takes the strategy's settings; refused before any arm runs
        fsdp = [s for s in sets if s.startswith("strategy.") and s != "strategy.name=fsdp"]
        sets = [s for s in sets if not s.startswith("strategy.")]
        arms = ["--strategies", "@".join(["single,fsdp", *fsdp]), "--nproc", "2"]
    _one_line_exit_2(main([command, str(recipe), *arms, *[a for s in sets for a in ("--set", s)]]), capfd, words,
                     out)


def test_a_mistake_is_said_once_per_launch_also_by_one_rank_restarted(monkeypatch, capsys):
    """--max-restarts restarts a rank that exited 2 as any other: the next attempt must not say it again."""
    from toolkit.errors import say_once

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", f"test-{os.getpid()}-{id(capsys)}")
    monkeypatch.setenv("WORLD_SIZE", "1")
    say_once("toolkit: error: the same mistake")
    say_once("toolkit: error: the same mistake")
    assert capsys.readouterr().err.splitlines() == ["toolkit: error: the same mistake"]


def test_the_markers_that_say_a_mistake_once_go_with_the_launch(tmp_path, tiny_llama_dir, monkeypatch, capsys):
    """The ranks of a `toolkit launch` mark a said line in a folder of the launch's own, which the launcher
    removes when its ranks are done (they were left in the temporary folder, one per mistake and launch)."""
    import torch.distributed.run

    from toolkit.errors import SAID_DIR_ENV, say_once

    seen = {}

    def ranks(args):  # two ranks finding the same mistake, as the launcher's children would
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", f"test-{os.getpid()}-{id(seen)}")
        say_once("toolkit: error: the same mistake")
        say_once("toolkit: error: the same mistake")
        seen["folder"] = os.environ[SAID_DIR_ENV]
        seen["markers"] = os.listdir(seen["folder"])

    monkeypatch.setattr(torch.distributed.run, "run", ranks)
    monkeypatch.delenv(SAID_DIR_ENV, raising=False)
    recipe, _ = _recipe(tmp_path, tiny_llama_dir)
    assert main(["launch", str(recipe)]) == 0
    assert capsys.readouterr().err.splitlines().count("toolkit: error: the same mistake") == 1
    assert len(seen["markers"]) == 1 and seen["markers"][0].startswith("toolkit-said-")
    assert not os.path.exists(seen["folder"]) and SAID_DIR_ENV not in os.environ
