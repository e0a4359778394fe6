"""train.activation_checkpointing: the same fp32 training as without it, under single, ddp, fsdp, zero3 and tp,
and each block really recomputed (its forward runs twice per micro-batch in the first step)."""

import json
from pathlib import Path

import pytest
import torch

import test_model_parallel
import test_sharded
import test_tensor_parallel
from conftest import MINILM, assert_matches_single, exported_weights, losses, write_recipe
from toolkit.cli import main

AC = ("train.activation_checkpointing=true",)
ARMS = {  # name of the run without it, in llama_runs -> (ranks, overrides, micro-batches per step)
    "single-m8": (1, (), 1),
    "ddp-m4": (2, ("strategy.name=ddp", "batch.micro_batch_size=4"), 1),
    "fsdp": (2, test_sharded.ARMS["fsdp"], 1),
    "zero3-accum": (2, test_sharded.ARMS["zero3-accum"], 2),
}


def assert_same_losses(run: Path, other: Path) -> None:
    """Recomputing a block runs the same kernels on the same inputs: bit-for-bit the same activations, and losses
    equal to fp32's rounding of their sums."""
    torch.testing.assert_close(torch.tensor(losses(run), dtype=torch.float64),
                               torch.tensor(losses(other), dtype=torch.float64), rtol=1e-6, atol=0)


def assert_same_training(run: Path, other: Path) -> None:
    """The same losses and the same exported weights."""
    assert_same_losses(run, other)
    ours, theirs = exported_weights(run), exported_weights(other)
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours[name], tensor, rtol=1e-6, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")


def recorded(run: Path) -> dict:
    """run.json's record of the checkpointing and of the blocks' forwards in the first step."""
    return json.loads((run / "run.json").read_text())["activation_checkpointing"]


@pytest.mark.parametrize("arm", list(ARMS))
def test_activation_checkpointing_gives_the_same_fp32_training(llama_runs, arm):
    ranks, overrides, micro_batches = ARMS[arm]
    plain = llama_runs.get(arm, nproc=ranks, overrides=overrides)
    checkpointed = llama_runs.get(f"{arm}-ac", nproc=ranks, overrides=(*overrides, *AC))
    assert_same_training(checkpointed, plain)
    # 2 blocks, each run in forward and again in backward, per micro-batch
    assert recorded(checkpointed) == {"recompute": "full", "blocks": 2,
                                      "block_forwards_first_step": 2 * 2 * micro_batches}
    assert "activation_checkpointing" not in json.loads((plain / "run.json").read_text())


# under tensor parallel: tp alone (2 ranks) and fsdp × tp with sequence parallelism (2 dp × 2 tp); the runs
# test_comm_prediction holds to the plan's collectives
TP_AC = {"tp-ac": (*test_tensor_parallel.ARMS["tp"], 4),
         "fsdp-tp2-sp-ac": (4, (*test_tensor_parallel.ARMS["fsdp-tp2"][1], "strategy.sequence_parallel=true"), 2)}


@pytest.mark.parametrize("arm", list(TP_AC))
def test_activation_checkpointing_under_tensor_parallel_trains_as_one_process(llama4_runs, arm):
    """A block's recompute under tensor parallel reruns its collectives (its row-wise exits up to the last tensor
    the block saves: torch's checkpoint stops there) on the same inputs: as the single process trains, and tp's
    losses those of tp without it."""
    ranks, overrides, micro_batches = TP_AC[arm]
    checkpointed = llama4_runs.get(arm, nproc=ranks, overrides=(*overrides, *AC))
    assert_matches_single(checkpointed, llama4_runs.get("single"))
    if arm == "tp-ac":
        assert_same_losses(checkpointed, llama4_runs.get("tp", nproc=ranks, overrides=overrides))
    assert recorded(checkpointed) == {"recompute": "full", "blocks": 4,
                                      "block_forwards_first_step": 4 * 2 * micro_batches}


def test_a_pipeline_rank_counts_its_own_blocks_and_no_shape_inference(llama4_runs):
    """Interleaved 1F1B, 4 blocks over 4 stages, 2 per rank (each built from its own copy of the model): rank 0
    holds blocks 0 and 2. Before, run.json counted the whole model's 4 blocks, lost the copied stage's forwards
    and added torch's shape inference (one forward and one recomputation of a stage at its first step)."""
    ranks, overrides = test_model_parallel.ARMS["pp-interleaved"]
    plain = llama4_runs.get("pp-interleaved", nproc=ranks, overrides=overrides)
    checkpointed = llama4_runs.get("pp-interleaved-ac", nproc=ranks, overrides=(*overrides, *AC))
    assert_same_losses(checkpointed, plain)
    micro_batches = 4  # micro 2 × accumulation 4 = global batch 8
    assert recorded(checkpointed) == {"recompute": "full", "blocks": 2,
                                      "block_forwards_first_step": 2 * 2 * micro_batches}


@pytest.mark.parametrize("command", ["train", "validate"])
def test_activation_checkpointing_on_a_model_without_blocks_to_checkpoint_is_one_line(command, tmp_path, capsys):
    out = tmp_path / "out"
    # transformers' OpenAI GPT declares no gradient checkpointing (supports_gradient_checkpointing = False)
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=MINILM, output_dir=out, model={
        "path": None, "tokenizer": MINILM, "config": {"model_type": "openai-gpt", "vocab_size": 30522,
                                                      "n_positions": 64, "n_embd": 32, "n_layer": 1, "n_head": 2}},
        train={"activation_checkpointing": True})
    code = main([command, str(recipe)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "OpenAIGPTLMHeadModel" in err[0] and "activation_checkpointing" in err[0]
    assert not out.exists()
