"""Mistakes in the model, tokenizer, DeepSpeed JSON and Accelerate settings a recipe points at: exit code 2 and
one line naming the key and the fix, found by `validate` (before any rank starts), not a traceback in training."""

import pytest

from conftest import write_recipe
from toolkit.cli import main

# a from-scratch Llama like recipes/llama-tiny.yaml, at the size of conftest's tiny Llama
TINY_LLAMA_CONFIG = {"model_type": "llama", "vocab_size": 30522, "hidden_size": 32, "intermediate_size": 64,
                     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                     "max_position_embeddings": 64}


def _from_config(tmp_path, tiny_llama_dir, **fields):
    out = tmp_path / "out"
    model = {"path": None, "tokenizer": str(tiny_llama_dir), "config": {**TINY_LLAMA_CONFIG, **fields}}
    return write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=out, model=model), out


def _assert_one_line_exit_2(code, capsys, words, out):
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("toolkit: error:") and all(w in err[0] for w in words), err
    assert not out.exists()


@pytest.mark.parametrize("command", ["validate", "train"])
def test_key_value_heads_that_do_not_divide_the_heads_are_one_line(command, tmp_path, tiny_llama_dir, capsys):
    recipe, out = _from_config(tmp_path, tiny_llama_dir, num_key_value_heads=3)
    _assert_one_line_exit_2(main([command, str(recipe)]), capsys,
                            ("model.config", "num_attention_heads 4", "num_key_value_heads 3", "multiple"), out)


@pytest.mark.parametrize("field, value", [("num_attention_heads", 0), ("hidden_size", 0),
                                          ("num_attention_heads", -4), ("num_hidden_layers", -1)])
def test_a_size_below_one_in_the_model_config_is_one_line(field, value, tmp_path, tiny_llama_dir, capsys):
    """Llama's config divides by the heads (ZeroDivisionError); hidden 0 or negative heads or layers passed
    validate and failed inside the model's build, a traceback with run files left behind."""
    recipe, out = _from_config(tmp_path, tiny_llama_dir, **{field: value})
    _assert_one_line_exit_2(main(["train", str(recipe)]), capsys,
                            ("model.config", f"{field} is {value}", "1 or more"), out)


@pytest.mark.parametrize("field, value", [("attention_dropout", 2), ("attention_dropout", -0.1)])
def test_a_dropout_probability_outside_0_1_in_the_model_config_is_one_line(field, value, tmp_path, tiny_llama_dir,
                                                                           capsys):
    """Llama's config takes attention_dropout 2; the run stopped in its first forward with torch's traceback
    ("dropout probability has to be between 0 and 1"), its output folder written."""
    recipe, out = _from_config(tmp_path, tiny_llama_dir, **{field: value})
    _assert_one_line_exit_2(main(["train", str(recipe)]), capsys,
                            ("model.config", f"{field} is {value}", "a dropout probability must be in [0, 1]"), out)
    recipe, out = _from_config(tmp_path, tiny_llama_dir, attention_dropout=1.0)
    assert main(["validate", str(recipe)]) == 0


@pytest.mark.parametrize("fields", [{"rope_theta": -1.0}, {"rope_theta": 0},
                                    {"rope_parameters": {"rope_type": "default", "rope_theta": -10000.0}}])
def test_a_rotary_base_of_0_or_below_is_one_line(fields, tmp_path, tiny_llama_dir, capsys):
    """Llama's config takes rope_theta -1: the positions were NaN and the run went until its first step's
    non-finite loss stopped it (exit 4), its output folder written."""
    recipe, out = _from_config(tmp_path, tiny_llama_dir, **fields)
    theta = fields.get("rope_theta", fields.get("rope_parameters", {}).get("rope_theta"))
    _assert_one_line_exit_2(main(["train", str(recipe)]), capsys,
                            ("model.config", f"rope_theta is {theta}", "base must be above 0"), out)


@pytest.mark.parametrize("top_k, experts, words", [(9, 8, "9 with 8 experts a layer"), (0, 4, "0 with 4 experts")])
def test_a_token_routed_to_more_experts_than_a_layer_has_is_one_line(top_k, experts, words, tmp_path, tiny_llama_dir,
                                                                     capsys):
    """Qwen3-MoE's config takes any num_experts_per_tok; the run stopped in its first forward with torch's
    traceback ("selected index k out of range"; 0: "cannot reshape tensor of 0 elements"), its folder written."""
    moe = {"model_type": "qwen3_moe", "num_experts": experts, "num_experts_per_tok": top_k,
           "moe_intermediate_size": 32, "head_dim": 8}
    recipe, out = _from_config(tmp_path, tiny_llama_dir, **moe)
    _assert_one_line_exit_2(main(["train", str(recipe)]), capsys,
                            ("model.config: num_experts_per_tok is", words, f"routed to 1 to {experts} of them"), out)
    recipe, out = _from_config(tmp_path, tiny_llama_dir, **{**moe, "num_experts_per_tok": experts})
    assert main(["validate", str(recipe)]) == 0
    from toolkit.config.recipe import ModelConfig
    from toolkit.model.build import hf_config

    # one expert is a dense model in some families (Jamba's num_experts 1 builds plain MLPs; its top-k of 2 unused)
    jamba = {"model_type": "jamba", "vocab_size": 30522, "hidden_size": 32, "intermediate_size": 64,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 1,
             "num_experts_per_tok": 2}
    assert hf_config(ModelConfig(config=jamba, tokenizer=str(tiny_llama_dir), task="causal-lm")).num_experts == 1


@pytest.mark.parametrize("command", ["validate", "train"])
def test_one_expert_routed_to_two_is_one_line_where_the_family_builds_routers(command, tmp_path, tiny_llama_dir,
                                                                              capsys):
    """A Qwen3-MoE of one expert still builds a router per layer (every layer sparse), which picked 2 of its 1
    expert and stopped the first forward ("selected index k out of range"); the config check leaves one expert
    alone (Jamba's is a dense model), so the routers built on the meta device are what tell."""
    moe = {"model_type": "qwen3_moe", "num_experts": 1, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
           "head_dim": 8}
    recipe, out = _from_config(tmp_path, tiny_llama_dir, **moe)
    _assert_one_line_exit_2(main([command, str(recipe)]), capsys,
                            ("model.config: the router model.layers.0.mlp.gate picks 2 of 1",
                             "num_experts_per_tok from 1 to 1"), out)
    recipe, out = _from_config(tmp_path, tiny_llama_dir, **{**moe, "num_experts_per_tok": 1})
    assert main(["validate", str(recipe)]) == 0, capsys.readouterr().err


def test_a_size_below_one_in_a_model_folders_config_is_one_line(tmp_path, tiny_llama_dir, capsys):
    import json
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 0}))
    out = tmp_path / "out"
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=folder, output_dir=out)
    _assert_one_line_exit_2(main(["validate", str(recipe)]), capsys,
                            (f"model.path {folder}", "num_hidden_layers is 0", "1 or more"), out)


@pytest.mark.parametrize("spec, words", [("pkg://os/model", ("'os' is a module, not a package folder",)),
                                         ("pkg://no_such_package/model", ("package 'no_such_package' is not "
                                                                          "installed",))])
def test_a_pkg_path_that_names_no_package_folder_is_one_line(spec, words, tmp_path, tiny_llama_dir, capsys):
    recipe, out = _from_config(tmp_path, tiny_llama_dir)
    _assert_one_line_exit_2(main(["validate", str(recipe), "--set", f"model.tokenizer={spec}"]), capsys, words, out)


def test_a_model_config_key_the_config_class_lacks_is_one_line_with_the_near_name(tmp_path, tiny_llama_dir, capsys):
    """A typo (num_hidden_layer) was kept by transformers as an attribute no model reads: the run silently built
    the default depth. A legacy key the class converts (rope_theta, into rope_parameters) still passes."""
    recipe, out = _from_config(tmp_path, tiny_llama_dir, num_hidden_layer=1)
    _assert_one_line_exit_2(main(["validate", str(recipe)]), capsys,
                            ("model.config: num_hidden_layer is not a field of LlamaConfig",
                             "did you mean num_hidden_layers?"), out)
    recipe, out = _from_config(tmp_path, tiny_llama_dir, rope_theta=50000.0)
    assert main(["validate", str(recipe)]) == 0


@pytest.mark.parametrize("model_type, task, key, value", [
    ("t5", "sequence-classification", "decoder_start_token_id", 0),  # T5's model reads it; not a declared field
    ("gpt2", "causal-lm", "n_ctx", 64),  # in GPT-2's own config.json
    ("bert", "sequence-classification", "gradient_checkpointing", False),  # in bert-base-uncased's config.json
    ("llama", "causal-lm", "auto_map", {}),
])
def test_keys_people_copy_from_a_config_json_still_validate(model_type, task, key, value, tmp_path, tiny_llama_dir,
                                                            capsys):
    from transformers import AutoConfig

    from toolkit.model.build import hf_config
    from toolkit.config.recipe import ModelConfig

    small = {"llama": TINY_LLAMA_CONFIG, "gpt2": {"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64},
             "bert": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64},
             "t5": {"d_model": 32, "d_ff": 64, "num_layers": 2, "num_heads": 4, "d_kv": 8}}[model_type]
    fields = {**small, "model_type": model_type, key: value}
    built = hf_config(ModelConfig(config=fields, tokenizer=str(tiny_llama_dir), task=task))
    assert getattr(built, key) == value  # kept, as transformers itself keeps it
    assert type(built) is type(AutoConfig.for_model(model_type))


def test_a_model_type_without_the_tasks_head_is_one_line(tmp_path, tiny_llama_dir, capsys):
    recipe, out = _from_config(tmp_path, tiny_llama_dir, model_type="t5")
    _assert_one_line_exit_2(main(["validate", str(recipe)]), capsys,
                            ("model.config", "model_type t5", "no causal-lm head"), out)


def test_an_empty_tokenizer_folder_is_one_line(tmp_path, tiny_llama_dir, capsys):
    empty = tmp_path / "tokenizer"
    empty.mkdir()
    recipe, out = _from_config(tmp_path, tiny_llama_dir)
    _assert_one_line_exit_2(main(["validate", str(recipe), "--set", f"model.tokenizer={empty}"]), capsys,
                            (f"model.tokenizer: {empty}", "tokenizer.json"), out)


@pytest.mark.parametrize("files, words", [
    (("config.json",), "has config.json but no weights"),
    (("config.json", "model.safetensors"), "holds no tokenizer"),  # weights without the tokenizer's files
])
def test_a_model_folder_missing_files_is_one_line(files, words, tmp_path, tiny_bert_dir, capsys):
    import shutil

    folder = tmp_path / "model"
    folder.mkdir()
    for name in files:
        shutil.copy(tiny_bert_dir / name, folder / name)
    out = tmp_path / "out"
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=folder, task="sequence-classification", output_dir=out)
    _assert_one_line_exit_2(main(["validate", str(recipe)]), capsys, (f"model.path: {folder}", words), out)


@pytest.mark.parametrize("command", ["validate", "train"])
def test_a_lora_adapter_as_model_path_names_its_base(command, tmp_path, tiny_bert_dir, capsys):
    """A LoRA run's output_dir/model holds the adapter (peft's adapter_config.json and weights, the tokenizer), no
    config.json: "has no config.json" named no way on. The line names the base the adapter was trained on."""
    import json
    import shutil

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(tiny_bert_dir),
                                                            "peft_type": "LORA", "r": 4}))
    shutil.copy(tiny_bert_dir / "tokenizer.json", folder / "tokenizer.json")
    out = tmp_path / "out"
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=folder, task="sequence-classification", output_dir=out)
    _assert_one_line_exit_2(main([command, str(recipe)]), capsys,
                            (f"model.path: {folder} holds a LoRA adapter", f"its base model ({tiny_bert_dir})",
                             "model.lora.merge_on_export: true"), out)


def test_a_sharded_model_missing_a_shard_is_one_line(tmp_path, tiny_bert_dir, capsys):
    import json
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny_bert_dir, folder)
    (folder / "model.safetensors").unlink()
    index = {"metadata": {}, "weight_map": {"bert.embeddings.word_embeddings.weight": "model-00001-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    out = tmp_path / "out"
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=folder, task="sequence-classification", output_dir=out)
    _assert_one_line_exit_2(main(["validate", str(recipe)]), capsys,
                            ("model.safetensors.index.json", "model-00001-of-00002.safetensors"), out)


# DeepSpeed JSONs whose mistakes only deepspeed.initialize found, each with the words of its one line
BAD_DS_JSONS = {
    "stage out of range": ({"zero_optimization": {"stage": 7}}, "zero_optimization.stage"),
    "stage not a number": ({"zero_optimization": {"stage": "two"}}, "zero_optimization.stage"),
    "bucket size not a number": ({"zero_optimization": {"stage": 2, "reduce_bucket_size": "lots"}},
                                 "zero_optimization.reduce_bucket_size"),
    "nvme without a path": ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}},
                            "zero_optimization.offload_optimizer.nvme_path"),
    "unknown optimizer": ({"optimizer": {"type": "NoSuchOpt", "params": {}}, "zero_optimization": {"stage": 2}},
                          "optimizer.type 'NoSuchOpt'"),
}


@pytest.mark.parametrize("case", list(BAD_DS_JSONS))
def test_a_deepspeed_json_deepspeed_refuses_is_one_line(case, tmp_path, tiny_llama_dir, capsys):
    import json

    config, words = BAD_DS_JSONS[case]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(config))
    out = tmp_path / "out"
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=out,
                          strategy={"name": "zero", "ds_config": str(bad)})
    _assert_one_line_exit_2(main(["validate", str(recipe)]), capsys, (str(bad), words), out)


DEEPSPEED_PLUGIN = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"}


@pytest.mark.parametrize("var, value", [("ACCELERATE_DEEPSPEED_ZERO_STAGE", "three"),
                                        ("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "lots"),
                                        ("ACCELERATE_GRADIENT_CLIPPING", "high")])
def test_an_accelerate_setting_that_is_no_number_is_one_line(var, value, monkeypatch):
    import os

    from toolkit.launch.accelerate_env import launcher_settings
    from toolkit.errors import RecipeError

    for name, setting in {**DEEPSPEED_PLUGIN, var: value}.items():
        monkeypatch.setenv(name, setting)
    with pytest.raises(RecipeError, match=f"{var}={value!r}"):
        launcher_settings(os.environ)


@pytest.mark.parametrize("var", ["ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "ACCELERATE_GRADIENT_CLIPPING"])
def test_accelerates_auto_leaves_the_recipes_value(var, monkeypatch):
    """Accelerate's DeepSpeedPlugin takes "auto" for these two: the training script's value (the recipe's)."""
    import os

    from toolkit.launch.accelerate_env import launcher_settings

    for name, setting in {**DEEPSPEED_PLUGIN, var: "auto"}.items():
        monkeypatch.setenv(name, setting)
    assert [s.key for s in launcher_settings(os.environ)] == ["strategy.name", "strategy.stage"]


def test_train_under_a_bad_accelerate_setting_is_one_line(tmp_path, tiny_llama_dir, capsys, monkeypatch):
    for name, setting in {**DEEPSPEED_PLUGIN, "ACCELERATE_DEEPSPEED_ZERO_STAGE": "three"}.items():
        monkeypatch.setenv(name, setting)
    out = tmp_path / "out"
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=out)
    _assert_one_line_exit_2(main(["train", str(recipe)]), capsys,
                            ("ACCELERATE_DEEPSPEED_ZERO_STAGE='three'", "accelerate config"), out)


# --- a model folder or config that would train the wrong thing, or fail inside every rank ---------------------

def _model_copy(tmp_path, source):
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(source, folder)
    return folder


@pytest.mark.parametrize("model", ["folder", "config"])
def test_an_encoder_as_a_causal_lm_is_one_line(model, tmp_path, tiny_bert_dir, tiny_llama_dir, capsys):
    """BertLMHeadModel on a config with is_decoder false attends both ways: each position sees the token it
    predicts, and the loss falls for nothing (transformers' own warning is hidden by the toolkit's quiet logs)."""
    out = tmp_path / "out"
    if model == "folder":
        recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_bert_dir, output_dir=out)
        words: tuple[str, ...] = (f"model.path {tiny_bert_dir}", "its config.json")
    else:
        recipe, out = _from_config(tmp_path, tiny_llama_dir, model_type="bert")
        words = ("model.config", "in model.config")
    for command in ("validate", "train"):  # train: also run under torchrun, without launch's checks
        _assert_one_line_exit_2(main([command, str(recipe)]), capsys,
                                (*words, "bert is an encoder (is_decoder false)", "BertLMHeadModel",
                                 "use a decoder model", "model.task sequence-classification"), out)
    if model == "config":  # the same encoder made a decoder: causal, accepted
        recipe, out = _from_config(tmp_path, tiny_llama_dir, model_type="bert", is_decoder=True)
        assert main(["validate", str(recipe)]) == 0


def test_which_causal_lm_classes_need_is_decoder_is_transformers_own_test():
    """The encoder families' causal-LM classes test config.is_decoder; decoders never read it, and the
    encoder-decoder families' causal-LM classes set it themselves."""
    import transformers

    from toolkit.model.config import _needs_is_decoder

    for name in ("BertLMHeadModel", "RobertaForCausalLM", "XLMRobertaForCausalLM", "ElectraForCausalLM",
                 "RoFormerForCausalLM", "ReformerModelWithLMHead"):
        assert _needs_is_decoder(getattr(transformers, name)), name
    for name in ("LlamaForCausalLM", "GPT2LMHeadModel", "GPTNeoXForCausalLM", "BartForCausalLM", "Qwen2ForCausalLM"):
        assert not _needs_is_decoder(getattr(transformers, name)), name


def test_num_labels_other_than_the_saved_heads_is_one_line(tmp_path, tiny_bert_dir, capsys):
    """from_pretrained refuses the 2-label head at 3 labels with a RuntimeError pointing at a report the quiet logs
    hide; a folder without a head (MiniLM's BertModel) takes any num_labels."""
    from conftest import MINILM
    from toolkit.model.build import hf_config
    from toolkit.config.recipe import ModelConfig

    out = tmp_path / "out"
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_bert_dir, task="sequence-classification",
                          output_dir=out, model={"num_labels": 3})
    _assert_one_line_exit_2(main(["validate", str(recipe)]), capsys,
                            (f"model.path {tiny_bert_dir}", "head has 2 labels", "model.num_labels is 3",
                             "set model.num_labels: 2", "save the model without its head"), out)
    assert hf_config(ModelConfig(path=MINILM, num_labels=3)).num_labels == 3


@pytest.mark.parametrize("damage, words", [
    ("cut in the header", ("model.safetensors", "invalid header length")),
    ("cut in the tensors", ("model.safetensors", "file not fully covered")),
    ("cut shard", ("model-00001-of-00001.safetensors", "file not fully covered")),
    ("config not JSON", ("config.json is not valid JSON",)),
    ("cut torch file", ("pytorch_model.bin", "not a complete torch weight file", "cut short")),
])
def test_a_damaged_model_folder_is_one_line(damage, words, tmp_path, tiny_bert_dir, capsys):
    """A download or copy that stopped part way: safetensors' or transformers' traceback in every rank, while
    validate said ok."""
    import json
    import os

    from safetensors import safe_open

    folder = _model_copy(tmp_path, tiny_bert_dir)
    weights = folder / "model.safetensors"
    if damage == "cut shard":
        with safe_open(str(weights), framework="pt") as f:
            names = list(f.keys())
        weights = weights.rename(folder / "model-00001-of-00001.safetensors")
        (folder / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {name: weights.name for name in names}}))
    if damage == "cut torch file":  # the format older checkpoints come in: torch.save's zip archive
        import torch

        with safe_open(str(weights), framework="pt") as f:
            torch.save({name: f.get_tensor(name) for name in f.keys()}, folder / "pytorch_model.bin")
        weights.unlink()
        weights = folder / "pytorch_model.bin"
    if damage == "cut in the header":
        os.truncate(weights, 1000)
    elif damage == "config not JSON":
        (folder / "config.json").write_text('{"model_type": "bert", ')
    else:
        os.truncate(weights, weights.stat().st_size - 100)
    out = tmp_path / "out"
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=folder, task="sequence-classification", output_dir=out)
    _assert_one_line_exit_2(main(["validate", str(recipe)]), capsys, (f"model.path: {folder}", *words), out)


@pytest.mark.parametrize("command", ["validate", "plan", "train"])
def test_a_model_config_value_transformers_fails_to_build_on_is_one_line(command, tmp_path, tiny_llama_dir, capsys):
    """An activation ACT2FN lacks was a KeyError traceback from inside the model's build."""
    recipe, out = _from_config(tmp_path, tiny_llama_dir, hidden_act="foo")
    _assert_one_line_exit_2(main([command, str(recipe)]), capsys,
                            ("model.config: hidden_act 'foo' is not a value transformers knows", "silu"), out)


def test_rotary_positions_are_no_limit_for_a_llama_from_its_config(tmp_path, tiny_llama_dir):
    """A Llama from model.config names no rope keys, yet is as rotary as one saved by save_pretrained (whose
    config.json has rope_parameters): the 64 positions were a limit for one and not the other."""
    recipe, _ = _from_config(tmp_path, tiny_llama_dir)
    assert main(["validate", str(recipe), "--set", "data.max_length=65"]) == 0


@pytest.mark.parametrize("fields, limit", [
    ({"model_type": "llama"}, None),
    ({"model_type": "gpt_neox"}, None),
    ({"model_type": "bert", "max_position_embeddings": 64}, 64),
    ({"model_type": "gpt2", "n_positions": 128}, 128),
    ({"model_type": "roberta", "max_position_embeddings": 66, "pad_token_id": 1}, 64),  # numbered after padding
    ({"model_type": "esm", "max_position_embeddings": 64, "position_embedding_type": "absolute"}, 64),
    ({"model_type": "esm", "max_position_embeddings": 64, "position_embedding_type": "rotary"}, None),
])
def test_the_position_limit_is_read_from_the_built_config(fields, limit):
    from transformers import AutoConfig

    from toolkit.model.build import position_limit

    config = dict(fields)
    assert position_limit(AutoConfig.for_model(config.pop("model_type"), **config)) == limit


@pytest.mark.parametrize("value", ["bert-base-uncased", "google-bert/bert-base-uncased"])
def test_a_hub_id_as_model_path_says_it_is_not_downloaded(value, tmp_path, tiny_bert_dir, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_bert_dir, task="sequence-classification",
                          output_dir=out)
    _assert_one_line_exit_2(main(["validate", str(recipe), "--set", f"model.path={value}"]), capsys,
                            (f"model.path: {value} is no folder here", "hub ids are not downloaded",
                             f"hf download {value} --local-dir DIR"), out)
    _assert_one_line_exit_2(main(["validate", str(recipe), "--set", f"model.path={tmp_path}/missing"]), capsys,
                            (f"model.path: {tmp_path}/missing does not exist",), out)
