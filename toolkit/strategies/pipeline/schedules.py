"""The pipeline schedules: which torch.distributed.pipelining class runs each, which stages a rank holds under it,
the order in which a rank runs its forwards and backwards, and the idle bubble that order leaves in theory.

The theory is a simulation, not a closed form: each rank runs its schedule's own actions in order (torch's, asked
of the class), an action starting once the rank is free and the action it depends on has finished (a forward on
the previous stage's forward, a backward on the next stage's backward, a weight gradient on its input gradient).
A forward, an input gradient and a weight gradient each take one unit, a full backward two (input and weight),
sends take none. For GPipe and 1F1B that gives exactly (p-1)/(m+p-1), the formula the schedules are known by; the
zero-bubble schedules fill the bubble with weight gradients, which only this order shows. Scaled by each stage's
FLOPs (split.stage_flops), the same simulation predicts the idle a given split leaves: a stage that costs more than
the others makes every other rank wait for it, which no schedule removes."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, NamedTuple

# schedule name -> torch.distributed.pipelining class, imported at setup (the import costs ~1.3 s, which
# every process that only reads the strategy's INFO would pay)
SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved-1f1b": "ScheduleInterleaved1F1B",
             "interleaved-zb": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble",
             "dualpipev": "ScheduleDualPipeV"}
# the V-shaped schedules: rank r holds stage r and stage 2p-1-r (the first and the last stage on rank 0), exactly two
V_SHAPED = ("zbv", "dualpipev")
# several stages per rank, looped: rank r holds stages r, r+p, r+2p, ...
LOOPED = ("interleaved-1f1b", "interleaved-zb")
# backward split into the input gradient (on the critical path) and the weight gradient (fills the bubble)
SPLIT_BACKWARD = ("interleaved-zb", "zbv", "dualpipev")

UNIT = {"F": 1, "I": 1, "W": 1, "B": 2}  # a full backward computes both gradients


class Act(NamedTuple):
    kind: str  # F forward, B full backward, I input gradient, W weight gradient
    stage: int
    micro_batch: int


def stage_ids(schedule: str, *, pp_rank: int, pp: int, stages_per_rank: int) -> list[int]:
    """The stages pipeline rank `pp_rank` runs: its own and, looped, every pp-th after it; V-shaped, its own and
    its mirror 2p-1-r."""
    if schedule in V_SHAPED:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(stages_per_rank)]


def stages_per_rank_error(schedule: str, stages_per_rank: int) -> str | None:
    """Why a schedule cannot run this many stages per rank (the fix in words), or None."""
    if schedule in V_SHAPED and stages_per_rank != 2:
        return f"strategy.schedule {schedule} runs exactly 2 stages per rank (V-shaped): set strategy.stages_per_rank: 2"
    if schedule == "interleaved-1f1b" and stages_per_rank < 2:
        return "strategy.schedule interleaved-1f1b needs strategy.stages_per_rank of 2 or more"
    if schedule in ("gpipe", "1f1b") and stages_per_rank != 1:
        return (f"strategy.stages_per_rank {stages_per_rank} needs a schedule with several stages per rank: "
                f"{', '.join((*LOOPED, *V_SHAPED))}")
    return None


def micro_batches_error(schedule: str, *, pp: int, micro_batches: int) -> str | None:
    """Why a schedule cannot run `micro_batches` per step over `pp` ranks (torch refuses it at construction,
    on every rank), or None."""
    m = micro_batches
    if schedule == "1f1b" and m < pp:
        return f"schedule 1f1b needs at least as many micro-batches per step as stages ({pp})"
    if schedule == "dualpipev" and m < 2 * pp:
        return f"schedule dualpipev needs at least as many micro-batches per step as stages ({2 * pp})"
    rounds = max(1, m // pp)
    if schedule in LOOPED and m % rounds:
        return (f"schedule {schedule} runs micro-batches in rounds of the {pp} pipeline ranks, so their number "
                f"must be a multiple of {rounds} (or at most {pp})")
    return None


def actions(schedule: str, *, rank: int, pp: int, stages_per_rank: int, micro_batches: int) -> list[Act]:
    """This rank's forwards and backwards in the order its schedule runs them."""
    m = micro_batches
    if schedule == "gpipe":
        return [Act("F", rank, i) for i in range(m)] + [Act("B", rank, i) for i in range(m)]
    if schedule == "1f1b":
        warmup = min(m, pp - rank)
        steady = [a for i in range(m - warmup) for a in (Act("B", rank, i), Act("F", rank, warmup + i))]
        return [Act("F", rank, i) for i in range(warmup)] + steady + \
            [Act("B", rank, i) for i in range(m - warmup, m)]
    return _torch_order(schedule, rank=rank, pp=pp, stages_per_rank=stages_per_rank, micro_batches=m)


def _torch_order(schedule: str, *, rank: int, pp: int, stages_per_rank: int, micro_batches: int) -> list[Act]:
    """torch's own order for the rank: each multi-stage schedule computes it from these numbers alone (its
    constructor also needs live stages, so the order is asked of the class directly)."""
    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    plan: Any = object.__new__(getattr(schedules, SCHEDULES[schedule]))
    local = 2 if schedule in V_SHAPED else stages_per_rank
    plan.pp_group_size, plan.n_local_stages, plan._n_microbatches = pp, local, micro_batches
    plan.num_stages = plan._num_stages = pp * local
    plan.number_of_rounds = max(1, micro_batches // pp)
    plan.microbatches_per_round = micro_batches // plan.number_of_rounds
    plan.stage_index_to_group_rank = generate_stage_to_rank_mapping(pp, pp * local,
                                                                    style="v" if schedule in V_SHAPED else "loop")
    out: list[Act] = []
    for action in plan._calculate_single_rank_operations(rank):
        if action is None:
            continue
        for part in action.sub_actions or (action,):  # DualPipeV overlaps a forward with a backward
            kind = part.computation_type.value
            if kind in UNIT:
                out.append(Act(kind, part.stage_index, part.microbatch_index))
    return out


def simulated_bubbles(schedule: str, *, pp: int, stages_per_rank: int, micro_batches: int,
                      stage_costs: list[float] | None = None) -> list[float]:
    """Each pipeline rank's idle fraction of the step in theory (the module's docstring says how). `stage_costs`:
    each stage's relative cost (its FLOPs: split.stage_flops), which scales its actions' units; without them the
    stages are equal, the schedule's own bubble."""
    orders = [actions(schedule, rank=r, pp=pp, stages_per_rank=stages_per_rank, micro_batches=micro_batches)
              for r in range(pp)]
    num_stages = pp * (2 if schedule in V_SHAPED else stages_per_rank)
    scale = stage_costs or [1.0] * num_stages

    def cost(act: Act) -> float:
        return UNIT[act.kind] * scale[act.stage]

    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * pp
    position = [0] * pp
    remaining = sum(len(o) for o in orders)
    while remaining:
        moved = False
        for r in range(pp):
            while position[r] < len(orders[r]):
                act = orders[r][position[r]]
                ready = _ready(act, done, last_stage=num_stages - 1)
                if ready is None:
                    break
                start = max(free[r], ready)
                free[r] = start + cost(act)
                key = "B" if act.kind in ("B", "I") else act.kind  # what a neighbour's backward waits on
                done[(key, act.stage, act.micro_batch)] = free[r]
                if act.kind == "B":
                    done[("W", act.stage, act.micro_batch)] = free[r]
                position[r] += 1
                remaining -= 1
                moved = True
        if not moved:
            raise RuntimeError(f"schedule {schedule}: its order deadlocks in the simulation at ranks' positions "
                               f"{position}")
    span = max(free)
    return [1.0 - sum(cost(a) for a in order) / span for order in orders]


def _ready(act: Act, done: dict[tuple[str, int, int], float], *, last_stage: int) -> float | None:
    """When the action `act` depends on finished, or None while it has not."""
    if act.kind == "F":
        needed = [("F", act.stage - 1, act.micro_batch)] if act.stage > 0 else []
    elif act.kind in ("B", "I"):
        needed = [("F", act.stage, act.micro_batch)]
        if act.stage < last_stage:
            needed.append(("B", act.stage + 1, act.micro_batch))
    else:
        needed = [("B", act.stage, act.micro_batch)]
    times = [done.get(n) for n in needed]
    if any(t is None for t in times):
        return None
    return max([0.0, *(t for t in times if t is not None)])


def theoretical_bubble(schedule: str, *, pp: int, stages_per_rank: int, micro_batches: int) -> float:
    """The mean idle fraction over the pipeline's ranks, in theory."""
    bubbles = simulated_bubbles(schedule, pp=pp, stages_per_rank=stages_per_rank, micro_batches=micro_batches)
    return sum(bubbles) / len(bubbles)


# what a forward-only run keeps of a schedule's actions: the forwards, their sends and receives, FSDP's gathers
FORWARD_ONLY = ("F", "SEND_F", "RECV_F", "UNSHARD", "RESHARD")


@contextlib.contextmanager
def forward_only(schedule: Any) -> Iterator[None]:
    """`schedule.eval(...)` runs only its forwards (and their sends and receives) inside: torch 2.13's eval of a
    schedule of several stages per rank runs its whole training order, backwards included with no backward to
    run, and the V-shaped ones (zbv, dualpipev) then fail where a rank hands an input gradient to its other stage
    ("can't steal_bwd_input if this stage doesn't have backward": measured, every evaluation). The forwards keep
    their order, so the ranks' sends and receives still pair up. Schedules of one stage per rank run as they are."""
    order = getattr(schedule, "pipeline_order_with_comms", None)
    if not order:
        yield
        return
    kept = {rank: [part for action in actions if action is not None
                   for part in (action.sub_actions or (action,))  # DualPipeV overlaps a forward with a backward
                   if part.computation_type.value in FORWARD_ONLY]
            for rank, actions in order.items()}
    schedule.pipeline_order_with_comms = kept
    try:
        yield
    finally:
        schedule.pipeline_order_with_comms = order
