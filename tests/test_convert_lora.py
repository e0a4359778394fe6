"""`toolkit convert` of a LoRA run's checkpoint: a plain transformers model with the adapters merged, checked
against W + (alpha / r) · B @ A computed here from the base model and the run's exported adapter. Before, the
checkpoint was refused as one "written for another model" (it holds the adapted names, base_layer / lora_A)."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, run_cli, write_recipe

R, ALPHA = 4, 8


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_llama_dir):
    """One 2-step LoRA run with a final checkpoint, shared by this file's tests (each converts a copy or reads it)."""
    root = tmp_path_factory.mktemp("lora-run")
    recipe = write_recipe(root / "r.yaml", model_dir=tiny_llama_dir, output_dir=root / "run",
                          checkpoint={"final": True}, train={"max_steps": 2})
    lora = f"model.lora={{r: {R}, alpha: {ALPHA}, target_modules: [q_proj, v_proj]}}"
    done = run_cli("train", str(recipe), "--set", lora)
    assert done.returncode == 0, done.stderr[-3000:]
    return root / "run", done.stderr


def test_a_lora_checkpoint_converts_to_the_merged_model(lora_run, tmp_path, tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    run, stderr = lora_run
    assert "saved nowhere" not in stderr  # a pretrained base: the adapter loads onto it
    assert f"· adapter {run / 'model'} (" in stderr and "merged model" not in stderr  # (its size on disk)
    out = tmp_path / "converted"
    done = run_cli("convert", str(run / "checkpoints" / "step-00000002"), str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    base = load_file(tiny_llama_dir / "model.safetensors")
    adapter = load_file(run / "model" / "adapter_model.safetensors")
    converted = load_file(out / "model.safetensors")
    assert converted.keys() == base.keys()  # plain names: no base_layer, no lora_A
    adapted = 0
    for key, weight in base.items():
        layer = key.removesuffix(".weight")
        a = adapter.get(f"base_model.model.{layer}.lora_A.weight")
        adapted += a is not None
        want = weight if a is None else weight + (ALPHA / R) * adapter[f"base_model.model.{layer}.lora_B.weight"] @ a
        torch.testing.assert_close(converted[key], want, rtol=1e-6, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")
    assert adapted == 2 * 2  # q_proj and v_proj of 2 blocks
    assert not torch.equal(converted["model.layers.0.self_attn.q_proj.weight"],
                           base["model.layers.0.self_attn.q_proj.weight"])  # two steps moved B away from zero
    ids = torch.tensor([[1, 5, 9, 2]])
    with torch.no_grad():
        assert AutoModelForCausalLM.from_pretrained(out)(input_ids=ids).logits.isfinite().all()


@pytest.mark.parametrize("digests", ["recorded", "older checkpoint"])
@pytest.mark.parametrize("damage", ["no recipe", "bad yaml"])
def test_a_checkpoint_without_its_recipe_is_one_line(damage, digests, lora_run, tmp_path):
    """Its digests.json finds the lost or changed recipe.yaml first; a checkpoint written before digests were
    recorded (no digests.json, no "digests" in its manifest) reaches the recipe reader, which says it in one line."""
    checkpoint = tmp_path / "step-00000002"  # a copy: the shared run's checkpoint stays whole
    shutil.copytree(lora_run[0] / "checkpoints" / "step-00000002", checkpoint)
    if digests == "older checkpoint":
        (checkpoint / "digests.json").unlink()
        manifest = json.loads((checkpoint / "manifest.json").read_text())
        del manifest["digests"]
        (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    if damage == "no recipe":
        (checkpoint / "recipe.yaml").unlink()
    else:
        (checkpoint / "recipe.yaml").write_text("model: [unclosed\n")
    done = run_cli("convert", str(checkpoint), str(tmp_path / "converted"))
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(err) == 1, done.stderr
    if digests == "recorded":
        words = "recipe.yaml, listed in its digests.json, is missing" if damage == "no recipe" else \
            "is damaged: its file recipe.yaml has 17 bytes, it was saved with"
    else:
        words = "recipe.yaml is unreadable"
    assert words in err[0], err[0]
    assert not (tmp_path / "converted").exists()


def test_lora_on_a_model_from_a_config_says_the_adapter_alone_is_unusable(tmp_path):
    """The base of a model built from model.config exists only in the run: an adapter of it (base_model_name_or_path
    null) loads onto nothing. Said once, before the steps; merge_on_export writes the usable model."""
    done = run_cli("train", str(REPO / "recipes" / "llama-tiny.yaml"), "--set", "train.max_steps=1",
                   "--set", "model.lora={r: 4, target_modules: [q_proj]}", "--set", f"output_dir={tmp_path / 'run'}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("model.lora on a model built from model.config: its base weights are saved nowhere") == 1
