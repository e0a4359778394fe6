"""The DeepSpeed JSON passthrough: "auto" values take the recipe's numbers; a contradiction exits 2."""

import json

import pytest

from conftest import REPO, write_recipe
from toolkit.cli import main
from toolkit.errors import RecipeError
from toolkit.recipe import load_recipe, plan_batch
from toolkit.strategies.zero_config import resolve_ds_config


def _recipe(tmp_path, tiny_llama_dir, ds_config, **sections):
    path = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=tmp_path / "out",
                        strategy={"name": "zero", "ds_config": str(ds_config)},
                        batch={"micro_batch_size": 2, "grad_accum_steps": 3}, precision="bf16",
                        optim={"max_grad_norm": 0.5}, **sections)
    return path, load_recipe(path)


def test_shipped_json_autos_resolve_to_the_recipe(tmp_path, tiny_llama_dir):
    _, recipe = _recipe(tmp_path, tiny_llama_dir, REPO / "ds_configs" / "zero3-offload.json")
    config = resolve_ds_config(recipe, plan_batch(recipe.batch, world_size=2))
    assert config["train_micro_batch_size_per_gpu"] == 2
    assert config["gradient_accumulation_steps"] == 3
    assert config["train_batch_size"] == 12
    assert config["gradient_clipping"] == 0.5
    assert config["bf16"]["enabled"] is True and config["fp16"]["enabled"] is False
    assert config["zero_optimization"]["stage"] == 3
    assert config["zero_optimization"]["offload_param"]["device"] == "cpu"


@pytest.mark.parametrize("key, value, words", [
    ("gradient_accumulation_steps", 4, "gradient_accumulation_steps is 4 but the recipe gives 3"),
    ("train_micro_batch_size_per_gpu", 8, "train_micro_batch_size_per_gpu is 8 but the recipe gives 2"),
    ("bf16", {"enabled": False}, "bf16.enabled is False but the recipe gives True"),
])
def test_contradicting_json_exits_2(tmp_path, tiny_llama_dir, capsys, key, value, words):
    config = json.loads((REPO / "ds_configs" / "zero2.json").read_text())
    config[key] = value
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(config))
    path, recipe = _recipe(tmp_path, tiny_llama_dir, bad)
    with pytest.raises(RecipeError, match=words):
        resolve_ds_config(recipe, plan_batch(recipe.batch, world_size=2))
    assert main(["validate", "--nproc", "2", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0] and str(bad) in err[0]


def test_recipe_stage_contradicting_json_exits_2(tmp_path, tiny_llama_dir, capsys):
    path, _ = _recipe(tmp_path, tiny_llama_dir, REPO / "ds_configs" / "zero2.json")
    assert main(["validate", "--nproc", "2", str(path), "--set", "strategy.stage=3"]) == 2
    assert "strategy.stage is 3 but" in capsys.readouterr().err


def test_ds_config_optimizer_blocks_give_way_to_the_recipe_with_one_line(tmp_path, tiny_llama_dir):
    from conftest import run_cli

    config = json.loads((REPO / "ds_configs" / "zero2.json").read_text())
    config["optimizer"] = {"type": "Adam", "params": {"lr": 0.5}}
    config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 100}}
    blocks = tmp_path / "with-optimizer.json"
    blocks.write_text(json.dumps(config))
    out = tmp_path / "out"
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=out,
                          strategy={"name": "zero", "ds_config": str(blocks)}, train={"max_steps": 2})
    result = run_cli("train", str(recipe))  # one rank: DeepSpeed gets a process group of one
    assert result.returncode == 0, result.stderr[-3000:]
    said = [line for line in result.stderr.splitlines() if "not used" in line]
    assert said == [f"[toolkit] zero: the optimizer and scheduler blocks of {blocks} are not used: the recipe's "
                    "optim section wins (lr 0.001, cosine schedule)"]
    run = json.loads((out / "run.json").read_text())
    assert run["precision_audit"]["optimizer"].startswith("torch AdamW")
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps[0]["lr"] == pytest.approx(1e-3 / 3)  # the recipe's warm-up (2 steps), not the block's lr 0.5
