"""bf16 and fp16 runs complete with falling loss; fp16 reports its loss scale and skipped steps."""

import pytest

from conftest import metrics

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
