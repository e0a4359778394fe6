"""A CPU rank's compute rates are those of the cores it has (toolkit/cost/calibrate.py: rank_cores, at_cores): its
threads, or its share of the machine's cores where the ranks' threads outnumber them. The compare's predicted step
times and `toolkit calibrate --hardware cpu --nproc N` use the one rule; the references here are arithmetic on the
rates a profile was given."""

import dataclasses
import math

import pytest

from toolkit.cost import calibrate, step_time
from toolkit.cost.hardware import Hardware, Link, Measured, PeakFlops

LINK = Link(bandwidth_bytes_per_s=1e9, latency_s=1e-5)


def profile_at(threads: int, *, matmul: float = 8e10, loss: float = 6e-9) -> Hardware:
    """A CPU profile as cpu_profile writes one, its rates measured at `threads` threads."""
    return Hardware(name="cpu", peak_flops_per_s=PeakFlops(bf16=matmul, fp16=matmul, fp32=matmul),
                    memory_bytes=2e10, memory_bandwidth_bytes_per_s=2e10, intra_node=LINK, inter_node=LINK,
                    host_link=LINK, gpus_per_node=2, compute_efficiency=1.0, overlaps_communication=False,
                    measured=Measured(matmul_flops_per_s=matmul, matmul_dtype="fp32", memory_bandwidth_bytes_per_s=2e10,
                                      attention_flops_per_s={"64": 1e10, "1024": 3e10}, bus_bandwidth_bytes_per_s=1e9,
                                      loss_seconds_per_logit=loss, num_ranks=2, threads=threads,
                                      seconds_per_op=2e-5))


@pytest.mark.parametrize("threads, world, cores, want", [
    (1, 2, 2, 1.0),  # 2 ranks of 1 thread on 2 cores: a core each, as the profile measured
    (2, 1, 2, 2.0),  # one rank of 2 threads: both cores
    (1, 4, 2, 0.5),  # 4 ranks of 1 thread on 2 cores: they time-share, half a core each
    (4, 2, 16, 4.0),  # fewer threads than cores: the threads
])
def test_a_rank_computes_on_its_threads_or_its_share_of_the_cores(threads, world, cores, want):
    """At 4 ranks on this machine's 2 cores the compare's arms were predicted -42 to -48 % of their measured step
    times while each rank was charged a whole core, -6 to -15 % with half of one."""
    assert calibrate.rank_cores(threads, world=world, cores=cores) == want


def test_rates_follow_the_cores_from_what_was_measured_not_from_an_earlier_scaling():
    measured = profile_at(1)
    half = calibrate.at_cores(measured, 0.5)
    assert half.measured.cores == 0.5 and half.measured.threads == 1
    assert half.measured.matmul_flops_per_s == 4e10 and half.peak_flops_per_s.fp32 == 4e10
    assert half.measured.attention_flops_per_s == {"64": 5e9, "1024": 1.5e10}
    assert half.measured.loss_seconds_per_logit == pytest.approx(12e-9)
    # what no core count changes: memory, the bus, the host's memory
    assert half.measured.memory_bandwidth_bytes_per_s == 2e10 and half.measured.bus_bandwidth_bytes_per_s == 1e9
    assert half.memory_bytes == measured.memory_bytes
    # a single arm of 2 threads read from the 4-rank profile: twice the 1-thread rates, not four times the half
    two = calibrate.at_cores(half, 2.0)
    assert two.measured.matmul_flops_per_s == 1.6e11 and two.measured.loss_seconds_per_logit == pytest.approx(3e-9)
    assert calibrate.at_cores(measured, 1.0) is measured


def test_an_ops_host_time_is_one_threads_slower_on_a_shared_core_no_faster_on_more():
    """An op's dispatch runs on the rank's one Python thread: half a core (4 ranks on 2 cores) doubles it, more
    threads than one do not shorten it."""
    one = profile_at(1)
    assert calibrate.at_cores(one, 0.5).measured.seconds_per_op == pytest.approx(4e-5)
    assert calibrate.at_cores(one, 2.0).measured.seconds_per_op == pytest.approx(2e-5)
    assert calibrate.at_cores(calibrate.at_cores(one, 0.5), 2.0).measured.seconds_per_op == pytest.approx(2e-5)
    assert calibrate.at_cores(profile_at(2), 0.5).measured.seconds_per_op == pytest.approx(4e-5)


def test_a_rank_on_more_cores_is_not_capped_at_the_rate_measured_on_fewer():
    """The step's rate is the fitted peak capped by the measured GEMM rate; the CPU profile's peak is that rate, so
    scaling the measured rate alone left a single 2-thread arm at the 1-thread rate (predicted +30 to +49 % of
    its measured step time in a 4-rank compare)."""
    two = calibrate.at_cores(profile_at(1), 2.0)
    assert step_time._flops_per_s(two, "fp32", 1.0) == 1.6e11


def test_calibrating_more_ranks_than_cores_gives_each_its_share(monkeypatch):
    """`toolkit calibrate --hardware cpu --nproc 4` on 2 cores: each rank's rates are half a core's, as 4 ranks of
    1 thread time-share 2 cores, not a whole core's (what one process alone measured at 1 thread)."""
    monkeypatch.setattr(calibrate.os, "cpu_count", lambda: 2)
    asked = []
    monkeypatch.setattr(calibrate, "measure_cpu_rates", lambda **kw: asked.append(kw["threads"]) or calibrate.CpuRates(
        matmul=8e10, attention={"64": 1e10}, memory=2e10, loss=6e-9, fast=True))
    monkeypatch.setattr(calibrate, "bus_bandwidth", lambda nproc: ({"all_reduce": {"1024": 1e9}}, 1e-5))
    import torch

    shared = calibrate.cpu_profile(nproc=4, model=None, tokens=256, dtype=torch.float32)
    alone = calibrate.cpu_profile(nproc=2, model=None, tokens=256, dtype=torch.float32)
    assert shared.measured.threads == alone.measured.threads == 1 and asked == [1, 1]
    assert alone.measured.matmul_flops_per_s == 8e10 and alone.measured.cores in (None, 1.0)
    assert shared.measured.cores == 0.5 and shared.measured.matmul_flops_per_s == 4e10
    assert shared.peak_flops_per_s.fp32 == 4e10 and shared.measured.attention_flops_per_s == {"64": 5e9}
    assert math.isclose(shared.measured.loss_seconds_per_logit, 12e-9)
    assert "0.5 of one each" in shared.description and "share" not in alone.description
    assert dataclasses.replace(shared.measured, cores=None, matmul_flops_per_s=8e10, attention_flops_per_s={"64": 1e10},
                               loss_seconds_per_logit=6e-9) == dataclasses.replace(alone.measured, num_ranks=4)
