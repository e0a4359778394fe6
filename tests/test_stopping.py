"""A run that ends other than completing says so in run.json, and train.on_nonfinite=skip does not skip forever:
the skipped steps are counted, and a run whose weights give non-finite values on every batch stops."""

import json
import math

import pytest
import torch

from conftest import metrics, strict_loads, write_recipe
from toolkit.config.files import load_recipe
from toolkit.launch.rank import nonfinite_line
from toolkit.observe.metrics import read_jsonl
from toolkit.process.dist import DistEnv
from toolkit.process.stopping import NonFinite, SkippedSteps
from toolkit.train import runinfo
from toolkit.train.loop import train

ONE_RANK = DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


def test_skipping_stops_once_the_weights_overflow_on_every_batch_and_run_json_says_stopped(tmp_path, tiny_llama_dir):
    """Before: every step after step 1 was NaN and skipped, the run 'completed' with exit 0 and run.json said
    running or completed. lr 10 without clipping: step 1's update makes the fp16 forward overflow on every batch."""
    out = tmp_path / "run"
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=out, precision="fp16",
                                      optim={"lr": 10.0, "max_grad_norm": 0.0}, data={"eval": None},
                                      train={"max_steps": 6, "on_nonfinite": "skip", "max_consecutive_skips": 2,
                                             "consistency_check_every": None}))
    with pytest.raises(NonFinite) as stop:
        train(recipe, ONE_RANK)
    assert (stop.value.what, stop.value.step, stop.value.skipped_from) == ("loss", 3, 2)
    line = nonfinite_line(stop.value, out)
    assert "from 2 to 3" in line and "skipping cannot recover" in line and "no checkpoint from before them" in line
    steps = metrics(out)  # strict JSON
    assert [m["step"] for m in steps] == [1, 2, 3] and not steps[0]["skipped"]  # the stopping step is logged, skipped
    for m in steps[1:]:
        assert m["skipped"] and m["skipped_nonfinite"] and m["loss"] is None and m["nonfinite"]["loss"] == "nan"
        assert m["loss_scale"] == steps[0]["loss_scale"] == 65536.0  # a dropped step leaves the scaler as it was
    assert all(math.isnan(m["loss"]) for m in read_jsonl(out / "metrics.jsonl")[1:])
    run = strict_loads((out / "run.json").read_text())
    assert run["status"] == "stopped" and run["skipped_steps"] == {"nonfinite": 2, "fp16_overflow": 0, "steps_run": 3}
    assert run["ended"] == {"reason": str(stop.value), "steps_done": 3, "checkpoint": None, "what": "loss",
                            "value": "nan", "step": 3, "skipped_from": 2}


def test_a_run_that_raises_says_failed_in_run_json_and_its_own_error_stays(tmp_path):
    info = runinfo.RunRecord(fields={"status": "running", "strategy": "single"}, out_dir=tmp_path, last_step=2)
    with pytest.raises(ZeroDivisionError):
        with runinfo.ending(info, env=ONE_RANK, out_dir=tmp_path, skips=SkippedSteps(10)):
            1 / 0
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["status"] == "failed" and run["ended"]["reason"] == "ZeroDivisionError: division by zero"
    assert run["ended"]["steps_done"] == 2 and run["ended"]["error"] == "ZeroDivisionError"
    # run.json that cannot be written (its folder gone): the run's own error, not the write's
    with pytest.raises(ZeroDivisionError):
        with runinfo.ending(info, env=ONE_RANK, out_dir=tmp_path / "gone", skips=SkippedSteps(10)):
            1 / 0


def _step(step: int, *, nonfinite: bool = False, overflow: bool = False, scale=None) -> dict:
    record = {"step": step, "loss": math.nan if nonfinite else 1.0, "grad_norm": math.nan if nonfinite else 1.0,
              "skipped": nonfinite or overflow, "loss_scale": scale}
    return {**record, "skipped_nonfinite": True} if nonfinite else record


def test_skipped_steps_count_only_non_finite_ones_in_a_row_and_say_how_many():
    skips = SkippedSteps(3, done=10)
    for record in (_step(11, scale=8.0), _step(12, nonfinite=True), _step(13, nonfinite=True),
                   _step(14, overflow=True, scale=4.0), _step(15, nonfinite=True), _step(16, nonfinite=True)):
        assert skips.count(record) is None  # an update (or fp16's own skip) between ends a row
    last = _step(17, nonfinite=True)
    stop = skips.count(last)
    assert stop is not None and (stop.step, stop.skipped_from) == (17, 15) and last["loss_scale"] == 4.0
    assert skips.summary() == {"nonfinite": 5, "fp16_overflow": 1, "steps_run": 7}
    assert skips.note() == "5 of 7 steps since the resume at step 10 skipped (non-finite loss or gradient norm)"
    assert SkippedSteps(None).count(_step(1, nonfinite=True)) is None and SkippedSteps(None).note() == ""
