"""DeepSpeed JSONs that passed the launcher's check and then ran something else than the toolkit reported, or
crashed every rank: a missing stage, a misspelled or removed top-level key, a number written as a string, an
optimizer with no op on this machine. Each is checked before any rank starts (`toolkit validate`)."""

import json

import pytest

from conftest import write_recipe
from toolkit.cli import main
from toolkit.config.files import load_recipe
from toolkit.config.recipe import plan_batch
from toolkit.strategies.zero.config import configured_stage, resolve_ds_config


def _recipe(tmp_path, tiny_llama_dir, config: dict, **strategy):
    """A zero recipe over `config` written as JSON; micro 8 × accum 1 (× 2 ranks = train_batch_size 16), fp32."""
    ds_config = tmp_path / "ds.json"
    ds_config.write_text(json.dumps(config))
    out = tmp_path / "out"
    path = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=out,
                        strategy={"name": "zero", "ds_config": str(ds_config), **strategy})
    return path, ds_config, out


def _one_line_exit_2(code, capsys, words, out):
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert len(err) == 1 and err[0].startswith("toolkit: error:") and all(w in err[0] for w in words), err
    assert not out.exists()


@pytest.mark.parametrize("config", [{}, {"zero_optimization": {}}, {"zero_optimization": {"stage": "auto"}}],
                         ids=["no block", "no stage", "stage auto"])
@pytest.mark.parametrize("recipe_stage, stage", [(None, 2), (3, 3)])
def test_a_json_without_a_stage_gives_deepspeed_the_stage_the_toolkit_reports(tmp_path, tiny_llama_dir, config,
                                                                              recipe_stage, stage):
    """DeepSpeed's own default is stage 0; the toolkit reported (layout, plan, audit) strategy.stage, else 2."""
    path, _, _ = _recipe(tmp_path, tiny_llama_dir, config, **({"stage": recipe_stage} if recipe_stage else {}))
    recipe = load_recipe(path)
    resolved = resolve_ds_config(recipe, plan_batch(recipe.batch, world_size=2))
    assert resolved["zero_optimization"]["stage"] == stage == configured_stage(recipe)


def test_a_key_written_twice_in_the_json_is_one_line(tmp_path, tiny_llama_dir, capsys):
    """json.loads keeps the last of two "stage" keys without a word; DeepSpeed refuses such a file read by path."""
    path, ds_config, out = _recipe(tmp_path, tiny_llama_dir, {})
    ds_config.write_text('{"zero_optimization": {"stage": 3, "overlap_comm": true, "stage": 1}}')
    _one_line_exit_2(main(["validate", "--nproc", "2", str(path)]), capsys,
                     (str(ds_config), "has the key 'stage' twice"), out)


@pytest.mark.parametrize("stage", [True, 2.0, "2"])
def test_a_stage_that_is_no_whole_number_is_one_line(tmp_path, tiny_llama_dir, capsys, stage):
    path, ds_config, out = _recipe(tmp_path, tiny_llama_dir, {"zero_optimization": {"stage": stage}})
    _one_line_exit_2(main(["validate", "--nproc", "2", str(path)]), capsys,
                     (str(ds_config), "zero_optimization.stage must be 0, 1, 2 or 3"), out)


@pytest.mark.parametrize("typo, key", [
    ("zero_optimisation", "zero_optimization"), ("gradient_clip", "gradient_clipping"), ("fp_16", "fp16"),
    ("train_micro_batch_size_per_gpus", "train_micro_batch_size_per_gpu")])
def test_a_top_level_key_a_typo_away_from_deepspeeds_is_one_line(tmp_path, tiny_llama_dir, capsys, typo, key):
    """DeepSpeed ignores a key it does not read: "zero_optimisation": {"stage": 3} ran stage 0."""
    value = {"zero_optimisation": {"stage": 3}, "gradient_clip": 1.0, "fp_16": {"enabled": False},
             "train_micro_batch_size_per_gpus": 8}[typo]
    path, ds_config, out = _recipe(tmp_path, tiny_llama_dir, {typo: value})
    _one_line_exit_2(main(["validate", "--nproc", "2", str(path)]), capsys,
                     (str(ds_config), f"'{typo}' is no key DeepSpeed reads", f"did you mean '{key}'"), out)
    # the key spelled right runs; a key far from every one DeepSpeed reads passes through as before
    path, _, _ = _recipe(tmp_path, tiny_llama_dir, {key: value, "comment": "tried on CPU"})
    assert main(["validate", "--nproc", "2", str(path)]) == 0, capsys.readouterr().err


def test_a_top_level_key_deepspeed_removed_is_one_line(tmp_path, tiny_llama_dir, capsys):
    path, ds_config, out = _recipe(tmp_path, tiny_llama_dir, {"nebula": {"enabled": True},
                                                              "zero_optimization": {"stage": 2}})
    _one_line_exit_2(main(["validate", "--nproc", "2", str(path)]), capsys,
                     (str(ds_config), "DeepSpeed refuses it", "Nebula", "remove that key"), out)


@pytest.mark.parametrize("key, value, kind", [
    ("train_micro_batch_size_per_gpu", "8", "a whole number"), ("gradient_accumulation_steps", "1", "a whole number"),
    ("train_batch_size", 16.0, "a whole number"), ("gradient_clipping", "1.0", "a number")])
def test_a_batch_or_clipping_value_deepspeed_cannot_compute_with_is_one_line(tmp_path, tiny_llama_dir, capsys,
                                                                             key, value, kind):
    """Equal to the recipe's as a number, so it passed; DeepSpeed's batch assertion raised a TypeError per rank."""
    path, ds_config, out = _recipe(tmp_path, tiny_llama_dir, {key: value, "zero_optimization": {"stage": 2}})
    _one_line_exit_2(main(["validate", "--nproc", "2", str(path)]), capsys,
                     (str(ds_config), f"{key} is {value!r}", f"must be {kind}", "\"auto\""), out)


@pytest.mark.parametrize("kind", ["Lion", "Lamb", "MuAdam"])
def test_an_optimizer_deepspeed_cannot_build_here_is_one_line(tmp_path, tiny_llama_dir, capsys, kind):
    """On DeepSpeed's CPU accelerator FusedLion and FusedLamb raise "This op had not been implemented" on every rank;
    the mu* types import the mup package, not installed here."""
    config = {"zero_optimization": {"stage": 2}, "optimizer": {"type": kind, "params": {"lr": "auto"}}}
    path, ds_config, out = _recipe(tmp_path, tiny_llama_dir, config)
    words = ("needs the mup package",) if kind == "MuAdam" else (
        "no implementation on DeepSpeed's cpu accelerator", "use one of adam, adamw, adagrad")
    _one_line_exit_2(main(["validate", "--nproc", "2", str(path)]), capsys,
                     (str(ds_config), f"optimizer.type '{kind}'", *words), out)


def test_lion_with_an_offloaded_optimizer_is_deepspeeds_cpu_lion(tmp_path, tiny_llama_dir, capsys):
    """Offloaded, DeepSpeed builds DeepSpeedCPULion, which the CPU accelerator has; FusedLamb it has in neither."""
    offload = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    lion = {"zero_optimization": offload, "optimizer": {"type": "Lion", "params": {"lr": "auto"}}}
    path, _, _ = _recipe(tmp_path, tiny_llama_dir, lion)
    assert main(["validate", "--nproc", "2", str(path)]) == 0, capsys.readouterr().err
    lamb = {**lion, "optimizer": {"type": "Lamb", "params": {"lr": "auto"}}}
    path, ds_config, out = _recipe(tmp_path, tiny_llama_dir, lamb)
    _one_line_exit_2(main(["validate", "--nproc", "2", str(path)]), capsys,
                     (str(ds_config), "'Lamb'", "with an offloaded optimizer", "adam, adamw, adagrad, lion"), out)


def test_a_run_whose_deepspeed_op_is_not_built_yet_says_it_compiles_it(tmp_path, monkeypatch):
    """DeepSpeed compiles an op with ninja the first time a process loads it (CPU Adam ~40 s on 2 cores, FusedAdam
    ~80 s): the first ZeRO run on a machine sat silent that long before its first step. engine.setup says so in one
    line where the optimizer's op is in neither DeepSpeed's installed ops nor torch's extensions cache."""
    from toolkit.strategies.zero.optim import optimizer_op, to_compile

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # an empty cache
    assert optimizer_op({}, offload_optimizer=False) is None  # the recipe's AdamW from torch: no op
    assert optimizer_op({}, offload_optimizer=True) == "CPUAdamBuilder"  # optim.cpu_adam_like
    assert to_compile("CPUAdamBuilder") == ("cpu_adam", tmp_path / "cpu_adam")
    (tmp_path / "cpu_adam" / "cpu_adam.so").write_bytes(b"")  # what a finished build leaves
    assert to_compile("CPUAdamBuilder") is None
    # a JSON's optimizer block: its type's op, offloaded or not; torch's Adam (torch_adam) and SGD load none
    assert optimizer_op({"optimizer": {"type": "AdamW"}}, offload_optimizer=False) == "FusedAdamBuilder"
    assert optimizer_op({"optimizer": {"type": "Adagrad"}}, offload_optimizer=True) == "CPUAdagradBuilder"
    assert optimizer_op({"optimizer": {"type": "Adam", "params": {"torch_adam": True}}},
                        offload_optimizer=False) is None
    assert optimizer_op({"optimizer": {"type": "SGD"}}, offload_optimizer=False) is None
    assert to_compile("FusedAdamBuilder") == ("fused_adam", tmp_path / "fused_adam")
    assert to_compile("FusedLambBuilder") is None  # no op of the CPU accelerator: refused before ranks start
