"""Model parallel, pipelines and their hybrids with data parallelism against the single-process reference:
fp32, the same global batch, 5 steps, real processes on gloo. Two models: a tiny 4-block Llama with tied
input/output embeddings (its two copies live on the first and the last stage) and the pretrained MiniLM
classifier. Runs are shared by the assertions that read them."""

import json
import re

import pytest

from conftest import (Runs, assert_local_sgd_every_2_as_ddp, assert_matches_single, assert_same_run, exported_weights,
                      losses, metrics, tiny_family_runs)

ARMS = {
    # name: (ranks, overrides); global batch 8 = data shards × micro 2 × accumulation
    "mp": (1, ("strategy.name=model_parallel", "batch.grad_accum_steps=4")),
    "pp-gpipe": (2, ("strategy.name=pipeline", "strategy.schedule=gpipe", "batch.grad_accum_steps=4")),
    "pp-1f1b": (2, ("strategy.name=pipeline", "strategy.schedule=1f1b", "batch.grad_accum_steps=4")),
    "pp-interleaved": (2, ("strategy.name=pipeline", "strategy.schedule=interleaved-1f1b",
                           "strategy.stages_per_rank=2", "batch.grad_accum_steps=4")),
    # zero-bubble: the backward split into input and weight gradients; V-shaped schedules hold the tied
    # embedding's two copies (first and last stage) on rank 0
    "pp-interleaved-zb": (2, ("strategy.name=pipeline", "strategy.schedule=interleaved-zb",
                              "strategy.stages_per_rank=2", "batch.grad_accum_steps=4")),
    "pp-zbv": (2, ("strategy.name=pipeline", "strategy.schedule=zbv", "strategy.stages_per_rank=2",
                   "batch.grad_accum_steps=4")),
    "pp-dualpipev": (2, ("strategy.name=pipeline", "strategy.schedule=dualpipev", "strategy.stages_per_rank=2",
                         "batch.grad_accum_steps=4")),
    # split_head: the head's rows of the vocabulary over the stages (this Llama's head outweighs its 4 blocks: the
    # first stage holds every block and rows, the second rows alone), each token's log-sum-exp and next-token logit
    # passed on with the final norm's output; the tied embedding's gradient summed over every copy
    "pp-1f1b-head": (2, ("strategy.name=pipeline", "strategy.split_head=true", "batch.grad_accum_steps=4")),
    # split_by time: the blocks' FLOPs weighted by their seconds per FLOP over the head's, measured at start on
    # both ranks (fewer rows on the first stage where a block runs slower per FLOP than the head)
    "pp-1f1b-head-time": (2, ("strategy.name=pipeline", "strategy.split_head=true", "strategy.split_by=time",
                              "batch.grad_accum_steps=4")),
    "pp-interleaved-zb-head": (2, ("strategy.name=pipeline", "strategy.schedule=interleaved-zb",
                                   "strategy.stages_per_rank=2", "strategy.split_head=true",
                                   "batch.grad_accum_steps=4")),
    # V-shaped: rank 0 holds the first stage (every block, rows) and the last (rows), rank 1 the two between
    "pp-zbv-head": (2, ("strategy.name=pipeline", "strategy.schedule=zbv", "strategy.stages_per_rank=2",
                        "strategy.split_head=true", "batch.grad_accum_steps=4")),
    "pp-dualpipev-head": (2, ("strategy.name=pipeline", "strategy.schedule=dualpipev", "strategy.stages_per_rank=2",
                              "strategy.split_head=true", "batch.grad_accum_steps=4")),
    "pp-ddp-head": (4, ("strategy.name=hybrid", "strategy.pipeline_degree=2", "strategy.data_parallel=ddp",
                        "strategy.split_head=true", "batch.grad_accum_steps=2")),
    # FSDP2 replicas: each stage's copy of the head sharded, gathered for the rows' forward, its shard summed with
    # the other holders' at the same dp position
    "pp-fsdp-head": (4, ("strategy.name=hybrid", "strategy.pipeline_degree=2", "strategy.data_parallel=fsdp",
                         "strategy.split_head=true", "batch.grad_accum_steps=2")),
    "pp-ddp": (4, ("strategy.name=hybrid", "strategy.pipeline_degree=2", "strategy.data_parallel=ddp",
                   "batch.grad_accum_steps=2")),
    "pp-fsdp": (4, ("strategy.name=hybrid", "strategy.pipeline_degree=2", "strategy.data_parallel=fsdp",
                    "batch.grad_accum_steps=2")),
    # a split backward under FSDP2's shards: torch's schedule reduce-scatters each stage's gradients after its last
    # weight-gradient action (PipelineStage.perform_reduce_grad)
    "pp-fsdp-zbv": (4, ("strategy.name=hybrid", "strategy.pipeline_degree=2", "strategy.data_parallel=fsdp",
                        "strategy.schedule=zbv", "strategy.stages_per_rank=2", "batch.grad_accum_steps=2")),
    "mp-ddp": (2, ("strategy.name=hybrid", "batch.grad_accum_steps=2")),
    # a split backward under DDP's replicas: torch takes the weight gradients outside DDP's hooks, so the strategy
    # averages each stage's gradients itself (before: the replicas differed after step 1)
    "pp-ddp-zbv": (4, ("strategy.name=hybrid", "strategy.pipeline_degree=2", "strategy.schedule=zbv",
                       "strategy.stages_per_rank=2", "batch.grad_accum_steps=2")),
    # each stage tensor-parallel over 2 ranks (the layout's degrees: pipeline with tp_degree 2), its tied embedding
    # whole on each tp rank, summed over the first and the last stage's ranks of the same tp position
    "pp-tp2": (4, ("parallel.pp=2", "parallel.tp=2", "batch.grad_accum_steps=4")),
    "pp-tp2-interleaved": (4, ("parallel.pp=2", "parallel.tp=2", "strategy.schedule=interleaved-1f1b",
                               "strategy.stages_per_rank=2", "batch.grad_accum_steps=4")),
    # all three: 2 stages × 2 replicas sharded by FSDP2 (of a tp rank's slices) × 2 tp ranks each
    "pp-fsdp-tp2": (8, ("parallel.pp=2", "parallel.dp_shard=2", "parallel.tp=2", "batch.grad_accum_steps=2")),
    # sequence parallelism inside the stages: each stage sends and receives its tp rank's share of the tokens (no
    # gather between stages); without FSDP the norms' partial gradients are summed with the rest once a step, under
    # FSDP each by FSDP
    "pp-tp2-sp": (4, ("parallel.pp=2", "parallel.tp=2", "strategy.sequence_parallel=true",
                      "batch.grad_accum_steps=4")),
    # loss_parallel: the last stage's head and the loss over a tp rank's 1/2 of the vocabulary, the first stage's
    # tied embedding split alike (its gradient, computed whole, cut to the rank's rows: tp_plan.keep_gradients_split)
    "pp-tp2-lossp": (4, ("parallel.pp=2", "parallel.tp=2", "strategy.loss_parallel=true", "batch.grad_accum_steps=4")),
    # two stages a rank of one block each: the first stage's one block both cuts its input and sends its share, the
    # middle stages' blocks are handed a received share
    "pp-tp2-sp-interleaved": (4, ("parallel.pp=2", "parallel.tp=2", "strategy.sequence_parallel=true",
                                  "strategy.schedule=interleaved-1f1b", "strategy.stages_per_rank=2",
                                  "batch.grad_accum_steps=4")),
    # every forward before the first backward: the stages' tp collectives in another order than 1f1b's
    "pp-tp2-gpipe": (4, ("parallel.pp=2", "parallel.tp=2", "strategy.schedule=gpipe", "batch.grad_accum_steps=4")),
    # the tied embedding's rows of the vocabulary (15,261: odd) FSDP-sharded unevenly over the 2 replicas
    "pp-fsdp-tp2-sp-lossp": (8, ("parallel.pp=2", "parallel.dp_shard=2", "parallel.tp=2",
                                 "strategy.sequence_parallel=true", "strategy.loss_parallel=true",
                                 "batch.grad_accum_steps=2")),
    # two stages a rank: FSDP2 units of both, gathered and reduced per stage, the tp slices' names unique per stage
    "pp-fsdp-tp2-interleaved": (8, ("parallel.pp=2", "parallel.dp_shard=2", "parallel.tp=2",
                                    "strategy.schedule=interleaved-1f1b", "strategy.stages_per_rank=2",
                                    "batch.grad_accum_steps=2")),
}
# gradient compression on the stages' ddp replicas (hybrid, 2 stages × 2 replicas): DDP's own hooks, one per stage;
# they change the maths on purpose, so they are held to other references than single (below)
PP_DDP = ARMS["pp-ddp"][1]
LEVER_ARMS = {
    # compressed from step 3, the step the collective counter counts (test_comm_prediction)
    "pp-ddp-powersgd": (4, (*PP_DDP, "strategy.gradient_compression=powersgd", "strategy.powersgd_rank=2",
                            "strategy.powersgd_start_step=2")),
    # at a rank no smaller than any matrix's side nothing is compressed: the exact pp-ddp run
    "pp-ddp-powersgd-full": (4, (*PP_DDP, "strategy.gradient_compression=powersgd",
                                 "strategy.powersgd_rank=100000", "strategy.powersgd_start_step=2")),
    # local SGD: each pipeline replica steps alone, the stages' parameters averaged after steps 3 and 5 (the last);
    # the collective counter counts step 3, a sync. (Every 2 steps it would count step 4, whose longest sample is a
    # new padded length on this data: torch's stages then send their shape metadata, 178 pickled bytes the
    # prediction leaves out)
    "pp-ddp-localsgd3": (4, (*PP_DDP, "strategy.sync_every=3")),
}
# 2 ranks at most (22M parameters on 2 cores); the other schedules run on the Llama (the suite's budget)
MINILM_ARMS = ("mp", "pp-interleaved", "pp-zbv")


@pytest.mark.parametrize("arm", list(ARMS))
def test_split_strategies_match_single_on_a_tied_llama(llama4_runs, arm):
    ranks, overrides = ARMS[arm]
    run = llama4_runs.get(arm, nproc=ranks, overrides=overrides)
    assert_matches_single(run, llama4_runs.get("single"))


def test_tensor_parallel_stages_recompute_as_one_process_with_the_collectives_planned(llama4_runs):
    """Activation checkpointing on tensor-parallel stages: a block's recompute reruns its row-wise exits' all-reduces
    up to the last tensor it saves (dims/recompute.py, read from each stage's own blocks); the same losses as
    without it, the single process's training, and the counter's collectives."""
    from test_activation_checkpointing import AC, assert_same_losses, recorded
    from test_comm_prediction import assert_predicted

    ranks, overrides = ARMS["pp-tp2"]
    run = llama4_runs.get("pp-tp2-ac", nproc=ranks, overrides=(*overrides, *AC))
    assert_matches_single(run, llama4_runs.get("single"))
    assert_same_losses(run, llama4_runs.get("pp-tp2", nproc=ranks, overrides=overrides))
    assert recorded(run)["recompute"] == "full"
    assert_predicted(run)


# other families than the Llama, cut by what each model declares (toolkit.model.stages): GPT-2 with learned
# positions, Conv1D layers and a head tied to its input embedding; GPT-NeoX
# with its own module names (embed_in, final_layer_norm, embed_out), partial rotary and parallel residuals
FAMILIES = {
    "gpt2": {"n_embd": 32, "n_layer": 4, "n_head": 4, "n_positions": 64, "tie_word_embeddings": True},
    "gpt_neox": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
                 "max_position_embeddings": 64, "tie_word_embeddings": False},
}
# lr per family. GPT-NeoX at 1e-4, not 1e-3: its fused query_key_value bias holds the key biases, whose exact
# gradient is zero (softmax does not change when every key score of a query moves by the same amount), so their
# gradient is rounding, which differs with the summation order, and Adam moves such an element by about lr a step
# whatever its gradient's size. Measured at 1e-3: 3 of 96 elements (index 35: head 1's key) 1.5e-6 apart after 5
# steps, every other tensor within 1e-6 + 1e-5·|a|
FAMILY_LR = {"gpt2": 1.0e-3, "gpt_neox": 1.0e-4}
# split_head on GPT-NeoX: its untied embed_out's two copies (one per stage with rows of it) sum their gradients (GPT-2's
# tied head: test_gpt2s_head_split_over_the_stages_matches_single)
FAMILY_ARMS = (("gpt2", "pp-1f1b"), ("gpt_neox", "pp-1f1b"), ("gpt_neox", "pp-1f1b-head"))


@pytest.fixture(scope="module")
def family_runs(tmp_path_factory) -> dict[str, Runs]:
    """A tiny 4-block model of each family in FAMILIES."""
    return {family: tiny_family_runs(tmp_path_factory, "mp", family, fields, data={"eval": None},
                                     optim={"lr": FAMILY_LR[family]}) for family, fields in FAMILIES.items()}


@pytest.mark.parametrize("family,arm", FAMILY_ARMS)
def test_pipelines_of_other_families_match_single(family_runs, family, arm):
    ranks, overrides = ARMS[arm]
    runs = family_runs[family]
    run = runs.get(arm, nproc=ranks, overrides=overrides)
    assert_matches_single(run, runs.get("single"))
    layout = json.loads((run / "run.json").read_text())["layout"]
    # GPT-2: each rank read only its stages' tensors from the saved files, the tied head's under the embedding's
    # name. GPT-NeoX's files name its head embed_out.weight, which from_pretrained renames to lm_head.weight: a
    # file read as it is would miss it, so every rank builds the whole model through from_pretrained
    how = {"gpt2": "each rank read only its stages' tensors from the pretrained safetensors files",
           "gpt_neox": "every rank built the whole model, then kept its stages"}[family]
    assert layout.endswith(f"; weights: {how}"), layout


def test_gpt2s_head_split_over_the_stages_matches_single(family_runs):
    """GPT-2's tied head split over the stages (its Conv1D blocks and learned positions on the first, with rows of
    the head; the second rows alone), at lr 1e-4. At the family's 1e-3 the losses match to 1e-5 but one element of
    4,096 in transformer.h.1.mlp.c_fc.weight ends 1.22e-6 from single's (bound 1e-6 + 1e-5·|a| = 1.07e-6): the
    cross-entropy is summed in another order (each stage's log-sum-exp over its rows, then combined), and Adam moves
    an element whose gradient is at rounding level by about lr whatever its size (as FAMILY_LR says of GPT-NeoX)."""
    runs, low = family_runs["gpt2"], ("optim.lr=1e-4",)
    run = runs.get("pp-1f1b-head-lr1e-4", nproc=2, overrides=(*ARMS["pp-1f1b-head"][1], *low))
    assert_matches_single(run, runs.get("single-lr1e-4", overrides=low))
    assert "+ head rows 0-" in json.loads((run / "run.json").read_text())["layout"]


FP16_M2 = ("batch.micro_batch_size=2", "batch.grad_accum_steps=2", "strategy.gradient_compression=fp16")


def _equal_but_fp16_flips(run, ddp) -> None:
    """Losses to 1e-5; weights to 1e-6 + 1e-5·|a| but for at most 1 element in 10,000 of the model, each within 5 lr
    (test_fp16_compressed_stage_replicas_equal_ddp_under_the_same_hook says why)."""
    assert losses(run) == pytest.approx(losses(ddp), rel=1e-5)
    ours, theirs = exported_weights(run), exported_weights(ddp)
    assert ours.keys() == theirs.keys()
    flipped = total = 0
    for name, tensor in theirs.items():
        apart = (ours[name] - tensor).abs()
        assert float(apart.max()) <= 5 * 1e-3, name
        flipped += int((apart > 1e-6 + 1e-5 * tensor.abs()).sum())
        total += tensor.numel()
    assert flipped <= total // 10_000, flipped


def test_fp16_compressed_stage_replicas_equal_ddp_under_the_same_hook(llama_runs):
    """Each stage's replicas all-reduce through torch's fp16_compress_hook, as DDP's replicas of the whole model do
    with the same samples per replica (global batch 8 both): on the untied 2-block Llama the same gradients are
    rounded to fp16 the same way: the same losses to 1e-5, and the same weights but where fp32's summation order
    (the stage's gradients differ from the whole model's by ~1e-9) put a gradient on the other side of an fp16
    rounding boundary. The hook then rounds it one fp16 step the other way, which AdamW can turn into up to about
    lr a step (measured: 7 of lm_head's 976,704 elements, 2.1e-5 at most, and 1 of a k_proj's 512, after 5 steps);
    at most 1 element in 10,000 of the model, and 5 lr.

    Not on a tied model: the pipeline's two copies of a tied embedding (first and last stage) are each compressed,
    then summed (strategy._sync_tied), where DDP compresses their sum; rounding and fp16's underflow (a gradient
    under 6e-8 after the hook's division by 2) then differ, and AdamW moves an element by up to about lr a step
    whatever its gradient's size (measured on the tied Llama: the embedding 6.6e-4 apart after 5 steps at lr 1e-3,
    the blocks 1.2e-5)."""
    run = llama_runs.get("pp-ddp-fp16c", nproc=4, overrides=("strategy.name=hybrid", "strategy.pipeline_degree=2",
                                                             *FP16_M2))
    _equal_but_fp16_flips(run, llama_runs.get("ddp-fp16c-m2", nproc=2, overrides=("strategy.name=ddp", *FP16_M2)))
    # the lever is on: each stage's replicas sent their gradients as fp16, byte for byte as predicted
    from test_comm_prediction import assert_predicted

    assert_predicted(run)
    audit = json.loads((run / "run.json").read_text())["precision_audit"]["grad_reduction"]
    assert audit == "all-reduce mean over 2 replicas (fp32, sent as fp16)"


def test_a_split_backward_averages_its_replicas_in_fp16_as_ddps_hook_does(llama_runs):
    """A zero-bubble schedule's stages are not DDP-wrapped (their weight gradients bypass DDP's hooks): the strategy
    averages each stage's gradients itself after the schedule, under gradient_compression fp16 as torch's
    fp16_compress_hook sends a bucket (cast, divided by the replicas, summed in fp16): DDP's run with the same hook
    and samples, as above, and the bytes halved as predicted."""
    from test_comm_prediction import assert_predicted

    run = llama_runs.get("pp-ddp-zb-fp16c", nproc=4, overrides=(
        "strategy.name=hybrid", "strategy.pipeline_degree=2", "strategy.schedule=interleaved-zb", *FP16_M2))
    _equal_but_fp16_flips(run, llama_runs.get("ddp-fp16c-m2", nproc=2, overrides=("strategy.name=ddp", *FP16_M2)))
    assert_predicted(run)
    audit = json.loads((run / "run.json").read_text())["precision_audit"]["grad_reduction"]
    assert audit == "all-reduce mean over 2 replicas (fp32, sent as fp16)"


def test_local_sgd_over_stage_replicas_equals_local_sgd_over_ddp_replicas(llama_runs, llama4_runs):
    """Between syncs each replica of the pipeline steps alone on its own samples, as each DDP rank does under local
    SGD with the same samples (global batch 8 both, on the untied 2-block Llama), and the syncs average the same
    parameters: the same losses and final weights to fp32's 1e-5."""
    local = ("batch.micro_batch_size=2", "batch.grad_accum_steps=2", "strategy.sync_every=2")
    run = llama_runs.get("pp-ddp-localsgd2", nproc=4, overrides=("strategy.name=hybrid",
                                                                 "strategy.pipeline_degree=2", *local))
    ddp = llama_runs.get("ddp-localsgd2-m2", nproc=2, overrides=("strategy.name=ddp", *local))
    # the drift is the whole model's, its stages' sums added up: what DDP's replicas measure on the same samples;
    # the replica check (every step) measured it between syncs and demanded equal stages at each
    assert_local_sgd_every_2_as_ddp(run, ddp)
    info = json.loads((run / "run.json").read_text())
    assert info["replica_check"].startswith("every 1 step(s): 2 replicas of each stage (local SGD, equal after each "
                                            "sync (every 2 steps))")
    assert info["precision_audit"]["grad_reduction"] == "none: local SGD, parameters averaged every 2 steps"
    # the tied Llama: the two tied copies of each replica stay equal through its syncs (checked every step)
    ranks, overrides = LEVER_ARMS["pp-ddp-localsgd3"]
    tied = json.loads((llama4_runs.get("pp-ddp-localsgd3", nproc=ranks, overrides=overrides) / "run.json").read_text())
    assert tied["status"] == "completed" and "tied model.embed_tokens.weight and lm_head.weight" in \
        tied["replica_check"]


def test_powersgd_on_stage_replicas_at_full_rank_equals_the_exact_run(llama4_runs):
    ranks, overrides = LEVER_ARMS["pp-ddp-powersgd-full"]
    run = llama4_runs.get("pp-ddp-powersgd-full", nproc=ranks, overrides=overrides)
    assert_same_run(run, llama4_runs.get("pp-ddp", nproc=4, overrides=PP_DDP), rtol=1e-5, atol=1e-6)
    low = llama4_runs.get("pp-ddp-powersgd", nproc=4, overrides=LEVER_ARMS["pp-ddp-powersgd"][1])
    got, exact = losses(low), losses(llama4_runs.get("pp-ddp", nproc=4, overrides=PP_DDP))
    # reduced whole up to its start step, then rank 2 factors: steps 1-3 as the exact run (step 3's update is the
    # first from compressed gradients), then apart
    assert got[:3] == pytest.approx(exact[:3], rel=1e-6) and got[3:] != pytest.approx(exact[3:], rel=1e-6)
    # each stage's DDP module keeps its own error and factors: measured on every rank from the first compressed
    # step on, and the plan (pipeline.memory, per stage) predicts the measured bytes exactly
    info = json.loads((low / "run.json").read_text())
    plain = json.loads((llama4_runs.get("pp-ddp", nproc=4, overrides=PP_DDP) / "run.json").read_text())
    assert all(ours["optim_bytes"] > theirs["optim_bytes"]
               for ours, theirs in zip(info["model_state_bytes"], plain["model_state_bytes"], strict=True))
    assert info["memory_prediction"]["model_state_bytes"] == info["model_state_bytes"]


def test_tied_embedding_is_exported_once_and_reloads_tied(llama4_runs):
    from transformers import AutoModelForCausalLM

    run = llama4_runs.get("pp-1f1b", nproc=2, overrides=ARMS["pp-1f1b"][1])
    assert "lm_head.weight" not in exported_weights(run)
    loaded = AutoModelForCausalLM.from_pretrained(run / "model")
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight


def test_replica_check_compares_the_tied_embeddings_two_stage_copies(llama4_runs):
    """The first and the last stage each hold a copy of the tied embedding, updated by their own optimizers:
    these runs (consistency_check_every 1) compared the two copies every step, besides DDP's replicas
    (before: 'nothing to compare' under a pipeline)."""
    def said(arm):
        ranks, overrides = ARMS[arm]
        return json.loads((llama4_runs.get(arm, nproc=ranks, overrides=overrides) / "run.json").read_text())[
            "replica_check"]

    tied = "the tied model.embed_tokens.weight and lm_head.weight on {} first and last stage, 1 tensor"
    assert said("pp-1f1b") == said("pp-interleaved") == "every 1 step(s): " + tied.format("the")
    # rank 0's stage: the embedding and blocks 0-2 (9 tensors each; the split by FLOPs leaves the last stage
    # one block beside the head)
    assert said("pp-ddp") == "every 1 step(s): 2 replicas of each stage (DDP), 28 tensors; " + \
        tied.format("each pipeline's")
    assert said("pp-fsdp") == "every 1 step(s): " + tied.format("each pipeline's")  # shards: tied copies only
    # tensor-parallel stages: what tp keeps whole (rank 0: the embedding and blocks 0-2's two norms each) over the
    # stage's tp ranks, and the tied copies over the first and last stage's ranks of the same tp position
    assert said("pp-tp2") == "every 1 step(s): 2 tensor-parallel ranks of each stage hold its embeddings, norms " \
        "and head in full, 7 tensors; " + tied.format("the")
    # with fsdp replicas, the same tensors' shards: the tp ranks of a replica hold the same shard of each
    assert said("pp-fsdp-tp2") == "every 1 step(s): 2 tensor-parallel ranks of each stage hold its embeddings, " \
        "norms and head in full, 7 tensors; " + tied.format("each pipeline's")


def test_fsdp_replicas_of_rows_they_do_not_divide_hold_the_planned_model_states(llama4_runs):
    """pp 2 × dp_shard 3: hidden 32 over 3 replicas is shards of 11, 11 and 10 rows. FSDP2 pads each shard's
    parameter and gradient to 11 rows, while AdamW's moments take the unpadded shard (memory.state_bytes_per_rank
    plans dim0_held per replica; before, every replica was planned the padded moments: 6 ranks, 2 of them right)."""
    info = json.loads((llama4_runs.get("pp-fsdp-dp3", nproc=6, overrides=(
        "parallel.pp=2", "parallel.dp_shard=3", "batch.global_batch_size=12", "batch.grad_accum_steps=2",
        "train.max_steps=2")) / "run.json").read_text())
    measured = info["model_state_bytes"]
    assert measured[0]["optim_bytes"] != measured[2]["optim_bytes"]  # the last replica holds fewer rows
    assert info["memory_prediction"]["model_state_bytes"] == measured


def test_tensor_parallel_stages_sharded_over_replicas_hold_the_planned_model_states(llama4_runs):
    """pp × dp_shard × tp: each rank's parameters, gradients and AdamW moments are FSDP's dim-0 shard of its tp
    slices (memory.state_bytes_per_rank), byte for byte as the run measured them; before, the plan held the tp
    slices whole (2× what a rank holds)."""
    ranks, overrides = ARMS["pp-fsdp-tp2"]
    info = json.loads((llama4_runs.get("pp-fsdp-tp2", nproc=ranks, overrides=overrides) / "run.json").read_text())
    assert info["memory_prediction"]["model_state_bytes"] == info["model_state_bytes"]
    whole = json.loads((llama4_runs.get("pp-tp2", nproc=4, overrides=ARMS["pp-tp2"][1]) / "run.json").read_text())
    # the replicas halve what a tp rank of a stage holds (every dim 0 here divides by 2)
    assert [r["params_bytes"] * 2 for r in info["model_state_bytes"][::2]] == \
        [r["params_bytes"] for r in whole["model_state_bytes"]]


@pytest.mark.parametrize("arm", MINILM_ARMS)
def test_split_strategies_match_single_on_minilm(minilm_runs, arm):
    ranks, overrides = ARMS[arm]
    assert_matches_single(minilm_runs.get(arm, nproc=ranks, overrides=overrides), minilm_runs.get("single"))


def test_the_layout_line_names_every_ranks_blocks():
    """Rank 0 writes the line (and run.json's layout) for the whole run: every rank's stages, not its own."""
    from toolkit.strategies.pipeline.layout import Grid

    parts = [0, 0, 1, 1, 2, 3]  # block -> stage
    assert Grid(pp=2, dp=1).stages_by_rank(parts, 2) == (
        "rank 0: stage 0: blocks 0-1; stage 2: blocks 4; rank 1: stage 1: blocks 2-3; stage 3: blocks 5")
    assert Grid(pp=2, dp=2).stages_by_rank([0, 0, 1, 1], 1) == (
        "ranks 0-1: stage 0: blocks 0-1; ranks 2-3: stage 1: blocks 2-3")  # a stage's replicas


def test_layout_and_bubble_are_reported(llama4_runs):
    run = json.loads((llama4_runs.get("pp-interleaved", nproc=2, overrides=ARMS["pp-interleaved"][1]) /
                      "run.json").read_text())
    assert run["layout"].startswith("4 stages over 2 ranks, schedule interleaved-1f1b with 4 micro-batches; "
                                    "rank 0: stage 0: blocks 0; stage 2: blocks 2")
    # the saved Llama's files hold every tensor: each rank read its stages' alone (tests/test_pipeline_loading.py)
    assert run["layout"].endswith("; weights: each rank read only its stages' tensors from the pretrained "
                                  "safetensors files")
    # each rank's peak by the end of setup is on record, before and below the run's, and the plan predicts it
    # from what the rank built beside its parameters (nothing here: its stages' tensors read alone)
    for peak in run["peak_memory"]:
        assert 0 < peak["setup_peak_bytes"] <= peak["peak_mem_bytes"]
    predicted = run["memory_prediction"]
    assert predicted["setup_peak_bytes_per_rank"] == [predicted["runtime_bytes"] + r["params_bytes"]
                                                      for r in predicted["model_state_bytes"]]
    per_rank = run["strategy_measurements"]
    assert [r["stages"] for r in per_rank] == [[0, 2], [1, 3]]
    # (p-1)/(v·m+p-1) with p = 2 ranks, v = 2 stages per rank, m = 4 micro-batches
    assert all(r["bubble_theory"] == pytest.approx(1 / 9) for r in per_rank)
    assert all(0.0 <= r["bubble_measured"] < 1.0 for r in per_rank)
    # posting sends and receives is time a rank spends (gloo copies in its thread): counted apart from the idle
    assert all(0.0 < r["p2p_measured"] < 1.0 - r["bubble_measured"] for r in per_rank)
    # V-shaped: rank 0 runs the first and the last stage; its theory is the simulated order's (below 1/9)
    zbv = json.loads((llama4_runs.get("pp-zbv", nproc=2, overrides=ARMS["pp-zbv"][1]) / "run.json").read_text())
    assert "rank 0: stage 0: blocks 0; stage 3: blocks 3; rank 1: stage 1: blocks 1; stage 2: blocks 2" in \
        zbv["layout"]
    assert [r["stages"] for r in zbv["strategy_measurements"]] == [[0, 3], [1, 2]]
    assert all(0.0 <= r["bubble_theory"] < 1 / 9 for r in zbv["strategy_measurements"])
    # with each stage as long as its FLOPs: the head (6 × 32 × 30522 a token, over 10 blocks' worth) sits on rank 0
    # beside stage 0, so rank 1 waits for it most of the step
    rank0, rank1 = (r["bubble_predicted"] for r in zbv["strategy_measurements"])
    assert rank0 < 0.1 < 0.5 < rank1
    comm = run["comm_per_step"]
    # every micro-batch's activations cross 3 stage boundaries forward and 3 back: 2 × length × 32 fp32 each,
    # and nothing else is sent (the tied embedding's gradient is an all-reduce); length: the counted step's
    # longest sample rounded up to 8, not max_length 32
    longest = max(n for rank in comm["micro_batch_shapes_per_rank"] for _, n in rank)
    length = -(-longest // 8) * 8
    assert length < 32 and comm["p2p_send_bytes_all_ranks"] == 4 * 6 * 2 * length * 32 * 4
    # the lengths whose stages were built (training's, evaluation's): few, each a multiple of 8 up to 32
    built = per_rank[0]["padded_lengths_built"]
    assert built == per_rank[1]["padded_lengths_built"] and length in built
    assert len(set(built)) == len(built) and all(n % 8 == 0 and n <= 32 for n in built)
    # the shape changed mid-run (these 5 steps: 24, then 16), and every arm still equals single
    # (test_split_strategies_match_single_on_a_tied_llama reads the same runs)
    assert len(built) >= 2
    mp = json.loads((llama4_runs.get("mp", overrides=ARMS["mp"][1]) / "run.json").read_text())
    assert mp["layout"].startswith("blocks 0-1 on cpu, blocks 2-3 on cpu")
    # both parts on the one CPU: the split's code ran, but its memory and speed are no split's, and run.json says
    # so (the compare report then names it and recommends it for nothing), for model parallel × DDP too
    split = json.loads((llama4_runs.get("mp-ddp", nproc=2, overrides=ARMS["mp-ddp"][1]) / "run.json").read_text())
    for run, name in ((mp, "model_parallel"), (split, "hybrid")):
        assert run["fallback"] == (f"strategy {name} put all 2 parts of the model on cpu: the split's code ran "
                                   "(inputs moved at each boundary), but one device held the whole model, so its "
                                   "memory and speed are not a split's; list two or more devices in "
                                   "strategy.devices (e.g. [cuda:0, cuda:1])")


def fp16_pipeline_run(llama4_runs):
    """pp-1f1b in fp16 (its ShardedGradScaler over both stages), 8 steps at a learning rate that moves the loss."""
    return llama4_runs.get("pp-1f1b-fp16", nproc=2, overrides=(*ARMS["pp-1f1b"][1], "precision=fp16",
                                                                "train.max_steps=8", "optim.lr=0.003"))


def test_fp16_pipeline_stages_agree_on_skipped_steps(llama4_runs):
    run = fp16_pipeline_run(llama4_runs)
    steps = metrics(run)
    assert steps[0]["loss_scale"] == 65536.0 and all(isinstance(m["skipped"], bool) for m in steps)
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.5


BAD = {
    "more stages than blocks": (4, ("strategy.name=pipeline", "strategy.schedule=interleaved-1f1b",
                                    "strategy.stages_per_rank=2"),
                                "8 stages but the model has 4 blocks; use at most 4 stages"),
    "split out of range": (1, ("strategy.name=model_parallel", "strategy.split=[4]"),
                           "strategy.split [4] is out of range: the model has 4 blocks"),
    "split not increasing": (1, ("strategy.name=model_parallel", "strategy.devices=[cpu,cpu,cpu]",
                                 "strategy.split=[3,2]"), "strategy.split [3, 2] is not increasing"),
    "interleaved with one stage per rank": (2, ("strategy.name=pipeline", "strategy.schedule=interleaved-1f1b"),
                                            "interleaved-1f1b needs strategy.stages_per_rank of 2 or more"),
    "V-shaped schedule with one stage per rank": (2, ("strategy.name=pipeline", "strategy.schedule=zbv"),
                                                 "strategy.schedule zbv runs exactly 2 stages per rank (V-shaped): "
                                                 "set strategy.stages_per_rank: 2"),
    "dualpipev with fewer micro-batches than stages": (
        2, ("strategy.name=pipeline", "strategy.schedule=dualpipev", "strategy.stages_per_rank=2",
            "batch.grad_accum_steps=2"),
        "schedule dualpipev needs at least as many micro-batches per step as stages (4), but "
        "batch.grad_accum_steps is 2"),
    "micro-batches not in whole rounds": (
        2, ("strategy.name=pipeline", "strategy.schedule=interleaved-zb", "strategy.stages_per_rank=2",
            "batch.grad_accum_steps=5", "batch.micro_batch_size=1"),
        "must be a multiple of 2 (or at most 2), but batch.grad_accum_steps is 5"),
    "world not divisible": (4, ("strategy.name=hybrid", "strategy.pipeline_degree=3"),
                            "world size 4 is not divisible by strategy.pipeline_degree 3"),
    # a schedule that splits backward in two ran the first part, then every rank stopped in the second ("Trying to
    # backward an extra time ... selective activation checkpoint"); full checkpointing runs with them
    **{f"selective checkpointing under {schedule}": (
        2, ("strategy.name=pipeline", f"strategy.schedule={schedule}", "strategy.stages_per_rank=2",
            "train.activation_checkpointing=selective", "batch.micro_batch_size=4"),
        f"selective cannot run with strategy.schedule {schedule}, which runs each backward in two parts")
       for schedule in ("interleaved-zb", "zbv", "dualpipev")},
    "too few micro-batches": (2, ("strategy.name=pipeline", "strategy.schedule=1f1b", "batch.grad_accum_steps=1"),
                              "schedule 1f1b needs at least as many micro-batches per step as stages (2)"),
    "no blocks found": (2, ("strategy.name=pipeline", "strategy.blocks=[NoSuchBlock]"),
                        "set strategy.blocks to the block class name"),
    # stages hold runs of the layer stack: a norm passed the split check as 9 "blocks", then cut past the stack
    "norms as pipeline blocks": (3, ("strategy.name=pipeline", "strategy.schedule=gpipe",
                                     "strategy.blocks=[LlamaRMSNorm]"),
                                 "strategy.blocks ['LlamaRMSNorm']: a pipeline cuts LlamaForCausalLM between the 4 "
                                 "blocks of its layer stack (LlamaDecoderLayer), which these do not name"),
    "MLPs as hybrid blocks": (4, ("strategy.name=hybrid", "strategy.pipeline_degree=2",
                                  "strategy.blocks=[LlamaMLP]"), "set it to [LlamaDecoderLayer]"),
    "device that does not exist": (1, ("strategy.name=model_parallel", "strategy.devices=[cuda:0,cuda:1]"),
                                   "strategy.devices: cuda:0 does not exist"),
    # tensor-parallel stages: what tp refuses, and the schedules not tested with them
    "tp stages under a split backward": (4, ("strategy.name=pipeline", "strategy.tp_degree=2",
                                             "strategy.schedule=zbv", "strategy.stages_per_rank=2"),
                                         "strategy.schedule zbv with tensor-parallel stages is not tested yet"),
    "tp stages of heads the degree does not divide": (
        6, ("strategy.name=pipeline", "strategy.tp_degree=3"),
        "the model's attention heads (num_attention_heads = 4) are not divisible by the tensor-parallel degree 3"),
    # strategy.split_by time (pipeline/timing.py): a measure it knows, a ratio for it alone, positive, a split it
    # decides, a block it times on one rank
    "unknown split measure": (2, ("strategy.name=pipeline", "strategy.split_by=params"),
                              "strategy.split_by: unknown value 'params'; choose flops or time"),
    "block time ratio of a split by flops": (2, ("strategy.name=pipeline", "strategy.block_time_ratio=1.3"),
                                             "strategy.block_time_ratio weights the blocks of a split by time: set "
                                             "strategy.split_by=time"),
    "block time ratio of zero": (2, ("strategy.name=pipeline", "strategy.split_by=time",
                                     "strategy.block_time_ratio=0"), "strategy.block_time_ratio must be a number > 0"),
    "infinite block time ratio": (2, ("strategy.name=pipeline", "strategy.split_by=time",
                                      "strategy.block_time_ratio=.inf"), "strategy.block_time_ratio must be a number"),
    "split by time and by hand": (2, ("strategy.name=pipeline", "strategy.split_by=time", "strategy.split=[2]"),
                                  "strategy.split places the blocks by hand, where split_by time places them"),
    "split by time of tp stages": (4, ("strategy.name=pipeline", "strategy.split_by=time", "strategy.tp_degree=2"),
                                   "strategy.split_by=time times a block on one rank, not split over "
                                   "strategy.tp_degree ranks; pin strategy.block_time_ratio"),
    "split by time without a pipeline": (4, ("strategy.name=hybrid", "strategy.data_parallel=ddp",
                                             "strategy.split_by=time"),
                                         "strategy.schedule / stages_per_rank / split_head / split_by / "
                                         "block_time_ratio need strategy.pipeline_degree (a pipeline)"),
    "tp stages over no ranks": (4, ("strategy.name=pipeline", "strategy.tp_degree=0"),
                                "strategy.tp_degree must be >= 1, got 0"),  # was taken as 1 without a word
    "tp stages with ddp replicas": (8, ("strategy.name=hybrid", "strategy.pipeline_degree=2",
                                        "strategy.data_parallel=ddp", "strategy.tp_degree=2"),
                                    "tensor-parallel stages with 2 ddp replicas each: DDP cannot hold "
                                    "tensor-parallel (DTensor) weights"),
    # a model split × ddp (no pipeline_degree) splits no layer over ranks: tp_degree was taken and ignored
    "tp without a pipeline under hybrid": (4, ("strategy.name=hybrid", "strategy.data_parallel=ddp",
                                               "strategy.tp_degree=2"),
                                           "strategy.tp_degree under hybrid makes each pipeline stage tensor-parallel: "
                                           "it needs strategy.pipeline_degree and strategy.data_parallel=fsdp"),
    "sequence parallel without tp stages": (2, ("strategy.name=pipeline", "strategy.sequence_parallel=true"),
                                            "strategy.sequence_parallel needs tensor-parallel stages: set "
                                            "strategy.tp_degree (2 or more)"),
    "loss parallel without tp stages": (2, ("strategy.name=pipeline", "strategy.loss_parallel=true"),
                                        "strategy.loss_parallel needs tensor-parallel stages: set strategy.tp_degree "
                                        "(2 or more)"),
    "loss parallel with tiled loss": (4, ("strategy.name=pipeline", "strategy.tp_degree=2",
                                          "strategy.loss_parallel=true", "train.tiled_loss=true"),
                                      "train.tiled_loss is not available with strategy pipeline"),
    "sequence parallel under a model split": (4, ("strategy.name=hybrid", "strategy.data_parallel=ddp",
                                                  "strategy.sequence_parallel=true"),
                                              "strategy.sequence_parallel under hybrid applies to tensor-parallel "
                                              "pipeline stages"),
    "tp stages with one stage": (2, ("strategy.name=pipeline", "strategy.tp_degree=2"),
                                 "a pipeline needs at least 2 ranks, one per stage, but the world size is 2 with "
                                 "tp_degree 2"),
    # split_head: what it does not run with (yet), each named
    "split_head with a split by hand": (2, ("strategy.name=pipeline", "strategy.split_head=true", "strategy.split=[2]"),
                                        "strategy.split_head: strategy.split places the blocks by hand"),
    "split_head with tp stages": (4, ("strategy.name=pipeline", "strategy.split_head=true", "strategy.tp_degree=2"),
                                  "strategy.split_head: tensor-parallel stages split the head over the vocabulary "
                                  "themselves"),
    "split_head in fp16": (2, ("strategy.name=pipeline", "strategy.split_head=true", "precision=fp16"),
                           "strategy.split_head: precision fp16 is not tested with it yet"),
    "split_head with local SGD": (4, ("strategy.name=hybrid", "strategy.pipeline_degree=2", "strategy.split_head=true",
                                      "strategy.sync_every=2"), "strategy.split_head: local SGD"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_split_inputs_are_one_line_before_any_rank(llama4_runs, case):
    from toolkit.errors import RecipeError
    from toolkit.config.files import load_recipe
    from toolkit.strategies import validate_strategy

    ranks, overrides, words = BAD[case]
    recipe = load_recipe(llama4_runs.recipe, overrides)
    with pytest.raises(RecipeError, match=re.escape(words)):
        validate_strategy(recipe, world_size=ranks)


def test_the_layer_stacks_own_block_class_is_taken_as_pipeline_blocks(llama4_runs):
    from toolkit.config.files import load_recipe
    from toolkit.strategies import validate_strategy

    validate_strategy(load_recipe(llama4_runs.recipe, ("strategy.name=pipeline", "strategy.schedule=gpipe",
                                                       "strategy.blocks=[LlamaDecoderLayer]")), world_size=2)


def test_bad_split_through_the_launcher_exits_2_with_nothing_written(llama4_runs, tmp_path):
    from conftest import run_cli

    out = tmp_path / "never"
    result = run_cli("launch", "--nproc", "2", str(llama4_runs.recipe), "--set", "strategy.name=pipeline",
                     "--set", "strategy.split=[9]", "--set", f"output_dir={out}")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "toolkit: error: strategy.split [9] is out of range: the model has 4 blocks, so each index must be "
        "between 1 and 3"]
    assert not out.exists()


def test_a_hybrid_with_one_replica_per_stage_says_it_runs_as_a_pipeline(llama4_runs, monkeypatch):
    """pipeline_degree 2 on 2 ranks leaves no rank for data parallelism: what ran is strategy pipeline's, and
    run.json's `fallback` (a warning at start, a line in the compare report) says so; 2 × 2 has none."""
    import torch

    from toolkit.process.dist import DistEnv
    from toolkit.strategies.hybrid import pipeline_form
    from toolkit.strategies.pipeline.strategy import PipelineStrategy
    from toolkit.strategies.pipeline.layout import Grid

    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)  # the fix names toolkit launch's --nproc

    def fallback(strategy, pp, dp, tp=1):
        # what setup() sets, for the grid of a launch
        strategy.grid, strategy.env = Grid(pp=pp, dp=dp, tp=tp), DistEnv(0, 0, pp * dp * tp, torch.device("cpu"))
        return strategy._fallback()  # report()'s fallback, without the rest of a set-up pipeline

    assert fallback(pipeline_form(), 2, 1) == (
        "strategy hybrid with 2 stages on 2 ranks has one replica per stage, so it runs "
        "as strategy pipeline, without data parallelism; use --nproc 4 for 2 stages × 2 replicas")
    # tensor-parallel stages: twice the ranks, and the replicas fsdp's (ddp ones are refused with them)
    assert fallback(pipeline_form(), 2, 1, tp=2) == (
        "strategy hybrid with 2 stages on 4 ranks has one replica per stage, so it runs as strategy pipeline, "
        "without data parallelism; use --nproc 8 and strategy.data_parallel=fsdp for 2 stages × 2 replicas of 2 "
        "tensor-parallel ranks")
    assert fallback(pipeline_form(), 2, 2) is None
    assert fallback(PipelineStrategy(), 2, 1) is None  # strategy pipeline runs as itself
    ranks, overrides = ARMS["pp-ddp"]
    assert "fallback" not in json.loads((llama4_runs.get("pp-ddp", nproc=ranks, overrides=overrides) /
                                         "run.json").read_text())


def test_a_v_shaped_pipeline_evaluates_the_default_recipe_as_one_process(tmp_path):
    """The llama-tiny recipe under zbv, evaluated after its step: torch 2.13's eval of a V-shaped schedule ran its
    whole training order, backwards included, and the ranks failed at the first evaluation ("can't steal_bwd_input
    if this stage doesn't have backward"). Forwards only now (schedules.forward_only): the evaluation loss is a
    single process's, as the training loss is."""
    import subprocess
    import sys

    from conftest import REPO, forked_env

    def run(name: str, *command: str, sets: tuple[str, ...] = ()) -> dict:
        out = tmp_path / name
        done = subprocess.run([sys.executable, "-m", "toolkit", *command, "recipes/llama-tiny.yaml",
                               "--set", "train.max_steps=1", "--set", f"output_dir={out}",
                               "--set", "data.eval=tests/data/reviews-eval-64.jsonl",
                               *[a for s in sets for a in ("--set", s)]],
                              cwd=REPO, env=forked_env(), capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return metrics(out)[-1]

    single = run("single", "train")
    zbv = run("zbv", "launch", "--nproc", "2", sets=("strategy.name=pipeline", "strategy.schedule=zbv",
                                                     "strategy.stages_per_rank=2"))
    assert zbv["loss"] == pytest.approx(single["loss"], rel=1e-5)
    assert zbv["eval_loss"] == pytest.approx(single["eval_loss"], rel=1e-5)
