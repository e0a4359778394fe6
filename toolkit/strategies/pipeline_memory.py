"""A pipeline rank's activation memory, before a run (`toolkit plan`, run.json's prediction).

A stage keeps what one micro-batch's forward leaves for backward (its saved activations and its output)
for every micro-batch it has in flight; how many that is comes from the schedule:
  gpipe             every micro-batch of the step: all forwards run before the first backward
  1f1b              stage s of S: min(M, S - s) (torch's Schedule1F1B warms up with that many forwards, then
                    alternates one backward, one forward)
  interleaved-1f1b  the order torch's ScheduleInterleaved1F1B computes for the rank, over its virtual stages
On top, torch's PipelineStage allocates receive buffers for every micro-batch of the step at its first step
and keeps them: the activations a stage receives (all but the first stage) and the gradients of its
output (all but the last), micro × max_length × hidden each.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from typing import Any

from toolkit.activations import Traced

Action = tuple[str, int]  # ("F" forward | "B" backward, stage index)


def schedule_actions(schedule: str, *, rank: int, pp: int, stages_per_rank: int, micro_batches: int) -> list[Action]:
    """This rank's forwards and backwards, in the order its schedule runs them (one micro-batch each)."""
    m = micro_batches
    if schedule == "gpipe":
        return [("F", rank)] * m + [("B", rank)] * m
    if schedule == "1f1b":
        warmup = min(m, pp - rank)
        steady = [action for _ in range(m - warmup) for action in (("B", rank), ("F", rank))]
        return [("F", rank)] * warmup + steady + [("B", rank)] * warmup
    return _interleaved(rank=rank, pp=pp, stages_per_rank=stages_per_rank, micro_batches=m)


def _interleaved(*, rank: int, pp: int, stages_per_rank: int, micro_batches: int) -> list[Action]:
    """torch's own order for the rank (ScheduleInterleaved1F1B computes it from these four numbers; its
    constructor also needs live stages, so the order is asked of the class directly). A torch without that
    method: every forward of every local stage before any backward, the most a rank could hold."""
    from torch.distributed.pipelining import schedules

    try:
        plan: Any = object.__new__(schedules.ScheduleInterleaved1F1B)
        plan.pp_group_size, plan.n_local_stages, plan._n_microbatches = pp, stages_per_rank, micro_batches
        plan.number_of_rounds = max(1, micro_batches // pp)
        plan.microbatches_per_round = micro_batches // plan.number_of_rounds
        actions = []
        for action in plan._calculate_single_rank_operations(rank):
            kind = getattr(getattr(action, "computation_type", None), "name", "")
            if kind == "FORWARD":
                actions.append(("F", action.stage_index))
            elif kind in ("FULL_BACKWARD", "BACKWARD_INPUT"):
                actions.append(("B", action.stage_index))
        if actions:
            return actions
    except (AttributeError, TypeError, ValueError):
        pass
    print("[toolkit] plan: this torch does not give ScheduleInterleaved1F1B's order; the rank is planned with every "
          "micro-batch in flight (an upper bound)", file=sys.stderr, flush=True)
    from toolkit.strategies.pipeline import Grid

    local = Grid(pp=pp, dp=1).stage_ids(rank, stages_per_rank)
    return [("F", s) for s in local] * micro_batches + [("B", s) for s in reversed(local)] * micro_batches


def in_flight_peak(actions: list[Action], traces: dict[int, Traced]) -> int:
    """The most bytes the rank's stages hold at once running `actions`: at a backward, every micro-batch in
    flight holds its forward's bytes, and the one going backward has reached its own peak."""
    in_flight: dict[int, int] = defaultdict(int)
    peak = 0
    for kind, stage in actions:
        held = sum(count * traces[s].held for s, count in in_flight.items())
        if kind == "F":
            in_flight[stage] += 1
            peak = max(peak, held + traces[stage].held)
        else:
            peak = max(peak, held - traces[stage].held + traces[stage].peak)
            in_flight[stage] -= 1
    return peak

