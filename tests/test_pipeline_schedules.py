"""The pipeline schedules' theory: the simulated bubble of each schedule's own order against the closed forms
GPipe, 1F1B and interleaved 1F1B are known by, the zero-bubble schedules below them, and which stages a rank holds."""

import pytest

from toolkit.strategies.pipeline.schedules import actions, simulated_bubbles, stage_ids


@pytest.mark.parametrize("pp, m", [(2, 2), (2, 4), (2, 8), (3, 6), (4, 8), (4, 16)])
def test_simulated_bubble_equals_the_closed_forms(pp, m):
    for schedule, v in (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2)):
        expected = (pp - 1) / (v * m + pp - 1)
        assert simulated_bubbles(schedule, pp=pp, stages_per_rank=v, micro_batches=m) == \
            pytest.approx([expected] * pp), schedule


@pytest.mark.parametrize("pp, m", [(2, 4), (2, 8), (4, 8), (4, 16)])
def test_zero_bubble_schedules_leave_less_idle_than_1f1b(pp, m):
    one_f_one_b = simulated_bubbles("1f1b", pp=pp, stages_per_rank=1, micro_batches=m)[0]
    interleaved = simulated_bubbles("interleaved-1f1b", pp=pp, stages_per_rank=2, micro_batches=m)[0]
    assert max(simulated_bubbles("interleaved-zb", pp=pp, stages_per_rank=1, micro_batches=m)) < one_f_one_b
    for schedule in ("interleaved-zb", "zbv", "dualpipev"):
        assert max(simulated_bubbles(schedule, pp=pp, stages_per_rank=2, micro_batches=m)) < interleaved, schedule


@pytest.mark.parametrize("schedule", ["interleaved-zb", "zbv", "dualpipev"])
def test_every_micro_batch_runs_forward_and_both_gradients_once_per_stage(schedule):
    """Each (stage, micro-batch) of the rank's own stages: one forward, and either a full backward or an input
    and a weight gradient (DualPipeV mixes the two)."""
    pp, m = 2, 4
    for rank in range(pp):
        order = actions(schedule, rank=rank, pp=pp, stages_per_rank=2, micro_batches=m)
        every = sorted((s, i) for s in stage_ids(schedule, pp_rank=rank, pp=pp, stages_per_rank=2) for i in range(m))
        of = {kind: sorted((a.stage, a.micro_batch) for a in order if a.kind == kind) for kind in "FBIW"}
        assert of["F"] == every and of["I"] == of["W"] and sorted(of["B"] + of["I"]) == every, rank


def test_v_shaped_schedules_hold_the_first_and_the_last_stage_on_rank_0():
    assert [stage_ids("zbv", pp_rank=r, pp=4, stages_per_rank=2) for r in range(4)] == \
        [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [stage_ids("interleaved-zb", pp_rank=r, pp=2, stages_per_rank=2) for r in range(2)] == [[0, 2], [1, 3]]


def test_stage_costs_lengthen_each_stages_actions():
    """GPipe over 2 stages, the second twice the first's cost, 8 micro-batches: rank 1 starts after one forward of
    rank 0 (1), runs 8 forwards (2 each) and 8 backwards (4 each), done at 49; rank 0's last backward waits for it
    and ends at 51. Busy: rank 0 8 × 3 = 24, rank 1 8 × 6 = 48."""
    assert simulated_bubbles("gpipe", pp=2, stages_per_rank=1, micro_batches=8, stage_costs=[1.0, 2.0]) == \
        pytest.approx([1 - 24 / 51, 1 - 48 / 51])
    for schedule, v in (("1f1b", 1), ("zbv", 2)):  # equal costs: the schedule's own bubble
        assert simulated_bubbles(schedule, pp=2, stages_per_rank=v, micro_batches=8, stage_costs=[3.0] * 2 * v) == \
            pytest.approx(simulated_bubbles(schedule, pp=2, stages_per_rank=v, micro_batches=8))
