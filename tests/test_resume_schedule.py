"""A resumed run follows its own recipe's lr schedule from the checkpoint's position: a changed optim.lr or
max_steps takes effect from the first resumed step (and is said in one line), under a torch optimizer and
under DeepSpeed, also when a ds_config "scheduler" block wrote the checkpoint or reads it.

The lrs are checked against the schedules written out below, not against the toolkit's own code."""

import json
import math

import pytest

from conftest import launch, metrics, run_cli, write_recipe

LR, WARMUP, FLOOR = 1.0e-3, 2, 0.1
NOTICE = "[toolkit] resume: the lr schedule follows this recipe"
# DeepSpeed's WarmupDecayLR, every value "auto": filled from the recipe (optim.lr, warmup, the run's steps)
WARMUP_DECAY = {"zero_optimization": {"stage": 2},
                "scheduler": {"type": "WarmupDecayLR", "params": {
                    "warmup_num_steps": "auto", "total_num_steps": "auto", "warmup_max_lr": "auto",
                    "warmup_min_lr": "auto"}}}


def recipe_lr(step: int, *, lr: float, total_steps: int) -> float:
    """The recipe's lr at 1-based optimizer step `step`: step k of a warm-up of w steps runs at k/(w+1) of
    optim.lr, then a cosine from optim.lr down to min_lr_ratio × optim.lr at the run's last step."""
    if step <= WARMUP:
        return lr * step / (WARMUP + 1)
    progress = (step - 1 - WARMUP) / (total_steps - WARMUP)
    return lr * (FLOOR + (1 - FLOOR) * 0.5 * (1 + math.cos(math.pi * progress)))


def warmup_decay_lr(step: int, *, lr: float, total_steps: int) -> float:
    """DeepSpeed's WarmupDecayLR (log warm-up from 0 over max(2, w) iterations, then linear to 0 at the
    last), whose iteration is -1 before the first step: 1-based step s runs at iteration s - 2."""
    iteration, warmup = step - 2, max(2, WARMUP)
    if iteration < 0:
        return 0.0
    if iteration < warmup:
        return lr * math.log(iteration + 1) / math.log(warmup)
    return lr * max(0.0, (total_steps - iteration) / max(1, total_steps - warmup))


def lrs(run_dir) -> dict[int, float]:
    return {m["step"]: m["lr"] for m in metrics(run_dir) if "lr" in m}


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_llama_dir):
    """A 4-step single run with checkpoints at steps 2 and 4, and its recipe."""
    root = tmp_path_factory.mktemp("resume-schedule")
    recipe = write_recipe(root / "recipe.yaml", model_dir=tiny_llama_dir, output_dir=root / "base",
                          optim={"lr": LR, "warmup_steps": WARMUP, "schedule": "cosine", "min_lr_ratio": FLOOR},
                          batch={"global_batch_size": 8, "micro_batch_size": 4, "grad_accum_steps": None},
                          train={"max_steps": 4, "consistency_check_every": None},
                          checkpoint={"every_steps": 2, "keep_last": 2, "final": True})
    launch(recipe, nproc=1)
    (root / "warmup-decay.json").write_text(json.dumps(WARMUP_DECAY))
    return root, recipe


def checkpoint(run_dir, step: int) -> str:
    return str(run_dir / "checkpoints" / f"step-{step:08d}")


def test_the_uninterrupted_run_follows_the_written_out_schedule(base):
    root, _ = base
    want = {s: recipe_lr(s, lr=LR, total_steps=4) for s in range(1, 5)}
    assert lrs(root / "base") == pytest.approx(want, rel=1e-12, abs=0)


def test_single_resumed_with_another_lr_runs_at_it_from_the_first_resumed_step(base):
    root, recipe = base
    out = root / "new-lr"
    result = launch(recipe, nproc=1, overrides=(f"output_dir={out}", "optim.lr=5e-3"),
                    extra=("--resume", checkpoint(root / "base", 2)))
    assert lrs(out) == pytest.approx({s: recipe_lr(s, lr=5e-3, total_steps=4) for s in (3, 4)}, rel=1e-12, abs=0)
    notices = [line for line in result.stderr.splitlines() if line.startswith(NOTICE)]
    assert notices == [f"{NOTICE} (optim.lr 0.005, was 0.001)"]
    assert "Detected call of `lr_scheduler.step()`" not in result.stderr  # taking up the position says nothing


def test_single_extending_a_finished_run_follows_the_longer_schedule(base):
    root, recipe = base
    out = root / "extended"
    result = launch(recipe, nproc=1, overrides=(f"output_dir={out}", "train.max_steps=6"),
                    extra=("--resume", checkpoint(root / "base", 4)))
    # the 6-step schedule is still on its way down at step 5, where the 4-step one (which a resume kept for
    # its first step) is at its floor
    assert lrs(out) == pytest.approx({s: recipe_lr(s, lr=LR, total_steps=6) for s in (5, 6)}, rel=1e-12, abs=0)
    assert lrs(out)[5] > 2 * recipe_lr(5, lr=LR, total_steps=4)
    assert f"{NOTICE} (total steps 6, was 4)" in result.stderr


def test_zero2_resumed_with_another_lr_and_more_steps_follows_the_recipe(base):
    root, recipe = base
    out = root / "zero-new-lr"
    result = launch(recipe, nproc=1, extra=("--resume", checkpoint(root / "base", 2)),
                    overrides=(f"output_dir={out}", "strategy.name=zero", "strategy.stage=2", "optim.lr=5e-3",
                               "train.max_steps=5"))
    assert lrs(out) == pytest.approx({s: recipe_lr(s, lr=5e-3, total_steps=5) for s in (3, 4, 5)},
                                     rel=1e-12, abs=0)
    assert f"{NOTICE} (optim.lr 0.005, was 0.001; total steps 5, was 4)" in result.stderr


def test_a_warmup_decay_zero_checkpoint_resumes_as_single_on_the_recipes_schedule(base):
    root, recipe = base
    ds_config = f"strategy.ds_config={root / 'warmup-decay.json'}"
    source = root / "zero-warmup-decay"
    launch(recipe, nproc=1, overrides=(f"output_dir={source}", "strategy.name=zero", ds_config, "train.max_steps=2",
                                       "checkpoint.every_steps=1"))
    assert lrs(source) == pytest.approx({s: warmup_decay_lr(s, lr=LR, total_steps=2) for s in (1, 2)}, abs=1e-12)
    out = root / "zero-warmup-decay-to-single"
    result = launch(recipe, nproc=1, overrides=(f"output_dir={out}",), extra=("--resume", checkpoint(source, 2)))
    assert lrs(out) == pytest.approx({s: recipe_lr(s, lr=LR, total_steps=4) for s in (3, 4)}, rel=1e-12, abs=0)
    assert f"{NOTICE} (total steps 4, was 2; scheduler the recipe's, was ds_config WarmupDecayLR)" in result.stderr


def test_two_zero_ranks_with_a_warmup_decay_block_resume_a_single_checkpoint(base):
    root, recipe = base
    out = root / "single-to-zero-warmup-decay"
    result = run_cli("launch", "--nproc", "2", str(recipe), "--set", f"output_dir={out}",
                     "--set", "strategy.name=zero", "--set", f"strategy.ds_config={root / 'warmup-decay.json'}",
                     "--set", "train.max_steps=5", "--resume", checkpoint(root / "base", 2))
    assert result.returncode == 0, result.stderr[-6000:]
    assert lrs(out) == pytest.approx({s: warmup_decay_lr(s, lr=LR, total_steps=5) for s in (3, 4, 5)},
                                     rel=1e-12, abs=0)
    assert f"{NOTICE} (total steps 5, was 4; scheduler ds_config WarmupDecayLR, was the recipe's)" in result.stderr


def test_a_resume_on_another_train_split_says_its_order_is_not_the_checkpoints(base):
    """Step k reads positions of a seeded permutation of the train split: another split (rows added or removed)
    gives another permutation, and the resumed steps read the samples in another order than the interrupted run
    would have. That was silent; the checkpoint records the split's samples and tokens, and a resume on another
    says so in one line. The same split says nothing."""
    from conftest import TRAIN

    root, recipe = base
    part = root / "part.jsonl"
    rows = open(TRAIN).read().splitlines(keepends=True)[:300]
    part.write_text("".join(rows))
    manifest = json.loads((root / "base" / "checkpoints" / "step-00000002" / "manifest.json").read_text())
    assert manifest["train_data"]["samples"] == len(open(TRAIN).read().splitlines())
    changed = launch(recipe, nproc=1, overrides=(f"output_dir={root / 'other-data'}", f"data.train={part}"),
                     extra=("--resume", checkpoint(root / "base", 2)))
    said = [line for line in changed.stderr.splitlines() if "data.train is not the split" in line]
    assert len(said) == 1 and f"samples 300, was {manifest['train_data']['samples']:,}" in said[0], said
    same = launch(recipe, nproc=1, overrides=(f"output_dir={root / 'same-data'}",),
                  extra=("--resume", checkpoint(root / "base", 2)))
    assert "data.train is not the split" not in same.stderr
