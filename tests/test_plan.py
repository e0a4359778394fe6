"""toolkit plan: model-state bytes predicted from meta-device shapes equal what real runs measured, byte for
byte, for every strategy. The runs are the ones the equivalence tests share (same names, same overrides), so
this file launches nothing of its own beyond the CLI checks."""

import json
import re
import subprocess
import sys

import pytest

import test_model_parallel
import test_sharded
import test_tensor_parallel
from conftest import REPO, run_cli, toolkit_env, write_recipe
from toolkit.config.files import load_recipe
from toolkit.errors import RecipeError
from toolkit.plan import predict as plan
from toolkit.strategies.zero import memory as zero_state
LLAMA = {  # the 2-block untied Llama: name -> (ranks, overrides)
    "single-m8": (1, ()),
    "ddp-m4": (2, ("strategy.name=ddp", "batch.micro_batch_size=4")),
    "dp-m4a2": (1, ("strategy.name=dp", "batch.micro_batch_size=4", "batch.grad_accum_steps=2")),
    **{name: (2, overrides) for name, overrides in test_sharded.ARMS.items()},
    "zero3-offload": (2, ("strategy.name=zero", "strategy.stage=3", "strategy.offload_optimizer=true",
                          "strategy.offload_param=true", *test_sharded.M4)),
}
BF16 = ["zero2", "zero3", "fsdp"]  # 16-bit parameters and fp32 masters (ZeRO) against fp32 shards (FSDP)
LLAMA4 = {**test_model_parallel.ARMS, **test_tensor_parallel.ARMS}  # the tied 4-block Llama: split strategies


def _run(request, fixture: str, name: str) -> tuple[dict, object]:
    runs = request.getfixturevalue(fixture)
    if name.endswith("-bf16"):
        run_dir = test_sharded.bf16_run(runs, name.removesuffix("-bf16"))
    else:
        table = LLAMA if fixture == "llama_runs" else LLAMA4
        ranks, overrides = table[name]
        run_dir = runs.get(name, nproc=ranks, overrides=overrides)
    return json.loads((run_dir / "run.json").read_text()), load_recipe(run_dir / "recipe.yaml")


CASES = [("llama_runs", n) for n in LLAMA] + [("llama_runs", f"{a}-bf16") for a in BF16] + \
    [("llama4_runs", n) for n in LLAMA4]


@pytest.mark.parametrize("fixture,name", CASES)
def test_plan_predicts_the_measured_model_state_bytes_exactly(request, fixture, name):
    run, recipe = _run(request, fixture, name)
    predicted = plan.predict(recipe, world_size=run["world_size"], runtime_bytes=0)
    # measured: distinct storages behind the live parameters, gradients (after the first backward) and
    # optimizer state (after the first step) of every rank; predicted: shapes × each strategy's rules
    assert [r.as_dict() for r in predicted.per_rank] == run["model_state_bytes"]
    assert run["memory_prediction"]["model_state_bytes"] == run["model_state_bytes"]  # the run's own, in run.json


@pytest.mark.parametrize("name", ["fsdp", "zero1", "zero3-accum", "zero3-offload"])
def test_sharded_runs_hold_no_large_tensor_outside_the_counted_model_states(request, name):
    run, _ = _run(request, "llama_runs", name)
    # a census of every tensor Python can reach after the first backward: what the counters miss. It found
    # DeepSpeed's default 5e8-element ZeRO-3 reduce bucket (1 GB bf16 per rank) before buckets were sized
    states = [sum(r.values()) for r in run["model_state_bytes"]]
    for other, total in zip(run["other_live_tensor_bytes"], states):
        assert other["bytes"] < 0.02 * total, other


def test_zero1_and_zero2_keep_the_gradients_of_every_parameter_their_partition_touches(request):
    # DeepSpeed keeps whole the gradient of a parameter its partition cuts; the untied 30522-row embedding
    # and head hold most of this model, so each rank keeps more than half, in both stages
    run, recipe = _run(request, "llama_runs", "zero1")
    full = plan.predict(recipe, world_size=1, runtime_bytes=0).load_bytes  # every fp32 gradient
    grads = [r["grads_bytes"] for r in run["model_state_bytes"]]
    assert all(full / 2 < g < full for g in grads)
    assert _run(request, "llama_runs", "zero2-json")[0]["model_state_bytes"] == run["model_state_bytes"]


@pytest.mark.parametrize("name", ["zero1", "zero2-json", "zero2-bf16"])
def test_zero1_and_zero2_steps_are_planned_with_a_copy_of_the_measured_gradient_partition(request, name):
    # the step flattens a rank's gradients of one param group into one fp32 tensor of its partition (16-bit
    # gradients: cast from a flat 16-bit one): the largest group's fp32 master partition. Measured in every run:
    # the masters of all groups, a third of its optimizer state (master, exp_avg, exp_avg_sq); the other group
    # (norms, no weight decay) holds under 0.1 % of this model
    run, recipe = _run(request, "llama_runs", name)
    from toolkit.strategies import strategy_rules

    step = zero_state.flat_gradient_bytes(plan.planned_model(recipe), recipe, world_size=2)
    fp32_partition = step if recipe.precision == "fp32" else step * 4 // 6
    for rank in run["model_state_bytes"]:
        assert 0.999 * rank["optim_bytes"] // 3 < fp32_partition < rank["optim_bytes"] // 3


HELD_AFTER_STEP = r"""
import os, sys
from toolkit.strategies.zero import engine as zero
from toolkit.strategies.base import storage_bytes
def say(what, value):  # one write per line: two ranks share the pipe
    sys.stdout.write(f"{what} {os.environ.get('RANK', '0')}: {value}\n")
    sys.stdout.flush()
step = zero.ZeroStrategy.step
def counted(self, **kwargs):
    result = step(self, **kwargs)
    # the gradient holders the run's counters read (DeepSpeed's; printed now: a sharded run ends in os._exit)
    say("held after step", storage_bytes(self.state_tensors()["grads"]))
    return result
zero.ZeroStrategy.step = counted
from deepspeed.runtime.engine import DeepSpeedEngine
allreduce_bucket = DeepSpeedEngine.allreduce_bucket
def flattened(self, bucket, *args, **kwargs):  # stage 0's all-reduce: the flat copy of a bucket of gradients
    result = allreduce_bucket(self, bucket, *args, **kwargs)
    say("flattened", result.numel() * result.element_size())
    return result
DeepSpeedEngine.allreduce_bucket = flattened
allreduce_gradients = DeepSpeedEngine.allreduce_gradients
def unreduced(self, *args, **kwargs):  # the end of backward, before the engine reduces the gradients
    grads = [p.grad for p in self.module.parameters() if p.grad is not None]
    say("unreduced", sum(g.numel() * g.element_size() for g in grads))
    return allreduce_gradients(self, *args, **kwargs)
DeepSpeedEngine.allreduce_gradients = unreduced
import torch
from deepspeed.runtime.zero.utils import get_norm_dtype
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
def norm_copies(optimizer):  # the start of the step: each gradient piece is taken to the norm dtype in turn
    original = optimizer.get_grad_norm_direct
    def norm(self, gradients, params, *args, **kwargs):
        gradients = list(gradients)
        pieces = [g.numel() for g in gradients if not getattr(g, "_zero_padding", False)]
        say("norm copy", max(pieces, default=0) * torch.empty((), dtype=get_norm_dtype()).element_size())
        return original(self, gradients, params, *args, **kwargs)
    optimizer.get_grad_norm_direct = norm
norm_copies(DeepSpeedZeroOptimizer)
norm_copies(DeepSpeedZeroOptimizer_Stage3)
from deepspeed.runtime.zero import stage3
reduce_scatter_coalesced = stage3.reduce_scatter_coalesced
def reduced(tensors, *args, **kwargs):  # stage 3's gradients as its hook reduces them: the largest whole
    say("reduced whole", max(t.numel() * t.element_size() for t in tensors))
    return reduce_scatter_coalesced(tensors, *args, **kwargs)
stage3.reduce_scatter_coalesced = reduced
full_state_dict = zero.ZeroStrategy.full_state_dict
def exported(self):  # ZeRO-3: the parameters it keeps gathered from the last forward, before and after
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    def available():
        return sum(p.numel() for p in self.module.parameters()
                   if getattr(p, "ds_status", None) == ZeroParamStatus.AVAILABLE)
    before = available()
    state = full_state_dict(self)
    say("gathered before export", before)
    say("gathered after export", available())
    return state
zero.ZeroStrategy.full_state_dict = exported
from toolkit.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("stage,precision,nproc", [(0, "fp32", 1), (0, "bf16", 1), (1, "fp32", 2), (2, "fp32", 2),
                                                   (3, "fp32", 1), (3, "fp32", 2)])
def test_the_plan_knows_what_each_zero_stage_holds_around_its_step(tiny_llama_dir, tmp_path, stage, precision,
                                                                   nproc):
    # rank 0's export and a step's forward run without gradients where the strategy gives them back: measured
    # here after each optimizer step of a real run (stages 0-2: none left; stage 3: its flat gradient buffer).
    # Stage 0 in bf16 runs DeepSpeed's own mixed-precision wrapper around torch's optimizer, in fp32 torch's alone.
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=tmp_path / "out",
                          precision=precision, strategy={"name": "zero", "stage": stage}, data={"eval": None},
                          train={"max_steps": 2, "consistency_check_every": None})
    probe = tmp_path / "probe.py"
    probe.write_text(HELD_AFTER_STEP)
    ranks = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc > 1 else []
    result = subprocess.run([sys.executable, *ranks, str(probe), "train", str(recipe)], cwd=REPO,
                            env=toolkit_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]

    def printed(what: str, rank: int | None = None) -> list[int]:
        return [int(n) for r, n in re.findall(rf"^{what} (\d+): (\d+)$", result.stdout, re.M)
                if rank is None or int(r) == rank]

    held = printed("held after step")
    assert len(held) == 2 * nproc and len({h > 0 for h in held}) == 1, result.stdout[-3000:]
    from toolkit.strategies import make_strategy, strategy_rules

    strategy = make_strategy(load_recipe(recipe))
    assert strategy.info.holds_gradients == (held[0] > 0) == (stage == 3), held
    # ZeRO-1 reduces once backward is done: every rank holds every trainable parameter's gradient, whole, beyond
    # the partition its model states count; ZeRO-2 reduces them bucket by bucket as backward goes, and keeps
    # only those its partition touches
    model = plan.planned_model(load_recipe(recipe))
    whole = sum(p.numel() for p in model.parameters()) * 4
    if stage in (1, 2):
        counted = [r["grads_bytes"] for r in json.loads(next((tmp_path / "out").rglob("run.json")).read_text())
                   ["model_state_bytes"]]
        unreduced = [printed("unreduced", rank) for rank in range(nproc)]
        assert [len(u) for u in unreduced] == [2] * nproc, result.stdout[-3000:]
        if stage == 1:
            assert unreduced == [[whole, whole]] * nproc and all(c < whole for c in counted), (unreduced, counted)
        else:  # rank 0 holds no more than its partition's gradients; rank 1 also the bucket not yet reduced
            # when backward ends (here the embedding's, the first parameter: not in its partition)
            assert max(unreduced[0]) == counted[0] < whole and max(unreduced[1]) < whole, (unreduced, counted)
    assert strategy.info.whole_gradients_in_backward == (stage == 1)
    if stage == 0:  # the plan's end of backward: the all-reduce's flat copy of the gradients (fp32: the whole step)
        flat = max(printed("flattened"))
        assert flat == zero_state.largest_allreduce_bucket([p.numel() for p in model.parameters()]) * \
            (4 if precision == "fp32" else 2)
        [step] = strategy_rules(load_recipe(recipe)).predict_step_bytes(model, load_recipe(recipe), world_size=1,
                                                                        device_type="cpu")
        assert step == flat if precision == "fp32" else step == 2 * flat  # bf16: the step's fp32 copy is larger
    # stages 1-3 take each gradient piece of a rank's partition to float64 for the norm, one at a time: the plan
    # counts the largest per rank (stages 1, 2 at 2 ranks: each rank's piece lies inside the 30522-row embedding
    # or head, whichever its partition starts or ends in; stage 3: the largest parameter's share)
    norms = [printed("norm copy", rank) for rank in range(nproc)]
    planned = zero_state.norm_bytes(model, load_recipe(recipe), world_size=nproc)
    assert [max(n, default=0) for n in norms] == planned, (norms, planned)
    assert (stage == 0) == (planned == [0] * nproc)
    if stage == 3 and nproc > 1:  # one rank holds every parameter whole: it reduces and gathers nothing
        # the end of backward: the largest parameter's whole gradient, reduce-scattered alone (llama-tiny's
        # 30522-row embedding or head, divisible by 2: in place; gloo copies it once more on CPU)
        largest = max(p.numel() for p in model.parameters()) * 4
        assert max(printed("reduced whole")) == largest, result.stdout[-3000:]
        step = strategy_rules(load_recipe(recipe)).predict_step_bytes(model, load_recipe(recipe), world_size=nproc,
                                                                      device_type="cpu")
        assert step == [2 * largest] * nproc and zero_state.reduce_bytes(
            model, load_recipe(recipe), world_size=nproc, device_type="cuda") == largest, step
        # the parameters kept gathered from the last forward go before the export gathers the masters
        before, after = printed("gathered before export"), printed("gathered after export")
        assert len(before) == nproc and all(b > 0 for b in before) and after == [0] * nproc, (before, after)


def test_the_stage_0_all_reduce_is_planned_bucket_by_bucket():
    # DeepSpeed sends a bucket once it holds more than the limit: the largest flat copy is that bucket
    assert zero_state.largest_allreduce_bucket([3, 3, 3], limit=5) == 6
    assert zero_state.largest_allreduce_bucket([3, 1, 9, 2], limit=5) == 13
    assert zero_state.largest_allreduce_bucket([2, 2], limit=5) == 4
    assert zero_state.largest_allreduce_bucket([], limit=5) == 0


def test_plan_command_prints_every_arm_and_what_does_not_fit():
    done = run_cli("plan", "recipes/llama-tiny.yaml", "--nproc", "2", "--strategies", "ddp,zero3,tp,pp-1f1b",
                   "--memory-per-rank", "64MiB")
    assert done.returncode == 1, done.stderr  # nothing fits (each rank's runtime alone is above 64 MiB on CPU)
    lines = done.stdout.splitlines()
    ddp = next(line for line in lines if line.startswith("ddp "))
    # llama-tiny: 4,632,960 fp32 parameters; gradient the same; AdamW two moments: 70.7 MiB in all, > 64 MiB
    assert "17.7" in ddp and "70.7" in ddp and ddp.rstrip().endswith("NO")
    assert any(line.startswith("zero3 ") for line in lines) and any(line.startswith("tp ") for line in lines)
    # a 4-block model split in 2 stages over 2 ranks: one line per rank, they differ
    assert sum(line.startswith("pp-1f1b ") and "stages" not in line for line in lines) == 2
    # and the stages' FLOPs under it: the head (6 × 128 × 30522 a token) leaves the last stage one block
    stages = lines.index("pp-1f1b stages (split by FLOPs; forward + backward FLOPs per step):")
    assert lines[stages + 1].startswith("  stage 0: blocks 0-2, ") and \
        lines[stages + 2].startswith("  stage 1: blocks 3 + head, ")
    assert "model: 4.6M parameters" in lines and "fits as asked: none" in lines
    assert all(len(line) <= 120 for line in lines), max(lines, key=len)


def test_plan_takes_per_arm_overrides_as_compare_does():
    """`--strategies single,pp-1f1b@strategy.split=[1]` as `toolkit compare` takes it: the arm is planned with its
    own overrides (before: "unknown arm", so a compare's arm list could not be planned first)."""
    done = run_cli("plan", "recipes/llama-tiny.yaml", "--nproc", "2", "--strategies",
                   "pp-1f1b,pp-1f1b@strategy.split=[1]")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    given = lines.index("pp-1f1b@strategy.split=[1] stages (strategy.split; forward + backward FLOPs per step):")
    assert lines[given + 1].startswith("  stage 0: blocks 0, ") and \
        lines[given + 2].startswith("  stage 1: blocks 1-3 + head, ")
    assert "  stage 0: blocks 0-2, " in lines[lines.index("pp-1f1b stages (split by FLOPs; forward + backward FLOPs "
                                                          "per step):") + 1]
    # an arm that changes the model is planned on its own model: LoRA's adapters alone train (before: every arm was
    # planned on the recipe's model, its gradients and optimizer state those of every weight)
    done = run_cli("plan", "recipes/llama-tiny.yaml", "--nproc", "2", "--strategies", "ddp,ddp@model.lora={r: 8}")
    assert done.returncode == 0, done.stderr
    rows = {line.split()[0]: line.split() for line in done.stdout.splitlines() if line.startswith("ddp")}
    assert float(rows["ddp@model.lora={r:"][5]) < float(rows["ddp"][4]) / 10, rows  # grads MiB
    done = run_cli("plan", "recipes/llama-tiny.yaml", "--strategies", "ddp@strategy.sharding=full")
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "strategy.sharding" in done.stderr


def test_plan_takes_a_recipe_s_parallel_degrees_as_launch_does():
    """A recipe whose parallel degrees choose its layout, with the default strategy.name (single) beside them: the
    plan runs them at --nproc ranks as `toolkit launch` does (before: planned as single on one rank, "cp 2 does
    not divide the 1 ranks", exit 1)."""
    done = run_cli("plan", "recipes/llama-tiny.yaml", "--nproc", "2", "--set", "parallel.cp=2", "--set",
                   "parallel.cp_method=ring")
    assert done.returncode == 0, done.stdout + done.stderr
    row = next(line.split() for line in done.stdout.splitlines() if line.startswith("fsdp "))
    assert row[1:3] == ["all", "2"] and row[-1] == "yes", row


def test_plan_names_the_first_single_change_under_which_an_arm_fits():
    """What the plan's summary offers for an arm that does not fit: the first change (selective, then full
    activation checkpointing, a smaller micro-batch, then offload, then twice the ranks) whose own prediction is within
    the limit; a change the strategy refuses is passed over. The predictions are given here: plan.predict has its own
    tests."""
    from toolkit.plan.predict import Prediction
    from toolkit.plan.advice import Planned, one_change

    def prediction(peak: int, world: int = 2) -> Prediction:
        return Prediction(strategy="x", world_size=world, per_rank=[], activation_bytes=[],
                          activation_bytes_checkpointed=None, load_bytes=0, built_bytes=[], runtime_bytes=0,
                          peak_bytes_per_rank=[peak] * world)

    peaks = {("train.activation_checkpointing=selective",): 96, ("train.activation_checkpointing=true",): 90,
             ("strategy.offload_optimizer=true",): 50,
             ("strategy.offload_optimizer=true", "strategy.offload_param=true"): 45}

    def predict(overrides, world):
        if overrides == ("strategy.cpu_offload=true",):
            raise RecipeError("strategy.cpu_offload applies to fsdp only")
        return prediction(40 if world == 4 else peaks[overrides], world)

    def offered(limit: int, *, one_process: bool = False):
        return one_change(Planned("x", prediction(100), limit), predict=predict, one_process=one_process)

    assert offered(97) == "train.activation_checkpointing=selective"  # less recompute than full, tried first
    assert offered(95) == "train.activation_checkpointing=true"
    assert offered(60) == "strategy.offload_optimizer=true"  # cpu_offload refused, passed over
    assert offered(47) == "strategy.offload_optimizer=true, strategy.offload_param=true"
    assert offered(42) == "4 ranks"
    assert offered(42, one_process=True) is None and offered(30) is None
    # on CPU twice the ranks share the host: each has half the memory
    assert one_change(Planned("x", prediction(100), 42), predict=predict, one_process=False,
                      limit_at=lambda world: 84 // world) is None
    assert one_change(Planned("x", "needs 2 ranks"), predict=predict, one_process=False) is None
    # where activations dominate: a smaller micro-batch, its accumulation keeping the global batch (after
    # checkpointing, before offload); with no global batch given, the accumulation is set, else derived from it
    from toolkit.config.recipe import BatchConfig

    peaks.update({("batch.micro_batch_size=4", "batch.grad_accum_steps=2"): 70,
                  ("batch.micro_batch_size=2", "batch.grad_accum_steps=4"): 60,
                  ("batch.micro_batch_size=1", "batch.grad_accum_steps=8"): 55,
                  ("batch.micro_batch_size=2", "batch.grad_accum_steps=null"): 60})
    same = "(the same global batch)"  # the label names every override the prediction made, as the user sets it
    for limit, want in ((75, f"batch.micro_batch_size=4, batch.grad_accum_steps=2 {same}"),
                        (62, f"batch.micro_batch_size=2, batch.grad_accum_steps=4 {same}"),
                        (56, f"batch.micro_batch_size=1, batch.grad_accum_steps=8 {same}"),
                        (50, "strategy.offload_optimizer=true")):
        assert one_change(Planned("x", prediction(100), limit), predict=predict, one_process=False,
                          batch=BatchConfig(micro_batch_size=8)) == want
    # a global batch given: the accumulation follows it where the recipe leaves it null, else it is set null
    assert one_change(Planned("x", prediction(100), 62), predict=predict, one_process=False,
                      batch=BatchConfig(micro_batch_size=4, global_batch_size=16)) == f"batch.micro_batch_size=2 {same}"
    assert one_change(Planned("x", prediction(100), 62), predict=predict, one_process=False,
                      batch=BatchConfig(micro_batch_size=4, global_batch_size=16, grad_accum_steps=2)) == \
        f"batch.micro_batch_size=2, batch.grad_accum_steps=null {same}"


def test_plan_judges_each_arm_against_its_own_ranks_share_of_the_host():
    """On CPU the default memory per rank is the host's ÷ the arm's ranks: a one-process arm (single) has the
    whole host, a 4-rank ddp a quarter of it (computed here from the host's pages, not by the planner)."""
    import os

    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    done = run_cli("plan", "recipes/llama-tiny.yaml", "--nproc", "4", "--strategies", "single,ddp",
                   "--set", "batch.micro_batch_size=8")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    for arm, ranks in (("single", 1), ("ddp", 4)):
        row = next(line for line in lines if line.startswith(f"{arm} "))
        assert row.rstrip().endswith(f"yes ({host // ranks / 2 ** 20:.0f})"), row
    assert lines[0].rstrip().endswith("fits (MiB)")
    assert f"({host // 4 / 2 ** 20:.0f})" not in next(line for line in lines if line.startswith("single "))


def test_the_limit_a_plan_judges_by_is_shown_in_the_peak_columns_unit():
    """1.04 GiB is 1065 MiB: a peak of 1041 MiB fits it. The header gave the limit in GiB to one place ("fits 1.0
    GiB"), under which that row's yes read false; it now gives the MiB the peak column is in."""
    done = run_cli("plan", "recipes/llama-tiny.yaml", "--strategies", "single", "--memory-per-rank", "1.04GiB")
    header, row = done.stdout.splitlines()[:2]
    assert header.rstrip().endswith(f"fits {1.04 * 2 ** 10:.0f} MiB"), header
    peak = int(row.split()[-2])
    assert row.split()[-1] == ("yes" if peak <= 1.04 * 2 ** 10 else "NO"), row


def test_plan_bad_input_is_one_line():
    done = run_cli("plan", "recipes/llama-tiny.yaml", "--strategies", "ddp,zero9")
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "zero9" in done.stderr
    with pytest.raises(RecipeError, match="40GiB"):
        plan.parse_bytes("forty gigs")
    assert plan.parse_bytes("40GiB") == 40 * 2 ** 30 and plan.parse_bytes("80 GB") == 80 * 10 ** 9
    with pytest.raises(RecipeError, match="--memory-per-rank: 40G is ambiguous: write 40GiB or 40GB"):
        plan.parse_bytes("40G")  # 7 % apart: the fit may differ


@pytest.mark.parametrize("sets, words", [
    (("strategy.name=zero", "strategy.stage=4"), "strategy.stage must be 0, 1, 2 or 3, got 4"),
    (("strategy.name=zero", "strategy.ds_config=/nonexistent.json"), "/nonexistent.json not found")])
def test_a_mistake_in_the_recipes_own_strategy_is_one_line_exit_2_as_validate_says_it(sets, words, capsys):
    """Without --strategies the plan is of the recipe as written: its mistake was a table row "cannot run" and exit 1
    (toolkit validate: one line, exit 2)."""
    from toolkit.cli import main

    overrides = [part for value in sets for part in ("--set", value)]
    assert main(["plan", str(REPO / "recipes/llama-tiny.yaml"), *overrides]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and words in captured.err and len(captured.err.strip().splitlines()) == 1
    assert main(["validate", str(REPO / "recipes/llama-tiny.yaml"), *overrides]) == 2
    assert words in capsys.readouterr().err
    # a recipe that runs but that the plan cannot predict is no mistake: its row says why, as before
    assert main(["plan", str(REPO / "recipes/llama-tiny.yaml"), "--set", "strategy.name=hf_native"]) == 1
    assert "hf_native cannot run: toolkit plan does not predict hf_native" in capsys.readouterr().out


@pytest.mark.parametrize("sets, limit", [(("batch.global_batch_size=null", "batch.grad_accum_steps=2",
                                            "data.max_length=128"), "1000MiB"),
                                          (("batch.grad_accum_steps=1",), "900MiB")])
def test_a_smaller_micro_batch_offered_keeps_the_global_batch_as_the_user_sets_it(sets, limit, capsys):
    """The offer named only batch.micro_batch_size where the prediction had also set the accumulation: set alone it
    shrank the global batch fourfold, or (with an accumulation given beside a global batch) was refused."""
    from toolkit.cli import main
    from toolkit.config.files import load_recipe
    from toolkit.config.recipe import plan_batch

    overrides = [part for value in sets for part in ("--set", value)]
    recipe_path = str(REPO / "recipes/llama-tiny.yaml")
    assert main(["plan", recipe_path, "--strategies", "ddp", *overrides, "--memory-per-rank", limit]) == 1
    offer = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("  ddp with "))
    assert offer.endswith(" (the same global batch)"), offer
    applied = offer.removeprefix("  ddp with ").removesuffix(" (the same global batch)").split(", ")
    before = plan_batch(load_recipe(recipe_path, list(sets)).batch, world_size=2)
    after = plan_batch(load_recipe(recipe_path, [*sets, *applied]).batch, world_size=2)
    assert after.global_batch_size == before.global_batch_size and after.micro_batch_size < before.micro_batch_size


def test_plan_exits_1_when_no_arm_can_run(capsys):
    """A script that plans before it launches stops: no arm can run as given (pipelines on one rank) is exit 1,
    the table saying why (an arm that can run, fitting or not, is exit 0: test_plan_command_prints_every_arm...)."""
    from toolkit.cli import main

    assert main(["plan", str(REPO / "recipes/llama-tiny.yaml"), "--nproc", "1", "--strategies",
                 "pp-gpipe,pp-1f1b"]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == "no arm can run as given: each line says why."


def test_a_plan_where_no_arm_can_run_states_no_memory_limit():
    """With every arm refused there is nothing to judge: the footer said "host memory ÷ 1 rank(s)" whatever
    --nproc was. Now it says that no arm can run, and the limit is not asked for."""
    def no_limit(world):
        raise AssertionError(f"asked for the memory of {world} rank(s)")

    text = plan.render([("tp", "needs 2 or more ranks"), ("pp-1f1b", "needs 2 or more ranks")],
                       memory_per_rank=no_limit)
    lines = text.splitlines()
    assert lines[0].split()[-1] == "fits" and lines[-1] == "no arm can run as given: each line says why."
    # the table's rows, then each reason under it (a reason in the row set the table's width)
    assert [line.split()[0] for line in lines[1:3]] == ["tp", "pp-1f1b"]
    assert all(line.endswith("cannot run (below)") for line in lines[1:3])
    assert lines[3:5] == ["tp cannot run: needs 2 or more ranks", "pp-1f1b cannot run: needs 2 or more ranks"]
