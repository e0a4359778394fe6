"""Collectives of one optimizer step, as a layout's rules predict them, and the time each takes on a link.

A strategy's rules (StrategyRules.predict_collectives) list what a rank hands to each collective in one step, in
the collective counter's terms (toolkit/observe/comm.py: the op's name as the c10d dispatcher sees it, and its
*input* bytes on this rank), so that a run can hold the prediction beside the count: they must be equal, byte for
byte. The time model reads the same list: each entry's bytes, the group it runs over and when in the step it runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

# the counter's op names -> what the op does (the cost model's kinds)
KINDS = {
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce", "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "_allgather_base_": "all_gather", "allgather_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
    "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "alltoall_base_": "all_to_all", "alltoall_": "all_to_all", "all_to_all_single": "all_to_all",
    "broadcast_": "broadcast", "broadcast": "broadcast", "send": "send",
}
# when a collective runs
PHASES = ("forward", "backward", "step", "loop")
# what compute it can run beside (toolkit/cost/step_time.py, where each rule is written once):
#   compute   a sharded layout's parameter gathers and gradient reductions, prefetched one unit ahead through
#             forward and backward (FSDP2's implicit prefetch, ZeRO-3's prefetch bucket)
#   backward  gradient buckets reduced while backward goes on (DDP's reducer, ZeRO-1/2's overlap_comm)
#   attention a ring's passes of keys and values (and their gradients) to the next rank, sent while the rank
#             attends to the block it holds (torch's _templated_ring_attention starts the next exchange before it
#             computes the current block and waits for it after)
#   nothing   on the critical path: activations a next layer waits for (tp, cp, a pipeline's sends), and what
#             runs after backward (the optimizer's partition gathers, the loop's counts, the clip's norm)
OVERLAPS = ("compute", "backward", "attention", "nothing")


@dataclass(frozen=True, kw_only=True)
class Collective:
    """One kind of collective a rank calls in a step: `calls` calls handing it `payload_bytes` in all."""
    op: str  # the counter's name for it (KINDS)
    payload_bytes: int  # input bytes on this rank, over all its calls in the step
    calls: int
    group: str  # the mesh dimension it runs over (dp_shard, dp_replicate, tp, cp, pp, ep, world)
    group_size: int
    phase: str  # PHASES: forward / backward (beside compute), step (after backward), loop (the loop's own)
    what: str = ""  # what moves: "gradients", "parameters", "activations", ...
    overlap: str = "nothing"  # OVERLAPS
    # runs at one optimizer step in `every` (local SGD's sync): the counter counts it at such a step, and the time
    # model charges each step 1/every of it, the mean over a window
    every: int = 1
    # what the rank computes to encode and decode what it sends, on the critical path (PowerSGD's matrix products
    # and error feedback, which its DDP hook runs between backward's buckets): FLOPs, and bytes read and written
    codec_flops: float = 0.0
    codec_bytes: int = 0
    # the framework's host time around its calls in a step (ZeRO-3's hooks fetch, release and partition in Python,
    # a tensor at a time), on the critical path where the host also computes (toolkit/cost/step_time.py)
    host_s: float = 0.0

    def __post_init__(self) -> None:
        assert self.op in KINDS and self.phase in PHASES and self.overlap in OVERLAPS, (self.op, self.phase)
        assert self.every >= 1, self.every

    @property
    def kind(self) -> str:
        return KINDS[self.op]


def loop_collectives(*, world_size: int) -> list[Collective]:
    """The loop's own, every step (toolkit/train/loop.py run_microbatches): the global batch's counts (3 float64:
    items, tokens, samples) and the step's loss sum (float64), each summed over every rank. None in one process."""
    if world_size == 1:
        return []
    return [Collective(op="allreduce_", payload_bytes=3 * 8 + 8, calls=2, group="world", group_size=world_size,
                       phase="loop", what="the batch's counts and loss")]


def bytes_by_op(collectives: list[Collective]) -> dict[str, int]:
    """Payload bytes per op name: what the counter's `bytes_by_op` holds for the same step."""
    return _by_op(collectives, lambda c: c.payload_bytes)


def calls_by_op(collectives: list[Collective]) -> dict[str, int]:
    """Calls per op name: what the counter's `calls_by_op` holds for the same step (a call of no bytes too:
    PowerSGD all-reduces its empty factors where it compresses no matrix)."""
    return _by_op(collectives, lambda c: c.calls)


def _by_op(collectives: list[Collective], value: Callable[[Collective], int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in collectives:
        if value(c):
            out[c.op] = out.get(c.op, 0) + value(c)
    return dict(sorted(out.items()))


def wire_time_s(collective: Collective, *, bandwidth_bytes_per_s: float, latency_s: float) -> float:
    """Time of the collective's calls on a link of this bandwidth (one direction, per rank) and latency, by the
    ring algorithm's cost (NCCL's ring; Thakur et al., "Optimization of Collective Communication Operations in
    MPICH", 2005): for n ranks and a payload of S bytes on each, an all-reduce moves 2(n-1)/n·S through each
    rank's link in 2(n-1) steps, a reduce-scatter (n-1)/n·S in n-1 steps, an all-gather of an S-byte shard
    (n-1)·S in n-1 steps, an all-to-all (n-1)/n·S, a send S in one."""
    n, size = collective.group_size, collective.payload_bytes
    if n <= 1 and collective.kind != "send":
        return 0.0
    moved, steps = {
        "all_reduce": (2 * (n - 1) / n * size, 2 * (n - 1)),
        "reduce_scatter": ((n - 1) / n * size, n - 1),
        "all_gather": ((n - 1) * size, n - 1),
        "all_to_all": ((n - 1) / n * size, n - 1),
        "broadcast": (size, 1),
        "send": (size, 1),
    }[collective.kind]
    return moved / bandwidth_bytes_per_s + steps * collective.calls * latency_s
