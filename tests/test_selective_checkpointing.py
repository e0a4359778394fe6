"""train.activation_checkpointing: selective (toolkit/model/blocks.py selective_context): the same fp32 training
as without checkpointing under single, fsdp, zero3, a pipeline, tp and fsdp × tp, with the collectives the layouts'
rules count; the FLOPs it recomputes, as the step-time model counts them, equal what torch counts in a real
backward; refused in one line where it is not tested (cp, ep) and for a value it does not take."""

import copy

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

import test_activation_checkpointing
import test_model_parallel
import test_sharded
from conftest import assert_matches_single
from test_activation_checkpointing import assert_same_losses, assert_same_training, recorded
from test_comm_prediction import assert_predicted
from toolkit.cli import main
from toolkit.cost.flops import model_flops
from toolkit.model.blocks import enable_activation_checkpointing

SELECTIVE = ("train.activation_checkpointing=selective",)
# name of the run without checkpointing -> (its runs, ranks, overrides, blocks rank 0 holds, micro-batches per step)
ARMS = {
    "single-m8": ("llama_runs", 1, (), 2, 1),
    "fsdp": ("llama_runs", 2, test_sharded.ARMS["fsdp"], 2, 1),
    "zero3-accum": ("llama_runs", 2, test_sharded.ARMS["zero3-accum"], 2, 2),
    # interleaved 1F1B, 4 blocks over 4 stages: rank 0 holds blocks 0 and 2, each run for the step's 4 micro-batches
    "pp-interleaved": ("llama4_runs", *test_model_parallel.ARMS["pp-interleaved"], 2, 4),
}


@pytest.mark.parametrize("arm", list(ARMS))
def test_selective_checkpointing_gives_the_same_fp32_training(request, arm):
    fixture, ranks, overrides, blocks, micro_batches = ARMS[arm]
    runs = request.getfixturevalue(fixture)
    plain = runs.get(arm, nproc=ranks, overrides=overrides)
    selective = runs.get(f"{arm}-selective", nproc=ranks, overrides=(*overrides, *SELECTIVE))
    # what it keeps is what forward computed, what it recomputes the same kernels on the same inputs: bit-for-bit
    assert_same_training(selective, plain)
    # the block's forward runs again in backward (its kept outputs read from what forward stored)
    assert recorded(selective) == {"recompute": "selective", "blocks": blocks,
                                   "block_forwards_first_step": blocks * 2 * micro_batches}


def tiny(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "llama":  # q k v o gate up down: no biases (mm); grouped keys and values (k, v narrower than q)
        config = AutoConfig.for_model("llama", vocab_size=256, hidden_size=64, intermediate_size=176,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        model = AutoModelForCausalLM.from_config(config)
    else:  # query key value, output, intermediate, output: biases (addmm), an even number of matmuls per block
        config = AutoConfig.for_model("bert", vocab_size=256, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.0)
        model = AutoModelForSequenceClassification.from_config(config)
    return model.train()


def counted_flops(model: torch.nn.Module, ids: torch.Tensor, recompute: str) -> tuple[int, dict]:
    """torch's FLOP count of one forward and backward (its own formulas per aten matmul), and the gradients."""
    model = copy.deepcopy(model)
    if recompute != "none":
        enable_activation_checkpointing(model, recompute)
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids).logits.float().pow(2).sum().backward()
    return counter.get_total_flops(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("kind", ["llama", "bert"])
def test_the_flops_selective_checkpointing_recomputes_are_those_torch_counts(kind):
    """The step-time model's recompute term (toolkit/cost/flops.py: the 2nd, 4th, ... matrix of each block, one
    forward each) against torch's FlopCounterMode over a real backward, less the same backward without
    checkpointing; full checkpointing recomputes more, and neither changes a gradient."""
    model, ids = tiny(kind), torch.randint(0, 256, (2, 16))
    plain, plain_grads = counted_flops(model, ids, "none")
    selective, selective_grads = counted_flops(model, ids, "selective")
    full, _ = counted_flops(model, ids, "full")
    predicted = model_flops(model, seq_len=16, checkpointing="selective").recompute * ids.numel()
    assert selective - plain == predicted
    assert 0 < selective - plain < full - plain
    for name, grad in plain_grads.items():
        assert torch.equal(selective_grads[name], grad), name


@pytest.mark.parametrize("runs, overrides, says", [
    ("llama_runs", ("train.activation_checkpointing=sometimes",), "choose false, true (the same as full) or selective"),
    ("llama_runs", ("train.activation_checkpointing=1",), "expected false, true (the same as full) or selective"),
    ("llama_runs", ("parallel.cp=2", "batch.micro_batch_size=4", *SELECTIVE),
     "selective is not available with context parallel"),
    ("moe_runs", ("parallel.ep=2", "batch.micro_batch_size=4", *SELECTIVE),
     "selective is not available with expert parallel"),
])
def test_selective_checkpointing_where_it_is_not_built_is_one_line(request, runs, overrides, says, tmp_path, capsys):
    recipe = request.getfixturevalue(runs).recipe
    capsys.readouterr()  # what building the fixture's model printed
    out = tmp_path / "out"
    sets = [arg for override in (*overrides, f"output_dir={out}") for arg in ("--set", override)]
    code = main(["validate", str(recipe), "--nproc", "2", *sets])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and says in err[0], err
    assert not out.exists()


def test_the_plan_puts_selective_between_none_and_full_and_full_in_its_checkpointed_column(tmp_path, monkeypatch):
    """`toolkit plan`'s activations under the recipe's own setting, and in its (AC) column under full checkpointing
    whatever that setting is (the reference's measurements of each: tests/test_activations.py)."""
    from test_activations import small_recipe
    from toolkit.memory.activations import traced_activations
    from toolkit.plan.predict import planned_model, predict

    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path))
    plans = {value: predict(small_recipe(f"train.activation_checkpointing={value}"), world_size=1, runtime_bytes=0)
             for value in ("false", "selective", "true")}
    none, selective, full = (plans[value].activation_bytes[0] for value in ("false", "selective", "true"))
    assert full < selective < none
    plain = small_recipe()  # traced on its own under full checkpointing (single: the recipe's fp32 weights)
    traced = traced_activations(planned_model(plain), plain, params_dtype=torch.float32, autocast_dtype=None,
                                checkpointing=True)
    assert full == traced
    for value in ("false", "selective"):
        assert plans[value].activation_bytes_checkpointed == [traced], value


@pytest.mark.parametrize("arm", ["fsdp", "zero3-accum", "pp-interleaved"])
def test_collective_bytes_equal_the_counter_under_selective_checkpointing(request, arm):
    """The layouts' collective rules, unchanged under selective checkpointing (FSDP2 gathers outside the block's
    checkpoint, ZeRO-3 again inside its recompute as under full checkpointing, a pipeline sends activations),
    against the counter of the runs above."""
    fixture, ranks, overrides, _, _ = ARMS[arm]
    assert_predicted(request.getfixturevalue(fixture).get(f"{arm}-selective", nproc=ranks,
                                                          overrides=(*overrides, *SELECTIVE)))


@pytest.mark.parametrize("arm", list(test_activation_checkpointing.TP_AC))
def test_selective_checkpointing_under_tensor_parallel_trains_as_full_with_the_same_collectives(llama4_runs, arm):
    """tp alone (2 ranks) and fsdp × tp with sequence parallelism (2 × 2): the policy keeps no collective's output,
    so a block's recompute reruns the collectives full checkpointing's does (dims/recompute.py), counted by the
    same rule; the losses are full checkpointing's and the single process's."""
    ranks, overrides, micro_batches = test_activation_checkpointing.TP_AC[arm]
    full = llama4_runs.get(arm, nproc=ranks, overrides=(*overrides, *test_activation_checkpointing.AC))
    selective = llama4_runs.get(arm.replace("-ac", "-selective"), nproc=ranks, overrides=(*overrides, *SELECTIVE))
    assert_matches_single(selective, llama4_runs.get("single"))
    assert_same_losses(selective, full)
    assert recorded(selective) == {"recompute": "selective", "blocks": 4,
                                   "block_forwards_first_step": 4 * 2 * micro_batches}
    assert_predicted(selective)
