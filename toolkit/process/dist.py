"""The process group, the device and small collectives. The only reader of RANK/WORLD_SIZE/LOCAL_RANK."""

from __future__ import annotations

import copy
import datetime
import functools
import gc
import importlib
import importlib.util
import math
import os
import socket
import sys
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from toolkit.config.parallel import MESH_ORDER, Degrees
from toolkit.errors import ranks_option, under_accelerate


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def restarted() -> bool:
    """Whether torch's launcher restarted this rank's group (`--max-restarts`): a later attempt of one run."""
    return restart_count() != 0


def restart_count() -> int:
    """How many times torch's agent has restarted this launch's ranks (--max-restarts) before this attempt."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0


def env_world_size() -> int:
    """World size as the launcher set it (1 when not launched by torchrun/accelerate)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def machines_of(world_size: int) -> tuple[int, int]:
    """(machines, ranks on this machine) as the launcher set them: torch's (GROUP_WORLD_SIZE, LOCAL_WORLD_SIZE) or
    DeepSpeed's (CROSS_SIZE, LOCAL_SIZE); one machine of `world_size` ranks without a launcher or where a value is
    not a number."""
    env = os.environ
    try:
        return (int(env.get("GROUP_WORLD_SIZE", env.get("CROSS_SIZE", "1"))),
                int(env.get("LOCAL_WORLD_SIZE", env.get("LOCAL_SIZE", world_size))))
    except ValueError:
        return 1, world_size


def init_distributed(*, deepspeed: bool = True) -> DistEnv:
    """Join the process group the launcher described (if any) and pick this rank's device. `deepspeed`: the run
    may import DeepSpeed (its strategy runs on it), whose comm module is then imported first (_import_before_group);
    a strategy that never imports it does not pay its ~0.3 s of CPU per rank."""
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world_size = env_world_size()
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if world_size > 1 and not dist.is_initialized():
        _import_before_group(deepspeed=deepspeed)
        timeout = COLLECTIVE_TIMEOUT
        dist.init_process_group(backend=backend, timeout=timeout,
                                **_attempt_store(rank=rank, world_size=world_size, timeout=timeout))
    return DistEnv(rank=rank, local_rank=local_rank, world_size=world_size, device=device)


def _attempt_store(*, rank: int, world_size: int, timeout: datetime.timedelta) -> dict:
    """Under torchrun, the launcher's store with a prefix per attempt. When `--max-restarts` restarts the
    ranks, they join the same store again; without a prefix the new group reads the dead group's addresses
    (gloo: "connectFullMesh failed ... Connection refused", measured with torch 2.13). Empty otherwise."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or "MASTER_ADDR" not in os.environ:
        return {}
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # the agent hosts it
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=rank == 0 and not agent_store, timeout=timeout)
    return {"store": dist.PrefixStore(f"toolkit/attempt-{attempt}", store), "rank": rank, "world_size": world_size}


def ensure_process_group(env: DistEnv, *, strategy: str, deepspeed: bool = False) -> None:
    """A process group of one, for strategies that need one even without a launcher (FSDP's device mesh,
    DeepSpeed), set up the way torch's launcher would for a single rank. `deepspeed`: the strategy runs on
    DeepSpeed, whose comm module is then imported before the group (_import_before_group); a ddp or fsdp process
    imports none of it (0.3 s of `toolkit train`'s start-up, measured with -X importtime)."""
    if dist.is_initialized():
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", str(port))):
        # a launcher of one rank (torchrun --nproc 1) set them, and its workers join the launcher's own store
        # at that address: keep them. Without a launcher nothing is set. DeepSpeed reads LOCAL_RANK itself.
        os.environ.setdefault(key, value)
    _import_before_group(deepspeed=deepspeed)
    dist.init_process_group("nccl" if env.device.type == "cuda" else "gloo", rank=0, world_size=1)
    launcher = "accelerate launch" if under_accelerate() else "toolkit launch"
    print(f"[toolkit] {strategy} on one rank (a process group of one); `{launcher} {ranks_option('N')}` runs N "
          "ranks", file=sys.stderr, flush=True)


# Modules whose functions take `group=<the default group>` as a default argument, evaluated when the
# module is imported. Imported after init_process_group they hold the default group for the life of the
# process, so destroy_process_group cannot free it and its native threads outlive interpreter teardown
# (see exit_process). Who imports them late: DDP (torch._dynamo imports torch.distributed.nn.functional),
# the fsdp strategy (ShardedGradScaler), and a DeepSpeed strategy (its comm backend's barrier() holds
# GroupMember.WORLD). Imported first, the defaults are None. DeepSpeed's only where the strategy runs on it
# (init_distributed): with transformers 5.24 a ddp rank never imports it (checked by sys.modules at exit).
_DEFAULT_GROUP_CAPTURERS = ("torch.distributed.nn.functional", "torch.distributed.fsdp.sharded_grad_scaler",
                            "deepspeed.comm.torch")


def _import_before_group(*, deepspeed: bool = True) -> None:
    cache_cpu_info()
    for name in _DEFAULT_GROUP_CAPTURERS:
        if name.startswith("deepspeed.") and not deepspeed:
            continue
        if importlib.util.find_spec(name.split(".")[0]) is None:
            continue  # DeepSpeed is optional on a machine that runs no zero strategy
        try:
            import_without_autotuner_mlflow(name)
        except Exception as exc:  # noqa: BLE001 - a broken optional install must not stop a ddp run
            print(f"[toolkit] note: importing {name} failed ({type(exc).__name__}: {exc}); a rank may then "
                  "leave without interpreter teardown", file=sys.stderr)


def cache_cpu_info() -> None:
    """Keep py-cpuinfo's first answer for the life of the process. DeepSpeed asks it for the CPU three times in
    a rank that loads its CPU ops (the op builder's cpu_arch and simd_width, DeepSpeedCPUAdam's vendor check),
    and each call starts a Python subprocess that forks again to run cpuid: ~1.1 s of CPU each (measured with
    py-spy in a 2-rank zero2-offload launch: 3.4 s per rank). The CPU does not change under a process."""
    try:
        import cpuinfo
    except ImportError:  # DeepSpeed then asks lscpu itself
        return
    if getattr(cpuinfo.get_cpu_info, "kept_by_toolkit", False):
        return
    first = functools.cache(cpuinfo.get_cpu_info)

    def get_cpu_info() -> dict:
        return copy.deepcopy(first())  # a caller may change its dict

    get_cpu_info.kept_by_toolkit = True  # type: ignore[attr-defined]
    cpuinfo.get_cpu_info = get_cpu_info  # DeepSpeed imports it from the package at each call


def import_without_autotuner_mlflow(name: str):
    """Import `name`; if that imports DeepSpeed for the first time, without MLflow. DeepSpeed's autotuner (which
    the toolkit never runs) imports MLflow when it is installed, for its own logging: ~1 s per process, every
    rank of every run, where the tracking extra is installed (measured: `import deepspeed` 1.3 s with it, 0.3 s
    without). An entry of None in sys.modules makes that one import fail, which the autotuner takes as MLflow
    missing; the entry is removed at once, so the toolkit's own tracking imports MLflow as usual."""
    hide = "deepspeed" not in sys.modules and "mlflow" not in sys.modules
    if hide:
        sys.modules["mlflow"] = None  # type: ignore[assignment]
    try:
        return importlib.import_module(name)
    finally:
        if hide and sys.modules.get("mlflow", False) is None:
            del sys.modules["mlflow"]


def shutdown(*, completed: bool, release: Callable[[], None] | None = None) -> bool:
    """Leave the process group, in this order: wait until every rank has written its outputs (a barrier,
    when this rank `completed`), `release` what holds the group (the strategy's wrapped model and
    optimizer), destroy the group. Returns False when a peer left before the barrier (said in one line)."""
    global _threads_left
    _threads_left = []
    ok = True
    if dist.is_initialized() and completed:
        try:
            dist.barrier()
        except RuntimeError as exc:  # a peer died or was stopped: its failure is the launcher's to report
            first = (str(exc).strip().splitlines() or ["no detail"])[0]
            print(f"toolkit: rank {dist.get_rank()}: another rank left before the final barrier ({first[:160]})",
                  file=sys.stderr, flush=True)
            ok = False
    if release is not None:
        release()
    _held_groups.clear()  # a group still referenced is not freed by destroy_process_group (see exit_process)
    if not dist.is_initialized():
        return ok
    dist.destroy_process_group()
    gc.collect()  # reference cycles (module hooks, optimizer state) that still hold a group
    _threads_left = communication_threads()
    return ok


_threads_left: list[str] = []  # communication threads still running after shutdown() destroyed the group


def communication_threads() -> list[str]:
    """Names of this process's native communication threads still running (gloo, NCCL); Linux /proc."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return ["unknown (no /proc)"]
    names = []
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as handle:
                name = handle.read().strip()
        except OSError:
            continue  # the thread ended while we looked
        if name.startswith(("gloo", "pt_gloo", "pt_nccl")):
            names.append(name)
    return names


def exit_process(exit_code: int) -> int:
    """The last call of a rank, after shutdown(): returns `exit_code` for a normal interpreter exit, or
    leaves at once with it while the destroyed group's communication threads are still running.

    Why: a process group that something still references is not freed by destroy_process_group, so
    its native threads are never joined. With torch 2.13 and DeepSpeed 0.19 that is the case for every
    sharded strategy: DTensor's caches (MeshTopoInfo.build_from_mesh, the redistribute planner) keep
    FSDP's DeviceMesh, and with it its groups, for the life of the process; deepspeed.utils.groups keeps
    its world group. At interpreter teardown, a gloo worker that drops its last reference to a tensor
    takes the GIL; Python 3.11 answers by ending the thread with pthread_exit, whose unwind through a
    noexcept destructor calls std::terminate: "terminate called without an active exception", SIGABRT,
    and a finished run reported as failed (measured: 3 of 20 plain 2-rank all-reduce jobs that kept a
    reference to the group past destroy_process_group aborted so; 0 of 20 without that reference).
    Every output of the run is written and closed before this point, so skipping teardown loses nothing."""
    if not _threads_left:
        return exit_code
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


def world_mesh(env: DistEnv, degrees: Degrees, *, keep: tuple[str, ...] = ()):
    """The run's one DeviceMesh: its dimensions in MESH_ORDER (pp, dp_replicate, dp_shard, cp, tp, outermost first,
    as torchtitan lays them out), those of more than one rank and those named in `keep` (a strategy that slices
    a dimension by name keeps it at size 1). Every dimension's groups are the slices of this one mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    names = tuple(name for name in MESH_ORDER if getattr(degrees, name) > 1 or name in keep)
    assert names, "a mesh needs a dimension: keep one"
    shape = tuple(getattr(degrees, name) for name in names)
    assert math.prod(shape) == env.world_size, (degrees, env.world_size)
    return init_device_mesh(env.device.type, shape, mesh_dim_names=names)


PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Socket closed",
             "Connection refused")  # gloo's words for a peer process that is gone


def peer_lost(exc: BaseException, env: DistEnv) -> bool:
    """Whether `exc` is this rank's collective failing because another rank's process is gone (its launcher says
    which rank and how; this rank's own error says only that a connection closed)."""
    return env.distributed and isinstance(exc, (RuntimeError, dist.DistError)) and \
        any(words in str(exc) for words in PEER_LOST)


def barrier(env: DistEnv) -> None:
    if env.distributed:
        dist.barrier()


def _to_backend(tensor: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """NCCL only moves device tensors: small host tensors (counts, checksums) travel through env.device."""
    return tensor.to(env.device)  # no copy on CPU/gloo


def _all_reduce(tensor: torch.Tensor, env: DistEnv, op, group=None) -> torch.Tensor:
    if env.distributed:
        moved = _to_backend(tensor, env)
        dist.all_reduce(moved, op=op, group=group)
        if moved is not tensor:
            tensor.copy_(moved)  # device sync on GPU: callers read the result on the host
    return tensor


def all_reduce_sum(tensor: torch.Tensor, env: DistEnv, *, group=None) -> torch.Tensor:
    """Sum a small tensor over ranks (of `group`; default all) in place (float64 sums stay exact for counts)."""
    return _all_reduce(tensor, env, dist.ReduceOp.SUM, group)


def all_reduce_max(tensor: torch.Tensor, env: DistEnv, *, group=None) -> torch.Tensor:
    """Element-wise maximum of a small tensor over ranks (of `group`; default all), in place."""
    return _all_reduce(tensor, env, dist.ReduceOp.MAX, group)


def all_gather_tensor(tensor: torch.Tensor, env: DistEnv, *, group=None) -> list[torch.Tensor]:
    """Every rank's copy (of `group`'s ranks; default all) of a small tensor of the same shape, in group
    rank order, on the tensor's device."""
    if not env.distributed:
        return [tensor]
    moved = _to_backend(tensor, env)
    out = [torch.zeros_like(moved) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, moved, group=group)
    return [t.to(tensor.device) for t in out]


def global_rank(group, group_rank: int) -> int:
    """The global rank of `group_rank` in `group` (None: the world group)."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def gather_objects(obj, env: DistEnv) -> list:
    """Every rank's small picklable object, in rank order (collective)."""
    if not env.distributed:
        return [obj]
    out = [None] * env.world_size
    dist.all_gather_object(out, obj)
    return out


def tensors_on_main(mine: dict[str, torch.Tensor], env: DistEnv) -> dict[str, torch.Tensor] | None:
    """Collective: every rank's named tensors on rank 0, on CPU (None elsewhere), sent point to point one at
    a time after their names, shapes and dtypes (small objects): rank 0 holds each tensor once as it arrives,
    the others nothing more. A name several ranks hold keeps the lowest rank's tensor."""
    shapes = gather_objects({k: (tuple(v.shape), v.dtype) for k, v in mine.items()}, env)
    if not env.is_main:
        for tensor in mine.values():
            dist.send(tensor.contiguous(), dst=0)
        return None
    merged = {k: v.to("cpu", copy=True) for k, v in mine.items()}
    for source, held in enumerate(shapes[1:], start=1):
        for name, (shape, dtype) in held.items():
            received = torch.empty(shape, dtype=dtype, device=env.device)
            dist.recv(received, src=source)
            merged.setdefault(name, received.cpu())
    return merged


COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)  # the process group's: a rank silent this long has failed
# how long the other ranks wait for rank 0's own work before the run (tokenizing a corpus): hours, where the
# group's 30 minutes ended every run whose data took longer, and its tokenizing with it, so that no run got further
RANK_0_WORK_TIMEOUT = datetime.timedelta(hours=24)


def broadcast_object(obj, env: DistEnv):
    """Rank 0's `obj` on every rank, sent after work of its own that may take longer than the process group's
    timeout (tokenizing): the others wait up to RANK_0_WORK_TIMEOUT, over a gloo group of that timeout (made once,
    by every rank, at the first call)."""
    if not env.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=_rank_0_work_group())
    return box[0]


def first_error(error: str | None, env: DistEnv) -> str | None:
    """The first of the ranks' errors (in rank order; None: none had one), on every rank, each sent after work of
    its own that may take longer than the process group's timeout (a node's tokenizing): every rank waits for the
    slowest up to RANK_0_WORK_TIMEOUT (broadcast_object's group)."""
    if not env.distributed:
        return error
    every: list[str | None] = [None] * env.world_size
    dist.all_gather_object(every, error, group=_rank_0_work_group())
    return next((e for e in every if e is not None), None)


_held_groups: dict[str, object] = {}  # groups of the toolkit's own, dropped by shutdown() before it destroys them


def _rank_0_work_group():
    if "rank 0 work" not in _held_groups:
        _held_groups["rank 0 work"] = dist.new_group(backend="gloo", timeout=RANK_0_WORK_TIMEOUT)
    return _held_groups["rank 0 work"]
