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
    # HSDP × tp: 2 replica groups (each its own data shard) × 2 tp, FSDP over a group's one dp_shard rank
    "hsdp-tp2": (4, ("strategy.name=fsdp", "strategy.tp_degree=2", "strategy.replicate_degree=2",
                     "batch.grad_accum_steps=2")),
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
            for arm, (ranks, overrides) in ARMS.items() if arm in ("tp", "fsdp-tp2")}
    blocks, micro_batches = 4, {"tp": 4, "fsdp-tp2": 2}  # micro-batches per rank per step
    # the gradient norm (every step, DTensor gradients): per group of gradients split alike, one fp32 per gradient,
    # all-reduced over each mesh dimension that splits them. tp: q k v gate up (5 a block) on dim 0, o down (2) on
    # dim 1, over tp; fsdp × tp: those two over dp and tp, the embedding and the 9 norms over dp
    norms = {"tp": (2, (20 + 8) * 4), "fsdp-tp2": (5, (2 * 20 + 2 * 8 + 10) * 4)}
    for arm, run in runs.items():
        ops = run["comm_per_step"]
        # per block and micro-batch: forward, the row-wise o_proj and down_proj outputs are summed; backward,
        # the input gradients of attention (the sum of q's, k's and v's) and of the MLP (gate's + up's): 4
        # all-reduces (one per column-wise layer, as before, made it 7: the same sum, 5/2 the bytes backward)
        assert ops["calls_by_op"]["all_reduce"] == 4 * blocks * micro_batches[arm] + norms[arm][0], (arm, ops)
        # each of them a full activation: hidden 32 floats (conftest.llama4_runs) per token of the micro-batches
        tokens = sum(rows * length for rows, length in ops["micro_batch_shapes_per_rank"][0])
        assert ops["bytes_by_op"]["all_reduce"] == 4 * blocks * tokens * 32 * 4 + norms[arm][1], (arm, ops)
    tp_params_bytes = runs["tp"]["model_state_bytes"][0]["params_bytes"]  # one TP rank's share of the model
    fsdp_tp = runs["fsdp-tp2"]["comm_per_step"]["bytes_by_op"]
    # FSDP over the 2 data-parallel groups: each rank reduce-scatters the full gradient of its TP share
    # (padded to equal shards: <=1% more) and all-gathers its half of it, forward and again in backward
    assert tp_params_bytes <= fsdp_tp["_reduce_scatter_base_"] <= tp_params_bytes * 1.01
    assert fsdp_tp["_allgather_base_"] == pytest.approx(2 * fsdp_tp["_reduce_scatter_base_"], rel=0.01)
    assert "_allgather_base_" not in runs["tp"]["comm_per_step"]["bytes_by_op"]  # tp alone moves activations only


def test_hsdp_tp_checks_its_tp_groups_and_its_replica_groups_and_audits_both_reductions(llama4_runs):
    ranks, overrides = ARMS["hsdp-tp2"]
    run = json.loads((llama4_runs.get("hsdp-tp2", nproc=ranks, overrides=overrides) / "run.json").read_text())
    # what tp does not split is the same on a TP group's 2 ranks; every shard the same in both replica groups
    assert "the 2 ranks of each TP group hold the same norm and embedding shards" in run["replica_check"], run
    assert "2 replica groups hold identical shards" in run["replica_check"], run
    assert "then all-reduced across the 2 groups" in run["precision_audit"]["grad_reduction"], run
    assert "2 dp_replicate × 1 dp_shard × 2 tp" in run["layout"], run


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
    "tp_degree × replicate_degree not dividing the world": (2, ("strategy.name=fsdp", "strategy.tp_degree=2",
                                                               "strategy.replicate_degree=2"),
                                                           "strategy.tp_degree 2 × replicate_degree 2 does not divide "
                                                           "world size 2; use a world size that is a multiple of 4"),
    "tp_degree with another strategy": (2, ("strategy.name=ddp", "strategy.tp_degree=2"),
                                        "strategy.tp_degree applies to fsdp/pipeline/hybrid/tp/hf_native only, but strategy.name is "
                                        "ddp"),
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
    from toolkit.config.files import load_recipe
    from toolkit.strategies import validate_strategy

    ranks, overrides, words = BAD[case]
    with pytest.raises(RecipeError, match=re.escape(words)):
        validate_strategy(load_recipe(llama4_runs.recipe, overrides), world_size=ranks)


def test_mlp_columns_not_divisible_and_a_model_without_plan_are_one_line(tmp_path):
    from conftest import MINILM
    from toolkit.errors import RecipeError
    from toolkit.config.files import load_recipe
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
    # Llama 4's experts are packed tensors its plan splits in styles the toolkit does not build (packed_rowwise,
    # moe_tp_experts); its causal-LM head declares base_model_prefix "language_model" and holds the base model as
    # `model`, so the plan's names resolve under `model` (they once matched nothing: "matches no linear layer").
    # The first such entry is named, whichever transformers release lists which (Mixtral's split its packed
    # experts up to transformers 5.24 and names its attention only since 5.25)
    llama4 = recipe_for({"model_type": "llama4_text", "vocab_size": 30522, "hidden_size": 32,
                         "intermediate_size": 64, "intermediate_size_mlp": 64, "num_hidden_layers": 1,
                         "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 2, "head_dim": 8})
    from transformers import AutoConfig
    declared = AutoConfig.for_model("llama4_text").base_model_tp_plan
    pattern, style = next((p, s) for p, s in declared.items()
                          if s not in ("colwise", "rowwise", "embedding_rowwise", "replicated_with_grad_allreduce"))
    assert style.startswith(("packed", "moe"))
    with pytest.raises(RecipeError, match=re.escape(f"the model's plan asks for {style!r} at {pattern}")) as error:
        validate_strategy(llama4, world_size=2)
    assert str(error.value).endswith("use fsdp or zero for this model")
    # DiffLlama's plan names its embedding only, which the toolkit keeps whole: nothing would be split
    diffllama = recipe_for({"model_type": "diffllama", "vocab_size": 30522, "hidden_size": 32,
                            "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
                            "num_key_value_heads": 2})
    with pytest.raises(RecipeError, match=re.escape("diffllama's tensor-parallel plan splits no linear layer (it "
                                                    "names embedding_rowwise only)")):
        validate_strategy(diffllama, world_size=2)
    # an entry that matches no module is passed over only with the entries beside it (Qwen3-MoE's dense MLP on a
    # model of sparse layers): one renamed beside its matched partners would split half a pair; none matched at all
    # is named as such
    small = {"model_type": "llama", "vocab_size": 30522, "hidden_size": 32, "intermediate_size": 64,
             "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2}
    attention = {f"layers.*.self_attn.{n}_proj": "colwise" for n in "qkv"} | {"layers.*.self_attn.o_proj": "rowwise"}
    half = recipe_for({**small, "base_model_tp_plan": {**attention, "layers.*.mlp.gate_proj": "colwise",
                                                       "layers.*.mlp.up_proj": "colwise",
                                                       "layers.*.mlp.down_projection": "rowwise"}})
    with pytest.raises(RecipeError, match=re.escape("the plan entry layers.*.mlp.down_projection matches no module "
                                                    "of this model while layers.*.mlp.gate_proj beside it does")):
        validate_strategy(half, world_size=2)
    nothing = recipe_for({**small, "base_model_tp_plan": {"blocks.*.attn.q": "colwise", "blocks.*.attn.o": "rowwise"}})
    with pytest.raises(RecipeError, match=re.escape("llama's tensor-parallel plan matches no module of this model "
                                                    "(blocks.*.attn.q, blocks.*.attn.o)")):
        validate_strategy(nothing, world_size=2)
    validate_strategy(recipe_for({**small, "base_model_tp_plan": {**attention, "layers.*.moe.gate_proj": "colwise",
                                                                  "layers.*.moe.down_proj": "rowwise"}}),
                      world_size=2)  # a whole group of entries for layers this model has none of
    qwen3 = recipe_for({"model_type": "qwen3", "vocab_size": 30522, "hidden_size": 32, "intermediate_size": 64,
                        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8})
    validate_strategy(qwen3, world_size=2)  # its per-head norms' gradients are summed (the Qwen3 test below)
    # Mixtral's intermediate_size is its experts' width, and its experts stay whole on every TP rank: no degree need
    # divide it. Qwen3-MoE's dense MLP (mlp_only_layers) is split: its columns are refused by the layer they are in
    moe = {"vocab_size": 30522, "hidden_size": 32, "intermediate_size": 63, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts_per_tok": 2}
    validate_strategy(recipe_for({**moe, "model_type": "mixtral", "num_local_experts": 4}), world_size=2)
    qwen3_moe = {**moe, "model_type": "qwen3_moe", "num_experts": 4, "moe_intermediate_size": 32, "head_dim": 8}
    validate_strategy(recipe_for(qwen3_moe), world_size=2)  # every layer sparse: no MLP of 63 columns
    with pytest.raises(RecipeError, match=re.escape("layers.1.mlp.gate_proj has 63 output features, not divisible by "
                                                    "the tensor-parallel degree 2")):
        validate_strategy(recipe_for({**qwen3_moe, "mlp_only_layers": [1]}), world_size=2)


def test_sequence_parallel_on_an_encoder_is_one_line(minilm_runs):
    from toolkit.errors import RecipeError
    from toolkit.config.files import load_recipe
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
    from toolkit.config.files import load_recipe
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


@pytest.fixture(scope="module")
def qwen3_runs(tmp_path_factory):
    """A tiny Qwen3: its plan keeps q_norm and k_norm (RMSNorm over head_dim, after the column-wise q/k
    projections) whole on every rank, marked replicated_with_grad_allreduce. Dropout 0, global batch 8."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from conftest import Runs, _minilm_tokenizer, write_recipe

    root = tmp_path_factory.mktemp("qwen3")
    tokenizer = _minilm_tokenizer()
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():  # away from ones: the norm weights' gradients then differ between heads more
        for name, param in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.uniform_(0.5, 1.5)
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    # lr 1e-4: at 1e-3 the single reference itself moves one embedding element (2833, 30) by 3.4e-6 between 1
    # thread (launch --nproc 1) and 2 (train), rounding that Adam amplifies on an element whose summed gradient
    # nears zero; tp equalled the 1-thread run there to 4e-10. At 1e-4 tp and single differ by <= 1.3e-8.
    return Runs(root, write_recipe(root / "recipe.yaml", model_dir=root / "model", output_dir=root / "unused",
                                   batch={"micro_batch_size": 2, "grad_accum_steps": 4}, data={"eval": None},
                                   optim={"lr": 1.0e-4},
                                   train={"max_steps": 4, "eval_every": None, "consistency_check_every": 1,
                                          "progress": False}))


@pytest.mark.parametrize("arm", ["tp", "fsdp-tp2"])
def test_qwen3_per_head_norms_sum_their_gradients_over_the_tp_ranks(qwen3_runs, llama4_runs, arm):
    """Each TP rank normalizes only its own heads with the whole q_norm/k_norm weight, so its gradient of that
    weight is a partial sum over heads: summed over the ranks once per step, after accumulating 4 micro-batches
    (summed per micro-batch, as a backward hook would, it would be counted again each time). Without the sum
    the ranks' copies drift apart (the consistency check, every step, stops the run) and differ from single's.
    fsdp-tp2 at 2 ranks: 1 dp × 2 tp, the sum over FSDP's gradient shards, with sequence parallelism (Qwen3's
    blocks are Llama's four parts; the norms inside attention see the gathered sequence)."""
    overrides = (("strategy.name=tp",) if arm == "tp" else
                 ("strategy.name=fsdp", "strategy.tp_degree=2", "strategy.sequence_parallel=true"))
    run = qwen3_runs.get(arm, nproc=2, overrides=overrides)
    assert_matches_single(run, qwen3_runs.get("single"))
    comm = json.loads((run / "run.json").read_text())["comm_per_step"]
    if arm == "tp":  # the activations' (DTensor's), as on Llama; sequence parallelism reduce-scatters instead;
        # and the gradient norm's two over the split weights (dim 0 and dim 1), as on Llama
        assert comm["calls_by_op"]["all_reduce"] == 4 * 2 * 4 + 2
    # beside the loop's own small all-reduces (a Llama tp run's): one more, the 2 blocks' q_norm and k_norm
    # gradients, head_dim 8 each, in fp32
    llama = json.loads((llama4_runs.get("tp", nproc=2, overrides=ARMS["tp"][1]) / "run.json").read_text())
    assert comm["calls_by_op"]["allreduce_"] == llama["comm_per_step"]["calls_by_op"]["allreduce_"] + 1
    assert comm["bytes_by_op"]["allreduce_"] == llama["comm_per_step"]["bytes_by_op"]["allreduce_"] + 2 * 2 * 8 * 4


@pytest.mark.parametrize("fixture, arm, extra", [
    ("moe_runs", "tp", ()), ("mixtral_runs", "fsdp-tp2", ()),
    # sequence parallelism: a whole MoE layer gathers the sequence shards, computes the whole sequence and cuts its
    # output back to the shard (before: "aten.add.Tensor got mixed torch.Tensor and DTensor" at its residual add)
    ("moe_runs", "tp-sp", ()), ("mixtral_runs", "fsdp-tp2", ("strategy.sequence_parallel=true",))])
def test_moe_experts_stay_whole_on_each_tp_rank_and_train_as_single(request, fixture, arm, extra):
    """Mixtral's and Qwen3-MoE's plans split attention (and dense MLPs) only; their experts are named by the
    expert-parallel plan. Qwen3-MoE's plan also names the dense MLP of mlp_only_layers, which this model has none
    of: that entry matches no module and is passed over (before, the run was refused: "the plan entry
    layers.*.mlp.gate_proj matches no linear layer"). Each layer's router and experts are whole on every TP rank:
    equal to single (the experts tests' micro-8 reference, the same global batch of 8), every expert routed the
    same tokens, the plan's state bytes and collectives exact, and the layout says so."""
    from test_comm_prediction import assert_predicted

    runs = request.getfixturevalue(fixture)
    ranks, overrides = ARMS[arm]
    # fsdp-tp2: the ranks of each TP group checked every step to hold the same replicated weights, experts included
    run = runs.get(arm + "-sp" * bool(extra), nproc=ranks, overrides=(*overrides, *extra, "batch.micro_batch_size=2",
                                                                  "train.consistency_check_every=1"))
    reference = runs.get("single-m8")
    assert_matches_single(run, reference)
    assert [m["expert_tokens"] for m in metrics(run)] == [m["expert_tokens"] for m in metrics(reference)]
    info = json.loads((run / "run.json").read_text())
    assert info["memory_prediction"]["model_state_bytes"] == info["model_state_bytes"]
    assert_predicted(run)
    assert "MoE experts whole on each tp rank" in info["layout"] if arm == "fsdp-tp2" else (
        "(each MoE layer's experts whole on every rank)" in info["layout"])


# plans that gather a column-wise layer's output and split a row-wise layer's input on every rank
# (transformers' 'colwise_gather_output' and 'rowwise_split_input'): OLMo 2 normalises q and k over all heads
# (q_norm, k_norm of the whole projection), so its q, k, v outputs are gathered; Phi-3's fused qkv_proj and
# gate_up_proj are gathered, as each is then cut into its parts. GPT-NeoX's plan splits its input embedding
# ('embedding_rowwise'), which the toolkit keeps whole, as every embedding, and its fused, head-interleaved
# query_key_value column-wise
GATHERING = {
    "olmo2": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 64},
    "phi3": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "max_position_embeddings": 64},
    "gpt_neox": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                 "max_position_embeddings": 64},
}


@pytest.fixture(scope="module")
def gathering_runs(tmp_path_factory):
    """A tiny 2-block model of each family in GATHERING."""
    from conftest import tiny_family_runs

    # GPT-NeoX at lr 1e-4: its key biases' exact gradient is zero, so what they get is rounding, which Adam moves by
    # about lr a step whatever its size (test_model_parallel.FAMILY_LR says more; measured here at 1e-3: 6 of
    # query_key_value.bias's 96 elements 2.2e-6 apart after 5 steps, every other tensor within 1e-6 + 1e-5·|a|)
    return {family: tiny_family_runs(tmp_path_factory, "tp", family, fields,
                                     optim={"lr": 1.0e-4 if family == "gpt_neox" else 1.0e-3})
            for family, fields in GATHERING.items()}


@pytest.mark.parametrize("family", list(GATHERING))
def test_tp_with_gathered_outputs_and_split_inputs_matches_single(gathering_runs, family):
    """Before, these families were refused under tp ('colwise_gather_output', 'embedding_rowwise' were not styles
    the toolkit builds). Each now equals single (losses, grad norms, exported weights, eval loss); its collectives
    are those the plan predicts, byte for byte (a gathered output's all-gather forward, a split input's gradient
    all-gather backward, beside the all-reduces of plain column- and row-wise layers); and the plan predicts each
    rank's model states exactly."""
    from test_comm_prediction import assert_predicted

    from toolkit.config.files import load_recipe
    from toolkit.plan import predict as plan

    ranks, overrides = ARMS["tp"]
    runs = gathering_runs[family]
    run_dir = runs.get("tp", nproc=ranks, overrides=overrides)
    assert_matches_single(run_dir, runs.get("single"))
    assert_predicted(run_dir)
    run = json.loads((run_dir / "run.json").read_text())
    ops = run["comm_per_step"]["calls_by_op"]
    blocks, micro_batches = 2, 4
    # per block and micro-batch: olmo2 gathers q, k, v (forward) and o_proj's input gradient (backward); phi3
    # gathers qkv_proj and gate_up_proj (forward) and the input gradients of o_proj and down_proj (backward);
    # gpt_neox gathers nothing
    gathers = {"olmo2": 4, "phi3": 4, "gpt_neox": 0}[family]
    assert ops.get("all_gather_into_tensor", 0) == gathers * blocks * micro_batches, ops
    predicted = plan.predict(load_recipe(run_dir / "recipe.yaml"), world_size=ranks, runtime_bytes=0)
    assert [r.as_dict() for r in predicted.per_rank] == run["model_state_bytes"]


def test_tp_on_a_modernbert_classifier_matches_single(tmp_path_factory):
    """ModernBERT declares no plan; the toolkit's gathers its fused Wqkv and Wi (cut into q, k, v and input, gate
    by position after them) and splits the inputs of both Wo. Before, it was refused ('declares no tensor-parallel
    plan'). Equal to single, and its collectives byte for byte as the plan predicts."""
    from test_comm_prediction import assert_predicted

    from conftest import _minilm_tokenizer, tiny_family_runs

    tokenizer = _minilm_tokenizer()
    fields = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_labels": 2, "cls_token_id": tokenizer.cls_token_id, "sep_token_id": tokenizer.sep_token_id}
    runs = tiny_family_runs(tmp_path_factory, "tp", "modernbert", fields, task="sequence-classification")
    ranks, overrides = ARMS["tp"]
    run_dir = runs.get("tp", nproc=ranks, overrides=overrides)
    assert_matches_single(run_dir, runs.get("single"))
    assert_predicted(run_dir)
