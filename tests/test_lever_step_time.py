"""What the communication levers cost in the step-time model (toolkit/cost/step_time.py): local SGD's sync once per
window, so each step carries 1/sync_every of it; PowerSGD's encoding, the matrix products and error feedback its
DDP hook runs on the critical path. The bytes each lever sends are held to the collective counter elsewhere
(test_communication_levers.py); these are the time rules built on them."""

import dataclasses
import math

import pytest

from conftest import REPO

from toolkit.config.files import load_recipe
from toolkit.config.parallel import resolve
from toolkit.cost import hardware, step_time
from toolkit.plan.predict import planned_model
from toolkit.plan.scale import work_for_shapes

RECIPE = str(REPO / "recipes" / "llama3-8b.yaml")
WORLD = 16
CLUSTER = step_time.Cluster(hardware=hardware.load("h100-sxm"), num_nodes=2, gpus_per_node=8)


@pytest.fixture(scope="module")
def model():
    return planned_model(load_recipe(RECIPE, ["strategy.name=ddp"]))  # the meta device: shapes only


def _predicted(model, *sets: str):
    recipe = resolve(load_recipe(RECIPE, ["strategy.name=ddp", *sets]), world_size=WORLD)
    work = work_for_shapes(recipe, model, world_size=WORLD, rank=WORLD - 1, shapes=None)
    return work, step_time.predict(model, work, CLUSTER)


def _cost(step, words: str) -> step_time.Cost:
    found = [c for c in step.costs if words in c.what]
    assert len(found) == 1, [c.what for c in step.costs]
    return found[0]


def test_a_local_sgd_sync_costs_each_step_its_share_of_the_window(model):
    work2, every2 = _predicted(model, "strategy.sync_every=2")
    work8, every8 = _predicted(model, "strategy.sync_every=8")
    synced = [c for c in work8.collectives if c.every == 8]
    assert {c.what for c in synced} == {"parameters averaged (every 8 steps)",
                                        "the replicas' squared norms (their drift before the sync)"}
    # the same all-reduce of every parameter, once in 2 steps and once in 8: a quarter of the time per step
    average2, average8 = _cost(every2, "parameters averaged"), _cost(every8, "parameters averaged")
    assert average8.exposed_s == pytest.approx(average2.exposed_s / 4, rel=1e-12)
    # and the same collective run every step costs the whole of it: the window's mean is 1/8 of that
    whole = [dataclasses.replace(c, every=1) for c in work8.collectives]
    every_step = step_time.predict(model, dataclasses.replace(work8, collectives=whole), CLUSTER)
    assert average8.exposed_s == pytest.approx(_cost(every_step, "parameters averaged").exposed_s / 8, rel=1e-12)
    assert every8.step_time_s < every_step.step_time_s
    # without the lever the step reduces every gradient instead, in backward: no sync cost at all
    _, plain = _predicted(model)
    assert not [c for c in plain.costs if "averaged" in c.what]


def test_powersgd_encoding_is_counted_from_the_gradient_matrices(model):
    rank = 4
    work, step = _predicted(model, "strategy.gradient_compression=powersgd", f"strategy.powersgd_rank={rank}")
    # by hand, as torch's powerSGD_hook decides: a tensor is an n × m matrix of its first dimension, compressed
    # where (n + m)·r·2 < n·m; P = M·Q, Q = Mᵀ·P and P·Qᵀ are 2·n·m·r FLOPs each, orthogonalising P and the
    # warm-started Q 2·(n + m)·r²
    flops = 0.0
    numbers = matrix_numbers = 0
    for p in model.parameters():
        n = p.shape[0]
        m = math.prod(p.shape[1:]) if p.dim() > 1 else 1
        r = min(n, m, rank)
        numbers += p.numel()
        if (n + m) * r * 2 < n * m:
            flops += 6 * n * m * r + 2 * (n + m) * r * r
            matrix_numbers += n * m
    assert matrix_numbers > 0.99 * numbers  # the 8B model is nearly all matrices
    encoded = [c for c in work.collectives if c.codec_flops]
    assert len(encoded) == 1 and encoded[0].codec_flops == pytest.approx(flops, rel=1e-12)
    # error feedback: 8 passes over every gradient number; the products: 3 over each matrix's; the tensors sent
    # whole: 6 (packed, divided, copied back); fp32 gradients
    assert encoded[0].codec_bytes == 4 * (8 * numbers + 3 * matrix_numbers + 6 * (numbers - matrix_numbers))
    cost = _cost(step, "encoding PowerSGD P factors")
    hw = CLUSTER.hardware
    by_hand = flops / (hw.peak("fp32") * (hw.compute_efficiency or step_time.MATMUL_EFFICIENCY)) + \
        encoded[0].codec_bytes / hw.memory_bandwidth_bytes_per_s
    assert cost.exposed_s == cost.seconds == pytest.approx(by_hand, rel=1e-9)
    # memory-bound: 11 passes over 8B fp32 numbers (0.35 TB) take ~0.1 s on an H100, the products a few ms; about
    # 2 % of this step, which the model leaves out no longer
    assert encoded[0].codec_bytes / hw.memory_bandwidth_bytes_per_s > 10 * flops / (hw.peak("fp32") * 0.5)
    assert 0.01 * step.step_time_s < cost.exposed_s < 0.05 * step.step_time_s
