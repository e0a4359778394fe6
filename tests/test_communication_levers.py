"""The communication levers (strategy.gradient_compression, strategy.reduce_dtype) in real 2-rank runs: the bytes
the collective counter measures follow each lever's arithmetic, worked out here from the model's shapes; a lever at
its no-op setting equals the exact run; a PowerSGD run resumed mid-run equals the uninterrupted one; bad settings
are one line, exit 2."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file

import test_sharded
from conftest import REPO, assert_same_run, launch, losses, metrics, run_cli, write_recipe
from test_cli_errors import _assert_one_line_exit_2, _bad_recipe
from test_comm_prediction import assert_predicted
from toolkit.cli import main
from toolkit.process import faults

M4 = ("batch.micro_batch_size=4",)
DDP = ("strategy.name=ddp", *M4)  # the run test_comm_prediction shares as "ddp-m4"
FSDP = ("strategy.name=fsdp", *M4)  # test_sharded's "fsdp"
LOOP_BYTES = 32  # the loop's own all-reduces each step: 3 float64 counts and the float64 loss
POWERSGD = ("strategy.gradient_compression=powersgd", "strategy.powersgd_rank=2",
            "strategy.powersgd_start_step=2")  # compressed from step 3, the step the counter counts
ARMS = {"ddp-fp16c": (*DDP, "strategy.gradient_compression=fp16"),
        "ddp-bf16c": (*DDP, "strategy.gradient_compression=bf16"),
        "ddp-powersgd": (*DDP, *POWERSGD),
        "fsdp-bf16reduce": (*FSDP, "strategy.reduce_dtype=bf16"),
        "zero2-bf16reduce": ("strategy.name=zero", "strategy.stage=2", "strategy.reduce_dtype=bf16", *M4),
        "ddp-localsgd4": (*DDP, "strategy.sync_every=4"),  # syncs after steps 4 and 5 (the last)
        "ddp-diloco2": (*DDP, "strategy.sync_every=2", "strategy.outer_optimizer=nesterov")}


def _counted(run) -> dict:
    return json.loads((run / "run.json").read_text())["comm_per_step"]


def _shapes(run) -> list[tuple[int, ...]]:
    return [tuple(t.shape) for t in load_file(str(run / "model" / "model.safetensors")).values()]


@pytest.mark.parametrize("arm", list(ARMS))
def test_each_lever_runs_and_its_bytes_are_predicted(llama_runs, arm):
    run = llama_runs.get(arm, nproc=2, overrides=ARMS[arm])
    assert len(losses(run)) == 5 and all(math.isfinite(x) for x in losses(run))
    assert_predicted(run)  # toolkit plan's rules, byte for byte


@pytest.mark.parametrize("arm", ["ddp-fp16c", "ddp-bf16c"])
def test_16_bit_compression_sends_half_the_gradient_bytes(llama_runs, arm):
    exact = _counted(llama_runs.get("ddp-m4", nproc=2, overrides=DDP))["bytes_by_op"]["allreduce_"]
    halved = _counted(llama_runs.get(arm, nproc=2, overrides=ARMS[arm]))["bytes_by_op"]["allreduce_"]
    assert halved - LOOP_BYTES == (exact - LOOP_BYTES) // 2


def test_bf16_reduce_scatter_sends_half_the_gradient_bytes(llama_runs):
    exact = _counted(llama_runs.get("fsdp", nproc=2, overrides=FSDP))["bytes_by_op"]
    halved = _counted(llama_runs.get("fsdp-bf16reduce", nproc=2, overrides=ARMS["fsdp-bf16reduce"]))["bytes_by_op"]
    assert halved["_reduce_scatter_base_"] * 2 == exact["_reduce_scatter_base_"]
    assert halved["_allgather_base_"] == exact["_allgather_base_"]  # parameters are gathered as before


def test_zero_bf16_communication_sends_half_the_gradient_bytes(llama_runs):
    """DeepSpeed's communication_data_type: ZeRO-2's gradient all-reduce (one micro-batch a step here) in 2 bytes a
    number instead of 4; the updated partitions are gathered in the parameters' fp32 as before."""
    exact = _counted(llama_runs.get("zero2-json", nproc=2, overrides=test_sharded.ARMS["zero2-json"]))
    run = llama_runs.get("zero2-bf16reduce", nproc=2, overrides=ARMS["zero2-bf16reduce"])
    numel = sum(math.prod(s) for s in _shapes(run))
    assert exact["bytes_by_op"]["allreduce_"] - _counted(run)["bytes_by_op"]["allreduce_"] == numel * 2
    assert exact["bytes_by_op"]["_allgather_base_"] == _counted(run)["bytes_by_op"]["_allgather_base_"]


def test_powersgd_sends_n_plus_m_times_r_per_matrix(llama_runs):
    """Per n×m gradient matrix (a tensor as its first dimension's rows) the factors P (n×r) and Q (m×r); a tensor
    whose factors would not save half its numbers (a norm's vector) goes whole."""
    run = llama_runs.get("ddp-powersgd", nproc=2, overrides=ARMS["ddp-powersgd"])
    rank = 2
    numbers = 0
    for shape in _shapes(run):
        n, m = shape[0], math.prod(shape[1:])
        numbers += (n + m) * rank if 2 * (n + m) * min(n, m, rank) < n * m else n * m
    assert _counted(run)["bytes_by_op"]["allreduce_"] == numbers * 4 + LOOP_BYTES
    # and the steps before it were reduced whole: the same first two steps as the exact run
    exact = losses(llama_runs.get("ddp-m4", nproc=2, overrides=DDP))
    got = losses(run)
    assert got[:3] == pytest.approx(exact[:3], rel=1e-6) and got[3:] != pytest.approx(exact[3:], rel=1e-6)


def test_powersgd_at_full_rank_equals_the_exact_run(llama_runs):
    """At a rank no smaller than any matrix's side the hook compresses nothing: every gradient is all-reduced whole,
    and the error it keeps (each rank's gradient minus the mean) sums to zero over the ranks. fp32: to 1e-5."""
    full = (*DDP, "strategy.gradient_compression=powersgd", "strategy.powersgd_rank=100000",
            "strategy.powersgd_start_step=2")
    run = llama_runs.get("ddp-powersgd-full", nproc=2, overrides=full)
    exact = llama_runs.get("ddp-m4", nproc=2, overrides=DDP)
    assert_same_run(run, exact, rtol=1e-5)
    assert _counted(run)["bytes_by_op"] == _counted(exact)["bytes_by_op"]


def test_local_sgd_drift_rises_between_syncs_and_is_zero_at_each(llama_runs):
    """The replica check (every step) measures the drift between syncs and, at a sync, demands identical parameters
    by checksum (a drift there stops the run)."""
    for arm, syncs in (("ddp-localsgd4", {4, 5}), ("ddp-diloco2", {2, 4, 5})):
        drift = {m["step"]: m["replica_drift"] for m in metrics(llama_runs.get(arm, nproc=2, overrides=ARMS[arm]))}
        assert set(drift) == {1, 2, 3, 4, 5}
        for step, measured in drift.items():
            if step in syncs:
                assert measured == {"max_abs": 0.0, "relative_norm": 0.0}, (arm, step)
            else:
                assert measured["max_abs"] > 0 and measured["relative_norm"] > 0, (arm, step)
        run = llama_runs.get(arm, nproc=2, overrides=ARMS[arm])
        before = {m["step"]: m["replica_drift_before_sync"] for m in metrics(run) if "replica_drift_before_sync" in m}
        assert set(before) == syncs  # measured at each sync, from the norms, whatever the check's cadence
        summary = json.loads((run / "run.json").read_text())["replica_drift"]  # run.json's summary of the same
        assert summary == {"largest_max_abs": max(d["max_abs"] for d in drift.values()),
                           "largest_relative_norm": max(d["relative_norm"] for d in drift.values()),
                           "largest_before_sync": max(before.values()), "syncs": len(syncs),
                           "checked_equal": len(syncs)}
        if arm == "ddp-localsgd4":
            assert drift[1]["max_abs"] < drift[2]["max_abs"] < drift[3]["max_abs"]  # apart further each step
            # the rms distance the check measured after step 3, one step further just before the sync at step 4
            assert drift[3]["relative_norm"] < before[4] < 2 * drift[3]["relative_norm"]


def test_a_dropped_step_still_counts_toward_local_sgds_syncs(tmp_path, tiny_llama_dir):
    """train.on_nonfinite skip drops a step whose loss is not finite (here step 3's); it counts toward local SGD's
    syncs as it counts toward the schedule, so the syncs come after steps 3 and 5, the last (before: the dropped
    step was not counted, the syncs came after steps 4 and none at the end, and the export was rank 0's replica).
    The sync on the dropped step measures the drift it ends, as every sync does (before: its record had none)."""
    out = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=out, data={"eval": None},
                          train={"max_steps": 5, "on_nonfinite": "skip", "consistency_check_every": 1})
    sets = [a for s in (*DDP, "strategy.sync_every=3") for a in ("--set", s)]
    result = run_cli("launch", "--nproc", "2", str(recipe), *sets, env={faults.NAN_LOSS_AT_STEP: "3"})
    assert result.returncode == 0, result.stderr[-3000:]
    steps = metrics(out)
    assert [m["skipped"] for m in steps] == [False, False, True, False, False]
    assert [m["step"] for m in steps if "replica_drift_before_sync" in m] == [3, 5]
    assert all(m["replica_drift_before_sync"] > 0 for m in steps if m["step"] in (3, 5))
    # the replica check after each sync demanded identical replicas by checksum, and measured no drift there
    assert [m["replica_drift"]["max_abs"] == 0.0 for m in steps] == [False, False, True, False, True]


def test_local_sgd_sends_at_its_syncs_what_ddp_sends_every_step(llama_runs):
    """Counted at the first sync (step 4): one all-reduce of the parameters, as many bytes as DDP's gradients each
    step; the steps between reduce nothing (the replicas drift apart: above), so over a window of 4 steps 1/4."""
    exact = _counted(llama_runs.get("ddp-m4", nproc=2, overrides=DDP))
    local = _counted(llama_runs.get("ddp-localsgd4", nproc=2, overrides=ARMS["ddp-localsgd4"]))
    # + 8: the float64 sum of the replicas' squared norms, their drift before the sync
    assert local["step"] == 4 and local["bytes_by_op"]["allreduce_"] == exact["bytes_by_op"]["allreduce_"] + 8


def test_sync_every_1_is_plain_ddp(llama_runs):
    run = llama_runs.get("ddp-sync1", nproc=2, overrides=(*DDP, "strategy.sync_every=1"))
    exact = llama_runs.get("ddp-m4", nproc=2, overrides=DDP)
    assert_same_run(run, exact, rtol=1e-5)
    assert _counted(run)["bytes_by_op"] == _counted(exact)["bytes_by_op"]


def test_a_local_sgd_run_resumed_mid_window_equals_the_uninterrupted_one(tmp_path, tiny_llama_dir):
    """DiLoCo every 4 steps, resumed from step 6 (two steps into a window, the replicas apart): each rank's own
    parameters, AdamW state and the outer step's anchor and momentum are in the checkpoint, so steps 7-10 equal the
    run that went on, to 1e-6 (measured: exactly)."""
    whole, resumed = _resumed_equals_whole(
        tmp_path, tiny_llama_dir, steps=10, resume_from=6, check_every=1,
        sets=(*DDP, "strategy.sync_every=4", "strategy.outer_optimizer=nesterov", "checkpoint.every_steps=3"))
    tail = {m["step"]: m for m in metrics(whole)}
    assert tail[6]["replica_drift"]["max_abs"] > 0  # the checkpoint was written with the replicas apart
    assert_checkpoint_holds_the_first_replica(whole / "checkpoints" / "step-00000006", tmp_path, groups=[[0], [1]])
    for m in metrics(resumed):
        assert m["replica_drift"]["max_abs"] == pytest.approx(tail[m["step"]]["replica_drift"]["max_abs"], rel=1e-6)


def assert_checkpoint_holds_the_first_replica(checkpoint, tmp_path, *, groups: list[list[int]]) -> None:
    """A checkpoint written with local SGD's replicas apart holds one replica whole in its model state (what `toolkit
    convert` and a resume on another number of ranks read): the first's, `groups[0]`'s ranks, each rank's own
    parameters (its "comm" entry) in rank order along dim 0 (HSDP's shards; a DDP rank's whole tensors) — not a
    tensor from one replica and the next from another, as DCP's write balancing would pick them."""
    import io

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(checkpoint), str(tmp_path / "checkpoint.pt"))
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    own = {int(rank): torch.load(io.BytesIO(blob.numpy().tobytes()), weights_only=False)["params"]
           for rank, blob in state["comm"].items()}

    def replica(ranks: list[int]) -> dict[str, torch.Tensor]:
        return {name: torch.cat([own[rank][name] for rank in ranks]) for name in own[ranks[0]]}

    first, other = replica(groups[0]), replica(groups[1])
    assert all(torch.equal(state["model"][name], value) for name, value in first.items())
    assert not all(torch.equal(first[name], other[name]) for name in first)  # the replicas were apart


def _resumed_equals_whole(tmp_path, model_dir, *, steps: int, resume_from: int, sets: tuple[str, ...],
                          check_every: int | None = None, nproc: int = 2):
    """A `nproc`-rank run of `steps` steps, and the same resumed from its checkpoint after `resume_from`: the resumed
    steps' losses, grad norms and the final weights equal the uninterrupted run's to 1e-6. (whole, resumed)"""
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=model_dir, output_dir=tmp_path / "unused",
                          train={"max_steps": steps, "consistency_check_every": check_every})
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    launch(recipe, nproc=nproc, overrides=(*sets, "checkpoint.keep_last=5", f"output_dir={whole}"))
    launch(recipe, nproc=nproc, overrides=(*sets, "checkpoint.keep_last=5", f"output_dir={resumed}"),
           extra=("--resume", str(whole / "checkpoints" / f"step-{resume_from:08d}")))
    tail = {m["step"]: m for m in metrics(whole)}
    assert [m["step"] for m in metrics(resumed)] == list(range(resume_from + 1, steps + 1))
    for m in metrics(resumed):
        assert m["loss"] == pytest.approx(tail[m["step"]]["loss"], rel=1e-6)
        assert m["grad_norm"] == pytest.approx(tail[m["step"]]["grad_norm"], rel=1e-6)
    a = load_file(str(whole / "model" / "model.safetensors"))
    b = load_file(str(resumed / "model" / "model.safetensors"))
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-6, atol=1e-7)
    return whole, resumed


def test_levers_keep_the_replicas_identical(llama_runs):
    """Every rank applies the same decompressed mean: the replica check ran after every step (a drift stops the run
    with ReplicaDriftError) and the runs completed."""
    for arm in ("ddp-bf16c", "ddp-powersgd"):
        info = json.loads((llama_runs.get(arm, nproc=2, overrides=ARMS[arm]) / "run.json").read_text())
        assert info["status"] == "completed" and info["replica_check"].startswith("every 1 step(s): 2 ranks hold")


def test_diloco_keeps_two_more_copies_of_the_parameters_and_the_plan_counts_them(llama_runs):
    """DiLoCo's outer step keeps the parameters at the last sync (its anchor) and a momentum buffer beside the inner
    AdamW's two moments: measured, twice the optimizer state plain DDP holds on the same model; toolkit plan's
    prediction is the measured bytes exactly (before, it left both out: 2 × the model's parameters per rank)."""
    diloco = json.loads((llama_runs.get("ddp-diloco2", nproc=2, overrides=ARMS["ddp-diloco2"]) / "run.json"
                         ).read_text())
    plain = json.loads((llama_runs.get("ddp-m4", nproc=2, overrides=DDP) / "run.json").read_text())
    for ours, theirs in zip(diloco["model_state_bytes"], plain["model_state_bytes"], strict=True):
        assert ours["optim_bytes"] == 2 * theirs["optim_bytes"] == 4 * theirs["params_bytes"]
    assert diloco["memory_prediction"]["model_state_bytes"] == diloco["model_state_bytes"]


def test_powersgd_keeps_its_error_and_factors_and_the_plan_counts_them(llama_runs):
    """From its first compressed step on, PowerSGD keeps on each rank the error feedback (one number per gradient
    number) and each compressed matrix's factors P (n×r) and Q (m×r): measured at that step, plain DDP's optimizer
    state plus those numbers in fp32; toolkit plan's prediction is the measured bytes exactly (before, it left them
    out: on a 7B model about a whole fp32 gradient per rank)."""
    run = llama_runs.get("ddp-powersgd", nproc=2, overrides=ARMS["ddp-powersgd"])
    rank = 2
    numbers = 0
    for shape in _shapes(run):
        n, m = shape[0], math.prod(shape[1:])
        r = min(n, m, rank)
        numbers += n * m + ((n + m) * r if 2 * (n + m) * r < n * m else 0)
    info = json.loads((run / "run.json").read_text())
    plain = json.loads((llama_runs.get("ddp-m4", nproc=2, overrides=DDP) / "run.json").read_text())
    for ours, theirs in zip(info["model_state_bytes"], plain["model_state_bytes"], strict=True):
        assert ours["optim_bytes"] == theirs["optim_bytes"] + numbers * 4
    assert info["memory_prediction"]["model_state_bytes"] == info["model_state_bytes"]


def test_a_run_that_ends_before_powersgd_starts_plans_no_powersgd_state():
    """PowerSGD makes its error and factors at its first compressed step (powersgd_start_step + 1): a run with no
    such step holds none, and toolkit plan counts none; one step more, and it counts them."""
    from toolkit.config.files import load_recipe
    from toolkit.plan.predict import predict

    def optim(steps: int) -> int:
        recipe = load_recipe(REPO / "recipes" / "llama-tiny.yaml", [*DDP, "strategy.gradient_compression=powersgd",
                                                                     "strategy.powersgd_start_step=4",
                                                                     f"train.max_steps={steps}"])
        return predict(recipe, world_size=2, runtime_bytes=0, both=False).per_rank[0].optim_bytes

    plain = predict(load_recipe(REPO / "recipes" / "llama-tiny.yaml", list(DDP)), world_size=2, runtime_bytes=0,
                    both=False).per_rank[0].optim_bytes
    assert optim(4) == plain < optim(5)


def test_a_resumed_powersgd_run_equals_the_uninterrupted_one(tmp_path, tiny_llama_dir):
    """The checkpoint after step 4 (compressed from step 4) holds each rank's error and the Q factors: the run
    resumed from it (whose DDP buckets are numbered as a new process numbers them) equals the run that went on, to
    1e-6 relative. Without that state its step 5 gradient norm differs at the 4th digit (measured: 1.2502 vs 1.2964
    on this model when the state was left out)."""
    # small buckets: the resumed process's first step has DDP's initial buckets, other than the rebuilt ones the
    # state was saved from, so the state is put together anew for them (PowerSgd._pack)
    whole, _ = _resumed_equals_whole(
        tmp_path, tiny_llama_dir, steps=6, resume_from=4,
        sets=(*DDP, "strategy.gradient_compression=powersgd", "strategy.powersgd_rank=2",
              "strategy.powersgd_start_step=3", "strategy.bucket_cap_mb=0.5", "checkpoint.every_steps=2"))
    # the collectives were counted in the first compressed step, step 4 (not the usual step 3)
    counted = _counted(whole)
    assert counted["step"] == 4 and counted["bytes_by_op"]["allreduce_"] < sum(
        math.prod(s) for s in _shapes(whole)) * 4 // 10  # compressed: under a tenth of the fp32 gradients


def test_a_resumed_powersgd_pipeline_equals_the_uninterrupted_one(tmp_path, tiny_llama_dir):
    """2 stages × 2 ddp replicas, each stage's DDP module with its own PowerSGD state: the checkpoint after step 4
    holds every stage's error and Q factors on every rank, and the resumed run equals the one that went on."""
    whole, resumed = _resumed_equals_whole(
        tmp_path, tiny_llama_dir, steps=6, resume_from=4, nproc=4,
        sets=("strategy.name=hybrid", "strategy.pipeline_degree=2", "batch.micro_batch_size=2",
              "batch.grad_accum_steps=2", "strategy.gradient_compression=powersgd", "strategy.powersgd_rank=2",
              "strategy.powersgd_start_step=3", "checkpoint.every_steps=2"))
    assert _counted(whole)["step"] == 4  # the first compressed step
    # each rank's stage with its PowerSGD error and factors, measured at step 4 (made then) and after a resume at
    # step 5 (the state loaded for the buckets), as toolkit plan predicts them
    for run in (whole, resumed):
        info = json.loads((run / "run.json").read_text())
        assert info["memory_prediction"]["model_state_bytes"] == info["model_state_bytes"]


PIPELINE = ("strategy.name=hybrid", "strategy.pipeline_degree=2", "batch.micro_batch_size=2",
            "batch.grad_accum_steps=2")


def test_a_local_sgd_pipeline_resumed_mid_window_equals_the_uninterrupted_one(tmp_path, tiny_llama_dir):
    """DiLoCo every 3 steps over 2 replicas of a 2-stage pipeline, resumed from step 4 (one step into a window: the
    replicas apart): each rank's stage parameters, AdamW state and the outer step's anchor and momentum are in its
    checkpoint, so steps 5-6 equal the run that went on."""
    whole, resumed = _resumed_equals_whole(
        tmp_path, tiny_llama_dir, steps=6, resume_from=4, nproc=4, check_every=1,
        sets=(*PIPELINE, "strategy.sync_every=3", "strategy.outer_optimizer=nesterov", "checkpoint.every_steps=2"))
    assert metrics(whole)[3]["replica_drift"]["max_abs"] > 0  # step 4: apart, as the resumed run started
    assert [m["step"] for m in metrics(resumed) if "replica_drift_before_sync" in m] == [6]
BAD = {
    "compression under fsdp": (("strategy.name=fsdp", "strategy.gradient_compression=bf16"),
                               "gradient_compression"),
    "powersgd rank 0": (("strategy.name=ddp", "strategy.gradient_compression=powersgd", "strategy.powersgd_rank=0"),
                        "strategy.powersgd_rank must be >= 1"),
    "powersgd from the first step": (("strategy.name=ddp", "strategy.gradient_compression=powersgd",
                                      "strategy.powersgd_start_step=1"), "strategy.powersgd_start_step must be >= 2"),
    "powersgd under fp16": (("strategy.name=ddp", "strategy.gradient_compression=powersgd", "precision=fp16"),
                            "not available with precision fp16"),
    "unknown compression": (("strategy.name=ddp", "strategy.gradient_compression=int8"),
                            "strategy.gradient_compression must be one of none, fp16, bf16, powersgd"),
    "sync_every under fsdp without replicas": (("strategy.name=fsdp", "strategy.sync_every=4"),
                                               "set strategy.replicate_degree to 2 or more"),
    "sync_every under zero": (("strategy.name=zero", "strategy.sync_every=4"), "sync_every"),
    "sync_every 0": (("strategy.name=ddp", "strategy.sync_every=0"), "strategy.sync_every must be >= 1"),
    "outer_lr without nesterov": (("strategy.name=ddp", "strategy.sync_every=4", "strategy.outer_lr=0.5"),
                                  "set strategy.outer_optimizer=nesterov"),
    "unknown outer optimizer": (("strategy.name=ddp", "strategy.sync_every=4", "strategy.outer_optimizer=adam"),
                                "strategy.outer_optimizer must be one of average, nesterov"),
    "local sgd with compression": (("strategy.name=ddp", "strategy.sync_every=4",
                                    "strategy.gradient_compression=bf16"), "nothing to compress"),
    "local sgd under fp16": (("strategy.name=ddp", "strategy.sync_every=4", "precision=fp16"),
                             "not available with precision fp16"),
    "reduce dtype under ddp": (("strategy.name=ddp", "strategy.reduce_dtype=bf16"), "reduce_dtype"),
    "unknown reduce dtype": (("strategy.name=fsdp", "strategy.reduce_dtype=fp8"),
                             "strategy.reduce_dtype must be one of fp32, bf16"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_lever_setting_is_one_line_exit_2(case, tmp_path, tiny_llama_dir, capsys):
    overrides, words = BAD[case]
    recipe, out = _bad_recipe(tmp_path, tiny_llama_dir)
    _assert_one_line_exit_2(main(["validate", str(recipe), *[a for o in overrides for a in ("--set", o)]]), capsys,
                            words, out)


HSDP_BAD = {  # validated for 2 ranks
    "sync_every over parallel.dp_shard alone": (("parallel.dp_shard=2", "strategy.sync_every=4"),
                                                "set parallel.dp_replicate to 2 or more (HSDP"),
    "sync_every over hsdp with cpu offload": (("strategy.name=fsdp", "strategy.replicate_degree=2",
                                              "strategy.sync_every=4", "strategy.cpu_offload=true"),
                                             "not checked with strategy.cpu_offload"),
    "diloco over hsdp without a window": (("strategy.name=fsdp", "strategy.replicate_degree=2",
                                          "strategy.outer_optimizer=nesterov"), "needs strategy.sync_every > 1"),
}


@pytest.mark.parametrize("case", list(HSDP_BAD))
def test_a_bad_local_sgd_setting_over_hsdp_is_one_line_exit_2(case, tmp_path, tiny_llama_dir, capsys):
    overrides, words = HSDP_BAD[case]
    recipe, out = _bad_recipe(tmp_path, tiny_llama_dir)
    code = main(["validate", str(recipe), "--nproc", "2", *[a for o in overrides for a in ("--set", o)]])
    _assert_one_line_exit_2(code, capsys, words, out)


def test_compare_judges_a_lever_by_design_and_a_fault_beside_it_diverged(tmp_path, tiny_llama_dir):
    """A real 2-rank compare (lr 1e-2, 10 steps: the loss falls from 10.3 to 7.7): PowerSGD from step 6 moves the
    loss curve (outside the exact bounds) by far less than its budget, "differs by design"; the same arm with a
    planted weight decay "diverged", naming the setting; the recommendation states the lever's bytes and loss."""
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=tmp_path / "unused",
                          optim={"lr": 1e-2}, data={"eval": None},
                          train={"max_steps": 10, "consistency_check_every": None})
    lever = "ddp-powersgd@strategy.powersgd_start_step=5"
    fault = f"{lever}@optim.weight_decay=0.5"
    out = tmp_path / "exp"
    done = run_cli("compare", str(recipe), "--strategies", f"ddp,{lever},{fault}", "--steps", "10",
                   "--output", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {r["arm"]: r for r in json.loads((out / "results.json").read_text())["arms"]}
    by_design = rows[lever]
    assert by_design["verdict"] == "differs by design (gradient_compression=powersgd (r=4, from step 6))"
    assert by_design["step"] is None and 0 < abs(by_design["distance"]["final_difference"]) < \
        by_design["distance"]["budget"]
    assert by_design["max_weight_diff"] > 1e-4  # it did move the weights: not an exact arm
    planted = rows[fault]
    assert planted["verdict"].startswith("diverged"), planted["verdict"]
    assert "optim.weight_decay: 0.5 vs 0.01" in planted["differences"]
    report = (out / "report.md").read_text()
    assert f"- {lever}: gradient_compression=powersgd (r=4, from step 6): -" in report  # fewer bytes per step
    # the console: the lever's settings below the table, so that its lines stay within 120 characters
    lines = done.stdout.splitlines()
    printed = [line for line in lines[lines.index(next(x for x in lines if x.startswith("arm "))):]
               if not line.startswith("[compare]")]  # the closing table and its texts (the paths' lines aside)
    assert max(len(line) for line in printed) <= 120, printed
    assert f"{lever} differs by design (gradient_compression=powersgd (r=4, from step 6))" in \
        " ".join(line.strip() for line in printed), done.stdout


PIPELINE_BAD = {  # validated for 4 ranks: 2 stages × 2 replicas
    "compression over fsdp stage replicas": ((*PIPELINE, "strategy.data_parallel=fsdp",
                                              "strategy.gradient_compression=fp16"),
                                             "strategy.data_parallel fsdp shards them instead"),
    "powersgd under a split backward": ((*PIPELINE, "strategy.schedule=zbv", "strategy.stages_per_rank=2",
                                         "strategy.gradient_compression=powersgd"), "bypasses"),
    "compression of a model split × ddp": (("strategy.name=hybrid", "strategy.gradient_compression=fp16"),
                                           "strategy.gradient_compression under hybrid applies to a pipeline's ddp "
                                           "replicas"),
    "compression under pipeline": (("strategy.name=pipeline", "strategy.gradient_compression=fp16", *PIPELINE[2:]),
                                   "gradient_compression"),
    "local sgd over fsdp stage replicas": ((*PIPELINE, "strategy.data_parallel=fsdp", "strategy.sync_every=2"),
                                           "strategy.sync_every=2 averages the parameters of a stage's ddp replicas; "
                                           "strategy.data_parallel fsdp shards them instead"),
    "local sgd of a model split × ddp": (("strategy.name=hybrid", "strategy.sync_every=2"),
                                         "strategy.sync_every under hybrid applies to a pipeline's ddp replicas"),
    "local sgd with compression on stage replicas": ((*PIPELINE, "strategy.sync_every=2",
                                                      "strategy.gradient_compression=fp16"), "nothing to compress"),
}


@pytest.mark.parametrize("case", list(PIPELINE_BAD))
def test_a_bad_lever_setting_on_a_pipeline_is_one_line_exit_2(case, tmp_path, tiny_llama_dir, capsys):
    overrides, words = PIPELINE_BAD[case]
    recipe, out = _bad_recipe(tmp_path, tiny_llama_dir)
    _assert_one_line_exit_2(main(["validate", str(recipe), "--nproc", "4",
                                  *[a for o in overrides for a in ("--set", o)]]), capsys, words, out)


def test_a_resumed_local_sgd_optimizer_keeps_this_recipes_settings():
    """Local SGD keeps each rank's AdamW state in its own blob, read back through torch's load_state_dict, which
    also takes the saved groups' lr, weight decay and betas: a resume with another optim.weight_decay ran the
    old one to the end. Now the state is the saved one and the settings this run's."""
    from toolkit.strategies.dims.local_sgd import load_keeping_settings

    before = torch.nn.Parameter(torch.ones(3))
    saved_run = torch.optim.AdamW([before], lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95))
    before.grad = torch.tensor([1.0, -2.0, 3.0])
    saved_run.step()
    saved = saved_run.state_dict()
    after = torch.nn.Parameter(torch.ones(3))
    resumed = torch.optim.AdamW([after], lr=5e-4, weight_decay=0.0, betas=(0.8, 0.99))
    load_keeping_settings(resumed, saved)
    group = resumed.param_groups[0]
    assert (group["lr"], group["weight_decay"], group["betas"]) == (5e-4, 0.0, (0.8, 0.99))
    assert group["params"] == [after]
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(resumed.state[after][key], saved_run.state[before][key])
    plain = torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))], lr=5e-4, weight_decay=0.0)
    plain.load_state_dict(saved)
    assert plain.param_groups[0]["weight_decay"] == 0.1  # torch's own: what the resume used to run
