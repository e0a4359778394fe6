"""Gradient compression for DDP (strategy.gradient_compression): torch's own communication hooks, registered on the
DDP module. fp16 / bf16 cast each bucket for its all-reduce (default_hooks); powersgd sends each gradient matrix as a
rank-r factor pair (powerSGD_hook, error feedback and warm start on, as torch's defaults).

PowerSGD keeps state across steps, per DDP bucket: each rank's error (what compression left out, added back next
step) and the Q factors (warm start). DDP numbers its buckets anew when it rebuilds them (after its first step, in
every process: a resumed run's first step has other buckets than the uninterrupted run had at that step), so the hook
here is torch's, wrapped: where a bucket's parameters are not the ones its state was made for, the state is cut per
parameter and put together again for the new buckets. PowerSGD compresses each tensor on its own, so that is the same
maths; the checkpoint holds the state per parameter (each rank its own error: CommState).
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

from toolkit.cost.collectives import Collective
from toolkit.checkpoint.verify import load_blob
from toolkit.errors import RecipeError

COMPRESSIONS = ("none", "fp16", "bf16", "powersgd")
REDUCE_DTYPES = ("fp32", "bf16")  # strategy.reduce_dtype (fsdp, zero)
WIRE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
MIN_START_STEP = 2  # torch's: with error feedback, PowerSGD may start only once DDP has fixed its buckets
MIN_COMPRESSION_RATE = 2  # torch's default: a matrix is compressed only where that sends under half its numbers


def check_reduce_dtype(value: str | None) -> None:
    if value is not None and value not in REDUCE_DTYPES:
        raise RecipeError(f"strategy.reduce_dtype must be one of {', '.join(REDUCE_DTYPES)}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class Compression:
    """What strategy.gradient_compression asks of DDP's gradient all-reduce."""

    kind: str = "none"
    rank: int = 4  # powersgd: the factors' rank
    start_step: int = 10  # powersgd: optimizer steps reduced whole before compression starts

    def check(self, *, precision: str) -> None:
        if self.kind not in COMPRESSIONS:
            raise RecipeError(f"strategy.gradient_compression must be one of {', '.join(COMPRESSIONS)}, got "
                              f"{self.kind!r}")
        if self.kind != "powersgd":
            return
        if precision == "fp16":  # the error it keeps would hold scaled gradients, and an overflow's NaN for good
            raise RecipeError("strategy.gradient_compression=powersgd is not available with precision fp16: its "
                              "error feedback would carry the loss scaler's scaled (and overflowed) gradients from "
                              "step to step; use precision bf16 or fp32")
        if self.rank <= 0:
            raise RecipeError(f"strategy.powersgd_rank must be >= 1 (the rank of each gradient matrix's factors), "
                              f"got {self.rank}")
        if self.start_step < MIN_START_STEP:
            raise RecipeError(f"strategy.powersgd_start_step must be >= {MIN_START_STEP} (DDP fixes its buckets "
                              f"after its first step, and PowerSGD's error feedback needs them fixed), got "
                              f"{self.start_step}")

    @property
    def on(self) -> bool:
        return self.kind != "none"

    def describe(self) -> str:
        """The lever in words (the precision audit, the verdict)."""
        if self.kind == "powersgd":
            return f"powersgd r={self.rank} from step {self.start_step + 1}"
        return f"sent as {self.kind}"


def first_steady_step(recipe) -> int:
    """The first step whose gradient all-reduce is what every later step sends: PowerSGD's first compressed step, local
    SGD's first sync (the step the collectives are counted in, where later than the usual one); 1 otherwise."""
    strategy = recipe.strategy
    if strategy.sync_every > 1:  # local SGD: its first sync from step 3 on (the steps between send nothing)
        return strategy.sync_every * -(-3 // strategy.sync_every)
    return strategy.powersgd_start_step + 1 if strategy.gradient_compression == "powersgd" else 1


def register(ddp: nn.Module, compression: Compression, *, names: dict[int, str]) -> "PowerSgd | None":
    """The compression's hook on `ddp` (a DistributedDataParallel module); `names`: id(parameter) -> its name.
    Returns the state the hook keeps across steps (PowerSGD's), for the checkpoint; None for the others."""
    if not compression.on:
        return None
    group = ddp.process_group  # type: ignore[attr-defined]
    if compression.kind == "fp16":
        ddp.register_comm_hook(group, default_hooks.fp16_compress_hook)  # type: ignore[operator]
        return None
    if compression.kind == "bf16":
        on_nccl = next(ddp.parameters()).device.type == "cuda"
        hook = default_hooks.bf16_compress_hook if on_nccl else bf16_hook
        ddp.register_comm_hook(group, hook)  # type: ignore[operator]
        return None
    # orthogonalization_epsilon: torch's default 0 divides a zero gradient matrix's factor by its zero norm (NaN,
    # then every gradient through clipping); 1e-8, as torch's docs suggest, against norms of order 1 and more
    state = PowerSGDState(process_group=group, matrix_approximation_rank=compression.rank,
                          start_powerSGD_iter=compression.start_step, min_compression_rate=MIN_COMPRESSION_RATE,
                          use_error_feedback=True, warm_start=True, orthogonalization_epsilon=1e-8)
    wrapped = PowerSgd(state, names=names, shapes={names[id(p)]: tuple(p.shape) for p in ddp.parameters()})
    ddp.register_comm_hook(state, wrapped.hook)  # type: ignore[operator]
    return wrapped


def warn_if_never(compression: Compression, *, total_steps: int, is_main: bool) -> None:
    """A PowerSGD start at or past the run's last step compresses nothing: said once, on stderr."""
    if compression.kind == "powersgd" and total_steps <= compression.start_step and is_main:
        import sys

        print(f"[toolkit] warning: strategy.powersgd_start_step {compression.start_step} ≥ the run's {total_steps} "
              "steps: every step is reduced whole, nothing is compressed", file=sys.stderr, flush=True)


class HookStates:
    """The PowerSGD states of several DDP modules on one rank (a pipeline rank's stages, one DDP module each),
    checkpointed as one blob: each rank its own (CommState)."""

    def __init__(self, hooks: list[PowerSgd]) -> None:
        self.hooks = hooks

    def state_bytes(self) -> bytes:
        buffer = io.BytesIO()
        torch.save([hook.state_bytes() for hook in self.hooks], buffer)
        return buffer.getvalue()

    def load_bytes(self, blob: bytes) -> None:
        blobs: list[bytes] = load_blob(blob)  # written by state_bytes
        if len(blobs) != len(self.hooks):
            raise RuntimeError(f"the checkpoint holds the PowerSGD state of {len(blobs)} stages, this rank runs "
                               f"{len(self.hooks)}")
        for hook, one in zip(self.hooks, blobs):
            hook.load_bytes(one)

    def state_tensors(self) -> list[torch.Tensor]:
        return [t for hook in self.hooks for t in hook.state_tensors()]


def bf16_hook(process_group, bucket):
    """torch's bf16_compress_hook under another name: DDP refuses that one by its name unless CUDA and NCCL ≥ 2.10
    are present (NCCL's bf16 support), also on gloo, which all-reduces bf16 (checked: 2 ranks, CPU)."""
    return default_hooks._compress_hook(torch.bfloat16, process_group, bucket)


def compressed(shape: tuple[int, ...], rank: int) -> tuple[int, int] | None:
    """(n, m) of a gradient PowerSGD compresses, as its hook decides: the tensor as a matrix of its first
    dimension's n rows, compressed where (n + m)·r·MIN_COMPRESSION_RATE < n·m (r = min(n, m, rank)); None for one
    sent whole."""
    n = shape[0] if shape else 1
    m = math.prod(shape[1:]) if len(shape) > 1 else 1
    r = min(n, m, rank)
    return (n, m) if (n + m) * r * MIN_COMPRESSION_RATE < n * m else None


def powersgd_numbers(shapes: list[tuple[int, ...]], rank: int) -> tuple[int, int, int]:
    """Per step: (numbers sent whole, numbers of the P factors, of the Q factors) over gradients of `shapes`."""
    whole = p = q = 0
    for shape in shapes:
        matrix = compressed(shape, rank)
        if matrix is None:
            whole += math.prod(shape)
        else:
            n, m = matrix
            r = min(n, m, rank)
            p, q = p + n * r, q + m * r
    return whole, p, q


def powersgd_state_bytes(parameters: Iterable[nn.Parameter], compression: Compression, *, dtype: torch.dtype,
                         steps: int | None) -> int:
    """What PowerSGD keeps on each rank from its first compressed step on (torch's powerSGD_hook) for the trainable
    `parameters` of one DDP module, whose gradients are `dtype`: the error feedback, one number per gradient number
    (each bucket whole, also what it sends whole), and the P and Q factors of the matrices it compresses (kept per
    bucket: Q for the next step's warm start, P beside it). 0 for the 16-bit casts, which keep nothing, and for a
    run of `steps` (train.max_steps) that ends before it compresses."""
    if compression.kind != "powersgd" or (steps is not None and steps <= compression.start_step):
        return 0
    shapes = [tuple(p.shape) for p in parameters if p.requires_grad]
    _, p, q = powersgd_numbers(shapes, compression.rank)
    return (sum(math.prod(s) for s in shapes) + p + q) * dtype.itemsize


# numbers read or written per gradient number of a bucket by powerSGD_hook's error feedback, whatever is compressed:
# the error added (read both, write), the copy kept (read, write), the new error (read both, write)
ERROR_FEEDBACK_PASSES = 8
# and per number of a compressed matrix M: read by P = M·Q and by Q = Mᵀ·P, written by the decompression P·Qᵀ
MATRIX_PASSES = 3
# and per number sent whole: packed into one buffer (read, write), divided by the world size (read, write), copied back
WHOLE_PASSES = 6


def powersgd_codec(shapes: list[tuple[int, ...]], rank: int) -> tuple[float, int]:
    """What powerSGD_hook computes per steady step over gradients of `shapes` (torch 2.13's, read from its source):
    (FLOPs, numbers read and written). Each compressed n×m matrix with r = min(n, m, rank): 2·n·m·r FLOPs for each of
    P = M·Q, Q = Mᵀ·P and the decompression P·Qᵀ, and 2·(n + m)·r² to orthogonalize P and the warm-started Q
    (Gram-Schmidt, or QR for r > 2)."""
    flops = 0.0
    numbers = compressed_numbers = 0
    for shape in shapes:
        numbers += math.prod(shape)
        matrix = compressed(shape, rank)
        if matrix is not None:
            n, m = matrix
            r = min(n, m, rank)
            flops += 3 * 2 * n * m * r + 2 * (n + m) * r * r
            compressed_numbers += n * m
    whole = numbers - compressed_numbers
    return flops, ERROR_FEEDBACK_PASSES * numbers + MATRIX_PASSES * compressed_numbers + WHOLE_PASSES * whole


class PowerSgd:
    """torch's powerSGD_hook, its state carried over where DDP's buckets change (see the module's doc)."""

    def __init__(self, state: PowerSGDState, *, names: dict[int, str], shapes: dict[str, tuple[int, ...]]) -> None:
        self.state, self.names, self.shapes = state, names, shapes
        self.layouts: dict[int, tuple[str, ...]] = {}  # bucket index -> its parameters, where the state holds it
        self.pending: dict[str, dict[str, torch.Tensor]] = {}  # name -> {"error", "q"}, for a bucket to take
        self.current: set[int] = set()  # the buckets reduced in this step so far
        self.step_done = False
        self.serial = dist.get_backend(state.process_group) != "nccl"

    def hook(self, state: PowerSGDState, bucket):
        """What DDP calls per bucket (as torch's hook, a bound method: DDP reads a hook's name)."""
        if self.step_done:
            self.current.clear()
            self.step_done = False
        index = bucket.index()
        names = tuple(self.names[id(p)] for p in bucket.parameters())
        if self.layouts.get(index) != names:
            for stale in [i for i in self.layouts if i not in self.current]:  # the others are still in flight
                self.pending.update(self._unpack(stale))
                self._drop(stale)
            self._pack(index, names, length=bucket.buffer().numel(), like=bucket.buffer())
        self.current.add(index)
        self.step_done = bucket.is_last()
        reduced = powerSGD_hook(state, bucket)
        if self.serial:
            # gloo runs a bucket's chained all-reduces (P, then Q) in its own threads as the previous ones finish,
            # so two buckets' chains can call their collectives in another order on each rank: a mismatch gloo
            # aborts on (measured: llama-tiny, 0.5 MiB buckets, step 5). One bucket's chain ends before the next
            # bucket starts; NCCL runs callbacks inline, in the order they were made
            reduced.wait()
        return reduced

    def _q_order(self, names: tuple[str, ...]) -> list[tuple[str, int]]:
        """The compressed tensors' Q factors in the order the hook lays them out (grouped by matrix shape, each
        group in the bucket's order), with their lengths."""
        groups: dict[tuple[int, int], list[tuple[str, int]]] = {}
        for name in names:
            matrix = compressed(self.shapes[name], self.state.matrix_approximation_rank)
            if matrix is not None:
                n, m = matrix
                groups.setdefault(matrix, []).append((name, m * min(n, m, self.state.matrix_approximation_rank)))
        return [entry for group in groups.values() for entry in group]

    def _unpack(self, index: int) -> dict[str, dict[str, torch.Tensor]]:
        """Bucket `index`'s state, per parameter (copies)."""
        names = self.layouts[index]
        out: dict[str, dict[str, torch.Tensor]] = {name: {} for name in names}
        error = self.state.error_dict.get(index)
        if error is not None:
            offset = 0
            for name in names:
                size = math.prod(self.shapes[name])
                out[name]["error"] = error[offset:offset + size].clone()
                offset += size
        q = self.state.q_memory_dict.get(index)
        if q is not None:
            offset = 0
            for name, size in self._q_order(names):
                out[name]["q"] = q[offset:offset + size].clone()
                offset += size
        return {name: parts for name, parts in out.items() if parts}

    def _drop(self, index: int) -> None:
        for table in (self.state.error_dict, self.state.p_memory_dict, self.state.q_memory_dict):
            table.pop(index, None)
        self.layouts.pop(index, None)

    def _pack(self, index: int, names: tuple[str, ...], *, length: int, like: torch.Tensor) -> None:
        """Bucket `index`'s state from the per-parameter state waiting for it; where none waits, the hook makes
        it afresh (a zero error, random Q), as in the step compression starts."""
        self._drop(index)
        self.layouts[index] = names
        if not all("error" in self.pending.get(name, {}) for name in names):
            return
        assert sum(math.prod(self.shapes[n]) for n in names) == length, "a bucket holds more than its parameters"
        self.state.error_dict[index] = torch.cat([self.pending[n]["error"] for n in names]).to(like)
        order = self._q_order(names)
        if all("q" in self.pending[name] for name, _ in order):
            self.state.q_memory_dict[index] = torch.cat([self.pending[n]["q"] for n, _ in order]).to(like) \
                if order else like.new_empty(0)
            rank = self.state.matrix_approximation_rank
            ps = sum(matrix[0] * min(*matrix, rank) for n in names
                     if (matrix := compressed(self.shapes[n], rank)) is not None)
            self.state.p_memory_dict[index] = like.new_empty(ps)  # P is made anew from Q each step
        for name in names:
            self.pending.pop(name, None)

    def per_parameter(self) -> dict[str, dict[str, torch.Tensor]]:
        """The whole state per parameter: what the buckets hold and what waits for one."""
        out = {name: dict(parts) for name, parts in self.pending.items()}
        for index in self.layouts:
            out.update(self._unpack(index))
        return out

    def state_tensors(self) -> list[torch.Tensor]:
        """What the memory plan counts beside the optimizer's state (powersgd_state_bytes): each bucket's error and
        P and Q factors, made at the first compressed step, and state loaded for a bucket not yet reduced."""
        tables = (self.state.error_dict, self.state.p_memory_dict, self.state.q_memory_dict)
        return [t for table in tables for t in table.values()] + \
            [t for parts in self.pending.values() for t in parts.values()]

    def state_bytes(self) -> bytes:
        buffer = io.BytesIO()
        torch.save({"iter": self.state.iter, "rng": self.state.rng.get_state(),
                    "parameters": {name: {k: t.cpu() for k, t in parts.items()}
                                   for name, parts in self.per_parameter().items()}}, buffer)
        return buffer.getvalue()

    def load_bytes(self, blob: bytes) -> None:
        saved: dict[str, Any] = load_blob(blob)  # written by state_bytes
        self.state.iter = saved["iter"]
        self.state.rng.set_state(saved["rng"])
        for index in list(self.layouts):
            self._drop(index)
        self.pending = saved["parameters"]


def compression_collectives(shapes: list[tuple[int, ...]], compression: Compression, *, group_size: int,
                            group: str, buckets: int, grad_bytes_per_number: int) -> list[Collective]:
    """DDP's gradient all-reduce under a compression, in one steady step (PowerSGD's: past powersgd_start_step).
    fp16/bf16: every bucket cast to 2 bytes a number. powersgd: per bucket, the gradients sent whole, then the P
    factors, then the Q factors (three all-reduces; a bucket without a tensor sent whole still makes its empty
    call)."""
    numel = sum(math.prod(s) for s in shapes)
    if compression.kind in WIRE_DTYPES:
        return [Collective(op="allreduce_", payload_bytes=numel * 2, calls=buckets, group=group,
                           group_size=group_size, phase="backward", what="gradients (16-bit)", overlap="backward")]
    whole, p, q = powersgd_numbers(shapes, compression.rank)
    each = grad_bytes_per_number
    flops, passes = powersgd_codec(shapes, compression.rank)
    return [Collective(op="allreduce_", payload_bytes=whole * each, calls=buckets, group=group, group_size=group_size,
                       phase="backward", what="gradients sent whole", overlap="backward"),
            Collective(op="allreduce_", payload_bytes=p * each, calls=buckets, group=group, group_size=group_size,
                       phase="backward", what="PowerSGD P factors", overlap="backward", codec_flops=flops,
                       codec_bytes=passes * each),
            Collective(op="allreduce_", payload_bytes=q * each, calls=buckets, group=group, group_size=group_size,
                       phase="backward", what="PowerSGD Q factors", overlap="backward")]

