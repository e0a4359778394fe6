"""Replica consistency: two real gloo processes; a drifted replica is caught and named."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from toolkit.observe.consistency import ReplicaDriftError, check_groups, check_replicas
from toolkit.process.dist import DistEnv


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


def _group_worker(rank: int, init_file: str, results) -> None:
    # HSDP's layout at 4 ranks: replica groups {0, 2} and {1, 3} hold the same shards
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=4)
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    torch.manual_seed(rank % 2)  # shard 0 on ranks 0 and 2, shard 1 on ranks 1 and 3
    shard = torch.nn.Linear(4, 4)
    if rank == 3:
        with torch.no_grad():
            shard.bias[2] += 1e-6
    env = DistEnv(rank=rank, local_rank=rank, world_size=4, device=torch.device("cpu"))
    said = []
    for check in (lambda: check_replicas(shard.named_parameters(), env, when="at step 3", group=groups[rank % 2]),
                  lambda: check_groups([(list(shard.named_parameters()), groups[rank % 2])], env, when="at step 4")):
        try:
            check()
            said.append("ok")
        except ReplicaDriftError as exc:
            said.append(str(exc))
    results[rank] = said
    dist.destroy_process_group()


def test_replica_groups_are_checked_within_the_group(tmp_path):
    # the shards differ between groups (by design) and agree within {0, 2}; rank 3 drifted from rank 1
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = mp.Manager().dict()
    mp.spawn(_group_worker, args=(str(tmp_path / "init"), results), nprocs=4)
    alone = {rank: said[0] for rank, said in results.items()}
    assert alone[0] == alone[2] == "ok"
    for rank in (1, 3):
        assert "at step 3: rank 3 differs from rank 1 in parameter 'bias'" in alone[rank]
    # what the training loop runs (check_groups): the drift stops every rank, the other group's with a pointer
    together = {rank: said[1] for rank, said in results.items()}
    for rank in (1, 3):
        assert "at step 4: rank 3 differs from rank 1 in parameter 'bias'" in together[rank]
    for rank in (0, 2):
        assert together[rank] == ("at step 4: replicas on rank(s) 1, 3 drifted (their line names the tensor); this "
                                  "rank's own replicas agree")


def test_a_tensor_longer_than_a_chunk_is_summed_whole_and_a_swap_past_the_first_chunk_is_seen():
    """checksums reads a tensor CHUNK elements at a time: the sums equal one float64 pass over the whole tensor
    (to float64 rounding), and two elements swapped in a later chunk still change the position-weighted sum (its
    weights repeat every 7 positions, and a chunk is a multiple of 7 long)."""
    from toolkit.observe.consistency import CHUNK, checksums

    torch.manual_seed(0)
    tensor = torch.randn(2 * CHUNK + 5)
    whole = tensor.double()
    weights = torch.arange(whole.numel(), dtype=torch.float64) % 7 + 1
    expected = torch.stack([whole.sum(), (whole * whole).sum(), (whole * weights).sum()])
    got = checksums([("w", tensor)])[0]
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-9)
    swapped = tensor.clone()
    swapped[[CHUNK + 1, CHUNK + 3]] = swapped[[CHUNK + 3, CHUNK + 1]]  # weights 2 and 4 there
    moved = checksums([("w", swapped)])[0]
    torch.testing.assert_close(moved[:2], got[:2], rtol=1e-12, atol=1e-9)  # the same elements, summed in another order
    a, b = float(tensor[CHUNK + 1]), float(tensor[CHUNK + 3])
    assert float(moved[2] - got[2]) == pytest.approx((4 - 2) * (a - b), rel=1e-6)  # weights 2 and 4 swapped
