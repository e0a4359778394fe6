"""A tensor-parallel rank's memory: toolkit plan traces its 1/N share of heads and MLP columns, and a TP run on
CPU does not keep the pretrained file's pages of the weights it split."""

import gc
import json

import pytest
import torch

from toolkit.activations import traced_activations
from toolkit.loading import own_memory
from toolkit.plan import planned_model, predict
from toolkit.recipe import load_recipe

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


def mapped_files() -> set[str]:
    with open("/proc/self/maps") as handle:
        return {line.split()[-1] for line in handle if line.rstrip().endswith(".safetensors")}


def test_own_memory_lets_go_of_the_mapped_pretrained_file_and_keeps_the_weights(tiny_tied_llama_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_tied_llama_dir)
    weights = str(tiny_tied_llama_dir / "model.safetensors")
    # the reason for own_memory: the loaded weights are views into the mapped file (transformers' loading)
    assert weights in mapped_files()
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    fresh = torch.nn.Linear(4, 4)  # memory of its own already: left where it is
    model.add_module("extra", fresh)
    address = fresh.weight.data_ptr()
    moved = own_memory(model)
    gc.collect()
    assert weights not in mapped_files()
    assert moved == sum(t.numel() * t.element_size() for t in before.values())  # each tied weight once
    assert fresh.weight.data_ptr() == address
    for name, param in model.named_parameters():
        if name in before:
            assert torch.equal(param, before[name]), name
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied: the same parameter object
    assert own_memory(model) == 0
