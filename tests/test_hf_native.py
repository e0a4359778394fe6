"""`hf_native` (toolkit/strategies/hf_native.py): transformers' own ND layouts (DistributedConfig: fsdp, tp, ep),
loaded through from_pretrained(distributed_config=...) and driven by the toolkit's loop, against a single process:
a peer implementation checked against the same reference as every toolkit arm (real processes, gloo, fp32)."""

import json

import pytest
from conftest import assert_matches_single, run_cli, write_recipe

from toolkit.config.files import recipe_from_dict
from toolkit.errors import RecipeError
from toolkit.strategies import validate_strategy

HF = ("strategy.name=hf_native", "batch.micro_batch_size=4")  # fsdp 2
HF_TP2 = ("strategy.name=hf_native", "strategy.tp_degree=2")  # tp 2: both ranks read the one data shard
HF_HSDP = ("strategy.name=hf_native", "strategy.replicate_degree=2", "batch.micro_batch_size=2")  # 2 × fsdp 2
HF_EP2 = ("strategy.name=hf_native", "strategy.ep_degree=2", "batch.micro_batch_size=4")  # fsdp 2, ep 2
HF_EP2_4 = ("strategy.name=hf_native", "strategy.ep_degree=2", "batch.micro_batch_size=2")  # fsdp 4, ep 2: efsdp 2


@pytest.mark.parametrize("fixture, name, nproc, overrides", [
    ("llama_runs", "hf-native", 2, HF), ("llama_runs", "hf-native-tp2", 2, HF_TP2),
    ("llama_runs", "hf-native-hsdp", 4, HF_HSDP),
    ("moe_runs", "hf-native-ep2", 2, HF_EP2), ("moe_runs", "hf-native-ep2-4ranks", 4, HF_EP2_4)])
def test_transformers_layouts_train_as_one_process(request, fixture, name, nproc, overrides):
    runs = request.getfixturevalue(fixture)
    run = runs.get(name, nproc=nproc, overrides=overrides)
    assert_matches_single(run, runs.get("single-m8"))
    info = json.loads((run / "run.json").read_text())
    assert info["strategy"] == "hf_native" and info["layout"].startswith("transformers' DistributedConfig: ")
    # the starting weights' folder from_pretrained read is gone; the exported config carries no layout
    assert not (run / ".hf_native-start").exists()
    assert "distributed_config" not in json.loads((run / "model" / "config.json").read_text())
    if fixture == "moe_runs":  # its experts were routed the tokens single's were
        reference = json.loads((runs.get("single-m8") / "run.json").read_text())
        assert info["experts"] == reference["experts"]


def recipe(strategy, model_dir, **sections):
    return recipe_from_dict({"model": {"path": str(model_dir), "task": "causal-lm"}, "data": {"train": "t.jsonl"},
                             "strategy": {"name": "hf_native", **strategy},
                             "batch": {"global_batch_size": 8, "micro_batch_size": 1}, **sections})


@pytest.mark.parametrize("strategy, sections, world_size, words", [
    ({}, {"precision": "fp16"}, 2, "hf_native runs fp32 or bf16"),
    ({}, {}, 1, "hf_native needs 2 or more ranks"),
    ({"ep_degree": 4}, {}, 2, "strategy.ep_degree 4 must be a multiple of tp_degree 1 and divide fsdp × tp = 2"),
    ({"tp_degree": 3}, {}, 4, "strategy.tp_degree 3 × replicate_degree 1 does not divide the 4 ranks"),
    ({}, {"train": {"activation_checkpointing": True}}, 2, "train.activation_checkpointing is not available with "
                                                            "hf_native yet"),
])
def test_what_hf_native_cannot_run_is_refused_in_one_line(tiny_moe_dir, strategy, sections, world_size, words):
    with pytest.raises(RecipeError) as refused:
        validate_strategy(recipe(strategy, tiny_moe_dir, **sections), world_size=world_size)
    assert str(refused.value).startswith(words) and "\n" not in str(refused.value), str(refused.value)


def test_hf_native_on_a_classifier_exits_2(tmp_path, tiny_bert_dir):
    path = write_recipe(tmp_path / "r.yaml", model_dir=tiny_bert_dir, task="sequence-classification",
                        output_dir=tmp_path / "out")
    done = run_cli("validate", str(path), "--nproc", "2", "--set", "strategy.name=hf_native")
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "toolkit: error: hf_native lays out causal LMs (transformers' plans are written for them); model.task is "
        "sequence-classification; use another strategy"], done.stderr
