"""Tensor parallel (`tp`) and 2-D TP × FSDP (`fsdp` with `strategy.tp_degree`) against the single-process
reference: fp32, the same global batch, 5 steps, real processes on gloo; the runs are those of the other
split strategies (conftest's llama4_runs and minilm_runs), shared."""

import json
import re

import pytest

from conftest import assert_matches_single, exported_weights, metrics, run_cli

ARMS = {
    # name: (ranks, overrides); global batch 8 = data shards × micro 2 × accumulation
    "tp": (2, ("strategy.name=tp", "batch.grad_accum_steps=4")),  # one data shard: both ranks read it
    "fsdp-tp2": (4, ("strategy.name=fsdp", "strategy.tp_degree=2", "batch.grad_accum_steps=2")),  # 2 dp × 2 tp
    # norms and residuals on sequence shards between the split layers (uneven shards: padded lengths are odd too)
    "tp-sp": (2, ("strategy.name=tp", "strategy.sequence_parallel=true", "batch.grad_accum_steps=4")),
}
# what the plans split (colwise: output features, rowwise: input features); everything else is replicated
SPLIT = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# every step, the ranks of a TP group are checked to hold identical copies of what TP does not split
BF16 = ("precision=bf16", "train.max_steps=8", "optim.lr=0.003", "train.consistency_check_every=1")
REPLICAS = {"fsdp-tp2": "every 1 step(s): the 2 ranks of each TP group hold the same norm and embedding shards"}
# one bf16 run (the suite's budget): fsdp-tp2 at 2 ranks (1 dp × 2 tp) runs tp's split layers inside FSDP, with
# sequence parallelism
BF16_ARMS = {"fsdp-tp2": (*ARMS["fsdp-tp2"][1], "strategy.sequence_parallel=true")}


@pytest.mark.parametrize("arm", list(ARMS))
def test_tensor_parallel_matches_single_on_a_tied_llama(llama4_runs, arm):
    ranks, overrides = ARMS[arm]
    assert_matches_single(llama4_runs.get(arm, nproc=ranks, overrides=overrides), llama4_runs.get("single"))


def test_tp_matches_single_on_minilm(minilm_runs):
    # BERT declares no plan in its config: the toolkit's fallback splits query/key/value, the attention output,
    # the intermediate and the output dense layers
    ranks, overrides = ARMS["tp"]
    assert_matches_single(minilm_runs.get("tp", nproc=ranks, overrides=overrides), minilm_runs.get("single"))


def test_tp_layout_model_states_and_audit_are_read_from_the_split_weights(llama4_runs):
    ranks, overrides = ARMS["tp"]
    run_dir = llama4_runs.get("tp", nproc=ranks, overrides=overrides)
    run = json.loads((run_dir / "run.json").read_text())
    assert run["layout"] == ("attention heads and MLP columns split over 2 ranks; embeddings, norms and head "
                             "replicated")
    # each rank stores half of every split weight and all of the rest: counted from the exported shapes
    weights = exported_weights(run_dir)
    expected = sum(w.numel() // 2 if w.dim() == 2 and name.split(".")[-2] in SPLIT else w.numel()
                   for name, w in weights.items()) * 4
    for detail in run["model_state_bytes"]:  # per rank
        assert detail["params_bytes"] == expected
        assert detail["grads_bytes"] == expected and detail["optim_bytes"] == 2 * expected
    assert "activations all-reduced per block (fp32)" in run["precision_audit"]["grad_reduction"]
    # the implementation single and the other strategies run: split and replicated parameters in groups of their own
    assert run["precision_audit"]["optimizer"] == "torch AdamW (fused)"


def test_communication_per_step_is_activation_all_reduces_beside_fsdp_traffic(llama4_runs):
    runs = {arm: json.loads((llama4_runs.get(arm, nproc=ranks, overrides=overrides) / "run.json").read_text())
            for arm, (ranks, overrides) in ARMS.items() if arm != "tp-sp"}
    blocks, micro_batches = 4, {"tp": 4, "fsdp-tp2": 2}  # micro-batches per rank per step
    for arm, run in runs.items():
        ops = run["comm_per_step"]
        # per block and micro-batch: forward, the row-wise o_proj and down_proj outputs are summed; backward,
        # the gradients of the inputs of the column-wise q, k, v, gate and up projections: 7 all-reduces
        assert ops["calls_by_op"]["all_reduce"] == 7 * blocks * micro_batches[arm], (arm, ops)
    tp_params_bytes = runs["tp"]["model_state_bytes"][0]["params_bytes"]  # one TP rank's share of the model
    fsdp_tp = runs["fsdp-tp2"]["comm_per_step"]["bytes_by_op"]
    # FSDP over the 2 data-parallel groups: each rank reduce-scatters the full gradient of its TP share
    # (padded to equal shards: <=1% more) and all-gathers its half of it, forward and again in backward
    assert tp_params_bytes <= fsdp_tp["_reduce_scatter_base_"] <= tp_params_bytes * 1.01
    assert fsdp_tp["_allgather_base_"] == pytest.approx(2 * fsdp_tp["_reduce_scatter_base_"], rel=0.01)
    assert "_allgather_base_" not in runs["tp"]["comm_per_step"]["bytes_by_op"]  # tp alone moves activations only


@pytest.mark.parametrize("arm", list(BF16_ARMS))
def test_bf16_tensor_parallel_trains_and_audits_the_activation_reduction(llama4_runs, arm):
    run_dir = llama4_runs.get(f"{arm}-bf16", nproc=2, overrides=(*BF16_ARMS[arm], *BF16))
    steps = metrics(run_dir)
    assert len(steps) == 8 and steps[-1]["loss"] < steps[0]["loss"] - 0.5
    run = json.loads((run_dir / "run.json").read_text())
    reduction = run["precision_audit"]["grad_reduction"]
    assert "activations reduce-scattered and all-gathered along the sequence per block over tp (bf16)" in reduction
    assert run["replica_check"].startswith(REPLICAS[arm])


BAD = {
    "heads not divisible": (3, ("strategy.name=tp",),
                            "the model's attention heads (num_attention_heads = 4) are not divisible by the "
                            "tensor-parallel degree 3"),
    "KV heads not divisible": (4, ("strategy.name=tp",),
                               "the model's KV heads (num_key_value_heads = 2) are not divisible by the "
                               "tensor-parallel degree 4"),
    "world not divisible by tp_degree": (6, ("strategy.name=fsdp", "strategy.tp_degree=4"),
                                         "strategy.tp_degree 4 does not divide world size 6"),
    "tp_degree with another strategy": (2, ("strategy.name=ddp", "strategy.tp_degree=2"),
                                        "strategy.tp_degree applies to fsdp/tp only, but strategy.name is ddp"),
    "tp_degree other than the world under tp": (4, ("strategy.name=tp", "strategy.tp_degree=2"),
                                                "use strategy.name=fsdp with tp_degree 2"),
    "fp16 (a loss scaler over mixed DTensor/plain gradients)": (2, ("strategy.name=tp", "precision=fp16"),
                                                                "precision fp16 is not available with tensor "
                                                                "parallelism"),
    "sequence_parallel without tensor parallelism": (2, ("strategy.name=fsdp", "strategy.sequence_parallel=true"),
                                                     "strategy.sequence_parallel needs tensor parallelism"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_tensor_parallel_inputs_are_one_line_before_any_rank(llama4_runs, case):
    from toolkit.errors import RecipeError
    from toolkit.recipe_files import load_recipe
    from toolkit.strategies import validate_strategy

    ranks, overrides, words = BAD[case]
    with pytest.raises(RecipeError, match=re.escape(words)):
        validate_strategy(load_recipe(llama4_runs.recipe, overrides), world_size=ranks)


def test_mlp_columns_not_divisible_and_a_model_without_plan_are_one_line(tmp_path):
    from conftest import MINILM
    from toolkit.errors import RecipeError
    from toolkit.recipe_files import load_recipe
    from toolkit.strategies import validate_strategy

    def recipe_for(config: dict):
        path = tmp_path / f"{config['model_type']}.yaml"
        path.write_text(json.dumps({"model": {"config": config, "tokenizer": MINILM, "task": "causal-lm"},
                                    "data": {"train": "unused.jsonl", "text_column": "text"},
                                    "strategy": {"name": "tp"}}))
        return load_recipe(path, ())

    llama = recipe_for({"model_type": "llama", "vocab_size": 30522, "hidden_size": 32, "intermediate_size": 63,
                        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2})
    with pytest.raises(RecipeError, match=re.escape("MLP columns (intermediate_size = 63) are not divisible")):
        validate_strategy(llama, world_size=2)
    gpt2 = recipe_for({"model_type": "gpt2", "vocab_size": 30522, "n_embd": 32, "n_layer": 1, "n_head": 2})
    with pytest.raises(RecipeError, match=re.escape("gpt2 declares no tensor-parallel plan")) as error:
        validate_strategy(gpt2, world_size=2)
    assert "modules found: c_attn, c_fc, c_proj, lm_head" in str(error.value)  # what a plan would name


def test_sequence_parallel_on_an_encoder_is_one_line(minilm_runs):
    from toolkit.errors import RecipeError
    from toolkit.recipe_files import load_recipe
    from toolkit.strategies import validate_strategy

    recipe = load_recipe(minilm_runs.recipe, ("strategy.name=tp", "strategy.sequence_parallel=true"))
    with pytest.raises(RecipeError, match=re.escape("strategy.sequence_parallel: supported for Llama-style "
                                                    "decoders (blocks of exactly input_layernorm, self_attn, "
                                                    "post_attention_layernorm, mlp), not bert")):
        validate_strategy(recipe, world_size=2)


def test_sequence_parallel_on_a_block_with_more_norms_is_one_line(tmp_path):
    """Gemma 2's blocks hold the four parts and two more norms (around the MLP): validate said ok, then every
    rank died mixing DTensors and plain tensors in those norms."""
    from conftest import MINILM
    from toolkit.errors import RecipeError
    from toolkit.recipe_files import load_recipe
    from toolkit.strategies import validate_strategy

    config = {"model_type": "gemma2", "vocab_size": 30522, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}
    path = tmp_path / "gemma2.yaml"
    path.write_text(json.dumps({"model": {"config": config, "tokenizer": MINILM, "task": "causal-lm"},
                                "data": {"train": "unused.jsonl", "text_column": "text"},
                                "strategy": {"name": "tp", "sequence_parallel": True}}))
    validate_strategy(load_recipe(path, ("strategy.sequence_parallel=false",)), world_size=2)  # plain tp runs it
    with pytest.raises(RecipeError, match=r"sequence_parallel: supported for Llama-style decoders .*, not gemma2"):
        validate_strategy(load_recipe(path, ()), world_size=2)


def test_bad_tensor_parallel_input_through_the_launcher_exits_2_with_nothing_written(llama4_runs, tmp_path):
    out = tmp_path / "never"
    result = run_cli("launch", "--nproc", "3", str(llama4_runs.recipe), "--set", "strategy.name=tp",
                     "--set", f"output_dir={out}")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "toolkit: error: tensor parallelism: the model's attention heads (num_attention_heads = 4) are not divisible by "
        "the tensor-parallel degree 3; use a degree that divides 4"]
    assert not out.exists()
