"""Replica consistency: two real gloo processes; a drifted replica is caught and named."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from toolkit.consistency import ReplicaDriftError, check_replicas
from toolkit.dist import DistEnv


def _worker(rank: int, init_file: str, drift: bool, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    if drift and rank == 1:
        with torch.no_grad():
            model[1].weight[0, 0] += 1e-7  # one element, one ulp-scale nudge
    env = DistEnv(rank=rank, local_rank=rank, world_size=2, device=torch.device("cpu"))
    try:
        check_replicas(model.named_parameters(), env, when="at step 7")
        results[rank] = "ok"
    except ReplicaDriftError as exc:
        results[rank] = str(exc)
    dist.destroy_process_group()


@pytest.mark.parametrize("drift", [False, True])
def test_replica_check_names_the_drifted_parameter(tmp_path, drift):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(str(tmp_path / "init"), drift, results), nprocs=2)
    if not drift:
        assert dict(results) == {0: "ok", 1: "ok"}
    else:
        for rank in (0, 1):  # every rank stops, with the same message
            assert "at step 7: rank 1 differs from rank 0 in parameter '1.weight'" in results[rank]
