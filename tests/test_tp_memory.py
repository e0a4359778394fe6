"""A tensor-parallel rank's memory: toolkit plan traces its 1/N share of heads and MLP columns, and a TP run on
CPU does not keep the pretrained file's pages of the weights it split."""

import gc
import json

import pytest
import torch

from toolkit.checkpoint.loading import own_memory
from toolkit.config.files import load_recipe
from toolkit.errors import RecipeError
from toolkit.memory import tp_rank
from toolkit.memory.activations import traced_activations
from toolkit.model import tp_plan as tensor_parallel
from toolkit.plan.predict import planned_model, predict
from toolkit.strategies import strategy_rules
CONFIG = {"model_type": "llama", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 8,
          "max_position_embeddings": 256, "tie_word_embeddings": True}
HOW = {"params_dtype": torch.float32, "autocast_dtype": None, "checkpointing": False}


def recipe_of(config, *overrides):
    return load_recipe("recipes/llama-tiny.yaml", [f"model.config={json.dumps(config)}", "data.max_length=128",
                                                  "data.packing=true", "batch.micro_batch_size=2",
                                                  "batch.global_batch_size=null", "batch.grad_accum_steps=1",
                                                  *overrides])


@pytest.mark.parametrize("degree", [2, 4])
def test_a_tp_rank_is_traced_as_a_model_with_its_share_of_heads_and_mlp_columns(tmp_path, monkeypatch, degree):
    """The reference is built by transformers from a config with heads, KV heads and MLP width divided by the
    degree (the same residual stream, embeddings and head): what each TP rank computes, reached independently of
    the toolkit's layer surgery."""
    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path))
    recipe = recipe_of(CONFIG)
    rank = traced_activations(planned_model(recipe), recipe, **HOW, tp_degree=degree)
    divided = {**CONFIG, "num_attention_heads": 8 // degree, "num_key_value_heads": 4 // degree,
               "intermediate_size": 128 // degree}
    reference = recipe_of(divided)
    assert rank == traced_activations(planned_model(reference), reference, **HOW)
    whole = traced_activations(planned_model(recipe), recipe, **HOW)
    assert rank < whole  # the residual stream, norms and the full logits stay: not whole / degree
    assert rank > whole / degree
    # the plan charges it to every rank of tp, and to fsdp's TP groups
    plan = predict(recipe_of(CONFIG, "strategy.name=tp"), world_size=degree, runtime_bytes=0, device_type="cuda")
    assert plan.activation_bytes == [rank] * degree
    hybrid = predict(recipe_of(CONFIG, "strategy.name=fsdp", f"strategy.tp_degree={degree}"), world_size=2 * degree,
                     runtime_bytes=0, device_type="cuda")
    assert hybrid.activation_bytes[0] < whole  # fsdp casts no weights here (fp32): the same dtypes, its TP share


@pytest.mark.parametrize("config", [
    {**CONFIG, "attention_bias": True, "mlp_bias": True},  # column-wise biases split, row-wise ones whole
    {"model_type": "bert", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
     "num_attention_heads": 4},  # the toolkit's own plan for encoders (no base_model_tp_plan)
], ids=["llama-bias", "bert"])
def test_the_traced_tp_rank_holds_the_shapes_a_tp_rank_stores(config):
    """local_model's parameter shapes are local_shapes', the rule model-state bytes are predicted with and that
    the 2-rank runs of tests/test_plan.py measure exactly."""
    task = ["model.task=sequence-classification", "data.label_column=label", "data.packing=false"] \
        if config["model_type"] == "bert" else []  # packing is a causal-lm setting
    model = planned_model(recipe_of(config, *task))
    local = tp_rank.local_model(model, 2)
    expected = tensor_parallel.local_shapes(model, 2)
    assert {n: tuple(p.shape) for n, p in local.named_parameters()} == expected
    assert expected != {n: tuple(p.shape) for n, p in model.named_parameters()}  # something is split
    assert {n: p.requires_grad for n, p in local.named_parameters()} == \
        {n: p.requires_grad for n, p in model.named_parameters()}


def test_lora_with_tensor_parallel_groups_is_one_line_before_any_rank():
    recipe = recipe_of(CONFIG, "strategy.name=fsdp", "strategy.tp_degree=2",
                       'model.lora={"r": 4, "target_modules": ["q_proj"]}')
    with pytest.raises(RecipeError, match="model.lora is not available with strategy.tp_degree"):
        strategy_rules(recipe).validate(recipe, world_size=4)


def mapped_files() -> set[str]:
    with open("/proc/self/maps") as handle:
        return {line.split()[-1] for line in handle if line.rstrip().endswith(".safetensors")}


def test_a_model_that_keeps_part_of_its_weight_file_lets_go_of_it_and_keeps_its_weights(tiny_tied_llama_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_tied_llama_dir)
    weights = str(tiny_tied_llama_dir / "model.safetensors")
    # the reason for own_memory: the loaded weights are views into the mapped file (transformers' loading)
    assert weights in mapped_files()
    everything = {name: param.detach().clone() for name, param in model.named_parameters()}
    # the whole file kept: nothing to give back, nothing copied (no transient copy, ranks' pages stay shared)
    assert own_memory(model) == 0 and weights in mapped_files()
    other = AutoModelForCausalLM.from_pretrained(tiny_tied_llama_dir)  # the file mapped twice, both kept whole:
    assert own_memory(model) == 0 and own_memory(other) == 0  # each model holds all of its own mapping
    del other
    gc.collect()
    model.model.layers = model.model.layers[:1]  # a part dropped, as a strategy's setup does
    fresh = torch.nn.Linear(4, 4)  # memory of its own already: left where it is
    model.add_module("extra", fresh)
    address = fresh.weight.data_ptr()
    kept = {name: t for name, t in everything.items() if not name.startswith("model.layers.1.")}
    moved = own_memory(model)
    gc.collect()
    assert weights not in mapped_files()
    assert moved == sum(t.numel() * t.element_size() for t in kept.values())  # each tied weight once
    assert fresh.weight.data_ptr() == address
    for name, param in model.named_parameters():
        if name in kept:
            assert torch.equal(param, kept[name]), name
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied: the same parameter object
    assert own_memory(model) == 0


def test_a_first_pipeline_stage_of_an_untied_model_lets_go_of_the_file_once_the_rest_is_dropped(tiny_llama_dir):
    """The stage keeps the embeddings and a block; the head and the other block go with the model object (the
    loop drops its reference after setup)."""
    from transformers import AutoModelForCausalLM

    from toolkit.model.stages import Stage

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    weights = str(tiny_llama_dir / "model.safetensors")
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    stage = Stage(model, layer_ids=[0], first=True, last=False)
    del model
    gc.collect()
    assert own_memory(stage) > 0
    gc.collect()
    assert weights not in mapped_files()
