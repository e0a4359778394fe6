"""Which layers activation checkpointing's recompute runs again (toolkit/strategies/dims/recompute.py), read from a
meta-device forward of the model, against what each family's block does by hand: torch's non-reentrant checkpoint
stops once it has rebuilt the last tensor the block saved, so a layer whose output comes after it runs once. The
collectives that follow are held to the counter in test_comm_prediction.py (tp and fsdp × tp with sequence
parallelism under activation checkpointing)."""

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from toolkit.strategies.dims.recompute import forward_runs

SIZES = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1)


def meta(model_type: str):
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **SIZES))


def test_a_llama_blocks_recompute_stops_before_its_mlp_output_projection_exits():
    """Llama: the MLP's down_proj output is added to the residual, which saves nothing: the recompute stops inside
    down_proj (its input saved), so its output (tensor parallel's exit) comes once; o_proj's is followed by the
    norm and the MLP, which save tensors. The head is outside every block."""
    names = ["model.layers.0.self_attn.o_proj", "model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj",
             "model.layers.1.self_attn.q_proj", "lm_head"]
    runs = forward_runs(meta("llama"), names, recompute=True)
    assert runs == {"model.layers.0.self_attn.o_proj": 2, "model.layers.0.mlp.down_proj": 1,
                    "model.layers.1.mlp.down_proj": 1, "model.layers.1.self_attn.q_proj": 2, "lm_head": 1}
    assert forward_runs(meta("llama"), names, recompute=False) == dict.fromkeys(names, 1)


def test_a_block_that_normalises_its_mlp_output_recomputes_all_of_it():
    """OLMo 2 normalises the MLP's output before the residual add (post_feedforward_layernorm): that norm saves
    its input after down_proj, so the recompute runs down_proj's output again."""
    runs = forward_runs(meta("olmo2"), ["model.layers.0.self_attn.o_proj", "model.layers.0.mlp.down_proj"],
                        recompute=True)
    assert runs == {"model.layers.0.self_attn.o_proj": 2, "model.layers.0.mlp.down_proj": 2}


def test_a_forward_the_meta_device_cannot_run_counts_every_block_layer_twice(monkeypatch):
    """Where the probe's forward fails, the count falls back to every layer of a block run again: at most what
    the recompute issues, never a crash of the plan."""
    model = meta("llama")

    def fails(*args, **kwargs):
        raise ValueError("needs other inputs")
    monkeypatch.setattr(model, "forward", fails)
    names = ["model.layers.0.mlp.down_proj", "lm_head"]
    assert forward_runs(model, names, recompute=True) == {"model.layers.0.mlp.down_proj": 2, "lm_head": 1}
