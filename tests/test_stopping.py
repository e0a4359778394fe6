"""A run that ends other than completing says so in run.json."""

import json

import pytest
import torch

from toolkit import runinfo
from toolkit.dist import DistEnv

ONE_RANK = DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


def test_a_run_that_raises_says_failed_in_run_json_and_its_own_error_stays(tmp_path):
    info = {"status": "running", "strategy": "single", "_last_step": 2}
    with pytest.raises(ZeroDivisionError):
        with runinfo.ending(info, env=ONE_RANK, out_dir=tmp_path):
            1 / 0
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["status"] == "failed" and run["ended"]["reason"] == "ZeroDivisionError: division by zero"
    assert run["ended"]["steps_done"] == 2 and run["ended"]["error"] == "ZeroDivisionError"
    # run.json that cannot be written (its folder gone): the run's own error, not the write's
    with pytest.raises(ZeroDivisionError):
        with runinfo.ending(info, env=ONE_RANK, out_dir=tmp_path / "gone"):
            1 / 0
