"""Communication volume of one optimizer step, counted where every collective passes: the c10d dispatcher.

DDP's reducer, FSDP2's all-gather/reduce-scatter, DTensor's functional collectives and DeepSpeed's
`deepspeed.comm` (over torch.distributed) all call `torch.ops.c10d.*` / `torch.ops._c10d_functional.*`,
so one TorchDispatchMode sees them without knowing the strategy. What it counts is each call's *input*
payload on this rank (an all-gather's local shard, a reduce-scatter's full input, an all-reduce's
buffer): bytes handed to the collective, not bytes on the wire, which depend on the algorithm (ring,
tree) the backend picks. The mode costs Python time per op, so the loop turns it on for one step and
that step is left out of throughput medians.
"""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

# the step whose collectives are counted (count_step): past DDP's bucket rebuild and ZeRO-3's
# first-step parameter fetches, so it shows a steady step; it is left out of throughput medians
COMM_COUNT_STEP = 3


def count_step(*, done: int, total_steps: int, profiled: tuple[int, int] | None,
               steady_from: int = COMM_COUNT_STEP) -> int | None:
    """The step whose collectives are counted: COMM_COUNT_STEP, or `steady_from` where later (the first step a
    communication lever is steady: PowerSGD's first compressed one), or the nearest the run has, moved out of the
    train.profile_steps window, whose profile would otherwise show the counting dispatch mode on top of ops.txt
    and every op twice: the first step after the window, else the last before it; None where the window covers
    every step the run has left (nothing is counted then)."""
    first, last = profiled if profiled is not None else (0, -1)
    wanted = min(max(COMM_COUNT_STEP, steady_from, done + 1), total_steps)
    if not first <= wanted <= last:
        return wanted
    after, before = last + 1, first - 1
    return after if after <= total_steps else before if before > done else None


# op name (without overload) -> which argument holds the tensors this rank sends
_C10D_INPUT_ARG = {
    "allreduce_": 0, "allreduce_coalesced_": 0, "broadcast_": 0, "reduce_": 0, "send": 0,
    "allgather_": 1, "_allgather_base_": 1, "allgather_coalesced_": 1, "allgather_into_tensor_coalesced_": 1,
    "reduce_scatter_": 1, "_reduce_scatter_base_": 1, "reduce_scatter_tensor_coalesced_": 1,
    "alltoall_": 1, "alltoall_base_": 1, "gather_": 1, "scatter_": 1,
}
_FUNCTIONAL = {"all_reduce", "all_reduce_coalesced", "all_gather_into_tensor", "all_gather_into_tensor_coalesced",
               "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced", "all_to_all_single", "broadcast"}


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def _payload_bytes(tensors: list[torch.Tensor]) -> int:
    # DTensors are let through to DTensor's own dispatch (__torch_dispatch__), whose collectives then reach the mode
    # as plain tensors; a DTensor handed to torch.distributed directly (_all_reduce_elsewhere) sends its local shard
    return sum(getattr(t, "_local_tensor", t).numel() * t.element_size() for t in tensors)


class CollectiveCounter(TorchDispatchMode):
    """Counts calls and input bytes per collective op while active. Passes every op through unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes_by_op: dict[str, int] = {}
        self.calls_by_op: dict[str, int] = {}
        self._lock = threading.Lock()  # _count may run on the backend's threads too
        self._entered = 0  # how deep the counter is entered (it may be entered again)
        self._plain_all_reduce = None

    def __enter__(self):
        # a DDP communication hook's chained callbacks (PowerSGD's P and Q all-reduces) run on the backend's thread,
        # where this mode, thread-local, is not active: torch.distributed.all_reduce called from such a thread is
        # counted by a wrapper, set while the counter is (a call where this mode is active reaches the mode instead)
        if not self._entered:
            self._plain_all_reduce = dist.all_reduce
            dist.all_reduce = self._all_reduce_elsewhere  # type: ignore[assignment]
        self._entered += 1
        return super().__enter__()

    def __exit__(self, *exc):
        self._entered -= 1
        if not self._entered:
            dist.all_reduce = self._plain_all_reduce  # type: ignore[assignment]
        return super().__exit__(*exc)

    def _all_reduce_elsewhere(self, tensor, *args, **kwargs):
        # by the mode, not the thread: a CUDA backward runs the hook on the autograd engine's thread, which carries
        # the caller's dispatch modes (this one counts it there), as NCCL's callbacks, run inline, do
        if self not in _get_current_dispatch_mode_stack():
            self._count("allreduce_", [tensor])
        return self._plain_all_reduce(tensor, *args, **kwargs)  # type: ignore[misc]

    def _count(self, name: str, tensors: list[torch.Tensor]) -> None:
        with self._lock:
            self.bytes_by_op[name] = self.bytes_by_op.get(name, 0) + _payload_bytes(tensors)
            self.calls_by_op[name] = self.calls_by_op.get(name, 0) + 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            # an op on DTensors: modes see it before the subclass does. NotImplemented lets DTensor run it with
            # this mode still active, so the collectives it issues inside the op (loss_parallel's all-reduces in
            # cross_entropy, a redistribution its sharding rules ask for) reach the mode as plain ops and are
            # counted, as torch's CommDebugMode does; the op itself moves nothing
            return NotImplemented
        namespace, name = func.namespace, func.__name__.split(".")[0]
        index = None
        if namespace == "c10d":
            index = _C10D_INPUT_ARG.get(name)
        elif namespace == "_c10d_functional" and name in _FUNCTIONAL:
            index = 0
        if index is not None and len(args) > index:
            self._count(name, _tensors(args[index]))
        return func(*args, **(kwargs or {}))

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_op.values())

    def summary(self) -> dict:
        return {"total_bytes": self.total_bytes, "bytes_by_op": dict(sorted(self.bytes_by_op.items())),
                "calls_by_op": dict(sorted(self.calls_by_op.items()))}


def counting(counter: CollectiveCounter | None):
    """The counter as a context (it may be entered again to count more of the same step), or nothing."""
    return counter if counter is not None else contextlib.nullcontext()
