"""bf16 and fp16 runs complete with falling loss; fp16 reports its loss scale and skipped steps."""

import pytest

from conftest import metrics, run_cli, write_recipe
from toolkit.process import faults

FAST = ("train.max_steps=8", "optim.lr=0.003", "optim.warmup_steps=0")


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_loss_falls(llama_runs, precision):
    run = llama_runs.get(f"single-{precision}", overrides=(f"precision={precision}", *FAST))
    steps = metrics(run)
    assert len(steps) == 8
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.5, [m["loss"] for m in steps]
    if precision == "fp16":
        assert all(m["loss_scale"] and m["loss_scale"] > 0 for m in steps)
        assert all(isinstance(m["skipped"], bool) for m in steps)
    else:
        assert all(m["loss_scale"] is None for m in steps)


def test_fp16_under_ddp_with_accumulation(llama_runs):
    run = llama_runs.get("ddp-fp16", nproc=2, overrides=("strategy.name=ddp", "precision=fp16",
                                                          "batch.micro_batch_size=2", "batch.grad_accum_steps=2",
                                                          *FAST))
    steps = metrics(run)
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.5
    assert steps[0]["loss_scale"] == 65536.0  # GradScaler's default initial scale, reported per step


def test_an_fp16_overflow_skips_the_update_and_holds_the_lr_schedule(tiny_llama_dir, tmp_path):
    """As DeepSpeed's engine and transformers' Trainer do: the torch strategies stepped the schedule on a step
    the loss scaler skipped, and their lr ran one step ahead of a ZeRO arm's after each overflow."""
    out = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=out, precision="fp16",
                          data={"eval": None}, optim={"warmup_steps": 3}, train={"max_steps": 4})
    # an inf gradient before step 2's update
    result = run_cli("train", str(recipe), env={faults.INF_GRADIENT_AT_STEP: "2"})
    assert result.returncode == 0, result.stderr[-3000:]
    steps = metrics(out)
    assert [m["skipped"] for m in steps] == [False, True, False, False]
    assert steps[1]["loss_scale"] == steps[0]["loss_scale"] / 2  # the scaler backed off
    # warm-up step k runs at (k+1)/(w+1) of optim.lr (w = 3): 1/4, 2/4; the skipped step holds it at 2/4; 3/4
    assert [m["lr"] for m in steps] == pytest.approx([0.25e-3, 0.5e-3, 0.5e-3, 0.75e-3], rel=1e-12)


@pytest.mark.parametrize("strategy", ["single", "fsdp"])
def test_a_checkpoint_after_only_skipped_steps_resumes(tiny_llama_dir, tmp_path, strategy):
    """An fp16 overflow at the first step (the loss scaler's first scale is often too high) leaves a foreach or
    loop AdamW without any state (the fused one makes it, steps undone, as it skips): a checkpoint there (SIGTERM,
    checkpoint.every_steps) held none, and its resume was refused ('holds no optim.state...'). It resumes, each
    parameter starting as it would have (no Adam step counted for the skipped one): the same losses and weights
    as the run never stopped. The same holds for a parameter no gradient reached yet (an expert no token was
    routed to)."""
    import shutil

    import torch

    from conftest import exported_weights, losses

    def run(out, *extra):
        recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=out, precision="fp16",
                              data={"eval": None}, strategy={"name": strategy}, train={"max_steps": 3},
                              optim={"implementation": "foreach"},
                              checkpoint={"every_steps": 1, "keep_last": 5, "final": False})
        command = ["train"] if strategy == "single" else ["launch", "--nproc", "2"]
        # step 1's update skipped, as an overflow's
        result = run_cli(*command, str(recipe), *extra, env={faults.INF_GRADIENT_AT_STEP: "1"})
        assert result.returncode == 0, result.stderr[-3000:]
        return result

    full = tmp_path / "full"
    run(full)
    assert [m["skipped"] for m in metrics(full)] == [True, False, False]
    out = tmp_path / "resumed"  # what a run stopped after step 1 leaves
    out.mkdir()
    (out / "metrics.jsonl").write_text((full / "metrics.jsonl").read_text().splitlines()[0] + "\n")
    shutil.copytree(full / "checkpoints" / "step-00000001", out / "checkpoints" / "step-00000001")
    result = run(out, "--resume")
    assert "parameter(s) had no optimizer state when the checkpoint was saved" in result.stderr
    assert losses(out) == losses(full)
    got, want = exported_weights(out), exported_weights(full)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=lambda m, k=key: f"{k}: {m}")
