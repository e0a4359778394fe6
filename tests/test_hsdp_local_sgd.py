"""Local SGD over HSDP's replica groups (strategy.sync_every with strategy.replicate_degree, fsdp): the gradients are
reduce-scattered within a replica group and never all-reduced across groups; every sync_every steps each rank's
shards are averaged with the same shards of the other groups. Real 4-rank runs (2 replica groups × 2 shards), held
against local SGD over DDP replicas that read the same samples (2 ranks): another code path (DDP's no_sync and a
whole replica per rank, not FSDP2's set_requires_all_reduce and shards)."""

import json

import pytest

from conftest import assert_local_sgd_every_2_as_ddp, metrics
from test_comm_prediction import assert_predicted
from test_communication_levers import _resumed_equals_whole, assert_checkpoint_holds_the_first_replica

# global batch 8 both: the HSDP ranks 0, 1 (replica group 0) read samples 0-3 of each step as DDP's rank 0 does in
# its two micro-batches; the loss of a replica's samples is what each replica steps on
LOCAL = ("batch.micro_batch_size=2", "strategy.sync_every=2")
HSDP = ("strategy.name=fsdp", "strategy.replicate_degree=2", *LOCAL)
DDP = ("strategy.name=ddp", "batch.micro_batch_size=2", "batch.grad_accum_steps=2", "strategy.sync_every=2")


def test_local_sgd_over_hsdp_replica_groups_equals_local_sgd_over_ddp_replicas(llama_runs):
    run = llama_runs.get("hsdp-localsgd2", nproc=4, overrides=HSDP)
    ddp = llama_runs.get("ddp-localsgd2-m2", nproc=2, overrides=DDP)  # test_model_parallel's run of the same name
    # the drift is the whole replica's, its shards' sums added up: what DDP's whole replicas measure
    assert_local_sgd_every_2_as_ddp(run, ddp)
    info = json.loads((run / "run.json").read_text())
    assert info["replica_check"] == ("every 1 step(s): 2 replica groups hold identical shards after each sync "
                                     "(local SGD every 2 steps), 21 tensors")
    assert info["precision_audit"]["grad_reduction"] == ("reduce-scatter mean (fp32) within each replica group, none "
                                                         "across them: local SGD, parameters averaged every 2 steps")
    # counted at the first sync from step 3 (step 4): the reduce-scatters within a group, no all-reduce of
    # gradients across groups, the shards' average and the drift's sums, byte for byte as toolkit plan predicts
    assert info["comm_per_step"]["step"] == 4
    assert_predicted(run)


def test_an_hsdp_local_sgd_run_resumed_mid_window_equals_the_uninterrupted_one(tmp_path, tiny_llama_dir):
    """DiLoCo every 4 steps over 2 replica groups of 2 shards, resumed from step 3 (three steps into a window, the
    groups apart): DCP keeps one copy of shards it sees replicated, so each rank's own shards, AdamW state and
    outer anchor and momentum go into the checkpoint per rank; steps 4 and 5 equal the run that went on."""
    whole, resumed = _resumed_equals_whole(
        tmp_path, tiny_llama_dir, steps=5, resume_from=3, check_every=1, nproc=4,
        sets=(*HSDP[:2], "batch.micro_batch_size=2", "strategy.sync_every=4", "strategy.outer_optimizer=nesterov",
              "checkpoint.every_steps=3"))
    tail = {m["step"]: m for m in metrics(whole)}
    assert tail[3]["replica_drift"]["max_abs"] > 0  # the checkpoint was written with the groups apart
    assert_checkpoint_holds_the_first_replica(whole / "checkpoints" / "step-00000003", tmp_path,
                                              groups=[[0, 1], [2, 3]])
    # each rank's shards of the anchor and the outer momentum, besides AdamW's: as toolkit plan predicts them
    info = json.loads((whole / "run.json").read_text())
    assert info["memory_prediction"]["model_state_bytes"] == info["model_state_bytes"]
    assert all(rank["optim_bytes"] == 4 * rank["grads_bytes"] for rank in info["model_state_bytes"])
    for m in metrics(resumed):
        assert m["replica_drift"]["max_abs"] == pytest.approx(tail[m["step"]]["replica_drift"]["max_abs"], rel=1e-6)
