"""The order DeepSpeed meets a model's parameters (toolkit/strategies/zero/order.py), which sets the collective
calls the plan predicts for ZeRO: traced from the first two blocks of a stack and repeated for the rest, it must
equal the trace of the whole model (the reference: every block run), for each family the toolkit plans. The calls
it leads to are held to DeepSpeed's counted ones in test_comm_prediction.py."""

import json

import pytest

from conftest import REPO

from toolkit.config.files import load_recipe
from toolkit.plan.predict import planned_model
from toolkit.strategies.zero.order import repeated_order, whole_order

LLAMA = {"model_type": "llama", "vocab_size": 101, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 5,
         "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True}
MOE = {"model_type": "qwen3_moe", "vocab_size": 101, "hidden_size": 32, "intermediate_size": 64,
       "moe_intermediate_size": 16, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
       "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "tie_word_embeddings": False}
MIXTRAL = {"model_type": "mixtral", "vocab_size": 101, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
           "num_experts_per_tok": 2}
GPT2 = {"model_type": "gpt2", "vocab_size": 101, "n_embd": 32, "n_layer": 4, "n_head": 4, "n_positions": 64}
BERT = {"model_type": "bert", "vocab_size": 101, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
        "num_attention_heads": 4}
DISTILBERT = {"model_type": "distilbert", "vocab_size": 101, "dim": 32, "hidden_dim": 64, "n_layers": 3, "n_heads": 4}


def model_of(config: dict, task: str = "causal-lm", *more: str):
    recipe = load_recipe(str(REPO / "recipes" / "llama-tiny.yaml"),
                         [f"model.config={json.dumps(config)}", f"model.task={task}", *more,
                          *(["data.label_column=label"] if task != "causal-lm" else [])])
    return planned_model(recipe)


@pytest.mark.parametrize("config, task, more", [
    (LLAMA, "causal-lm", ()),
    (dict(LLAMA, tie_word_embeddings=False), "causal-lm", ()),
    (LLAMA, "causal-lm", ("model.lora={r: 4, target_modules: [q_proj, v_proj]}",)),  # frozen weights, adapters
    (MOE, "causal-lm", ()),
    (MIXTRAL, "causal-lm", ()),
    (GPT2, "causal-lm", ()),  # learned positions, Conv1D, tied head
    (BERT, "sequence-classification", ()),  # the pooler and classifier after the encoder's stack
    (DISTILBERT, "sequence-classification", ()),  # names no _no_split_modules: its largest stack
], ids=["llama-tied", "llama", "llama-lora", "qwen3-moe", "mixtral", "gpt2", "bert", "distilbert"])
def test_two_traced_blocks_repeated_equal_the_whole_trace(config, task, more):
    model = model_of(config, task, *more)
    repeated = repeated_order(model)
    assert repeated is not None, "the stack repeats one block: two traced blocks are enough"
    whole = whole_order(model)
    assert repeated == whole
    # the orders name every parameter: the forward each once, backward each trainable one once
    params = list(model.parameters())
    assert sorted(i for group in whole.forward for i in group) == list(range(len(params)))
    assert sorted(whole.backward) == [i for i, p in enumerate(params) if p.requires_grad]


def test_a_stack_of_unlike_blocks_is_traced_whole():
    """Qwen3-MoE's mlp_only_layers keep a dense MLP in the blocks named: the blocks hold other parameters, so the
    second block's order says nothing of theirs."""
    model = model_of(dict(MOE, mlp_only_layers=[2]))
    assert repeated_order(model) is None
    whole = whole_order(model)
    assert sorted(i for group in whole.forward for i in group) == list(range(len(list(model.parameters()))))


def test_a_stack_whose_blocks_differ_in_what_trains_is_traced_whole():
    model = model_of(LLAMA)
    for p in model.model.layers[3].parameters():
        p.requires_grad_(False)
    assert repeated_order(model) is None
