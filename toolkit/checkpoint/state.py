"""What goes into a checkpoint and back: DCP for the tensors, the manifest for the small numbers.

The layout every strategy shares (see toolkit/checkpoint/__init__.py):
    model.<name>               every entry of the model's state_dict (a tied weight once), fp32 masters
    optim.state.<name>.<key>   AdamW's exp_avg / exp_avg_sq / step, under the parameter's first name
    rng.<rank>                 that rank's CPU generator
    device_rng.<rank>          and its GPU's (CUDA runs: dropout on a GPU draws from that one)
Full tensors (ddp) and DTensor shards (fsdp) go in as they are: DCP stores one copy of a replicated key and
reshards on load. ZeRO's pieces of its flat partitions go in as the boxes they cover (fragments.py).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata

from toolkit.checkpoint import schedule, store, verify
from toolkit.checkpoint.fragments import Fragments, PiecesLoadPlanner, PiecesSavePlanner
from toolkit.errors import RecipeError, first_line, os_error_text, os_error_under, say_once
from toolkit.model.tied import without_tied_aliases
from toolkit.process.dist import DistEnv, barrier


class Read(Protocol):
    """{"optim": {...}} (and "model" where a strategy keeps masters of its own) -> the same, filled in place;
    with `pieces`, those too (a ZeRO rank's views of its flat partitions: fragments.py). `keys`: every key the
    checkpoint holds."""

    keys: frozenset[str]

    def __call__(self, template: dict[str, Any], *, pieces: Fragments | None = None) -> dict[str, Any]: ...


# --- the torch-optimizer strategies (single, dp, ddp, model parallel, fsdp, pipeline) ------------------------

def model_tensors(module: nn.Module) -> dict[str, Any]:
    """The module's state_dict with a tied weight once (its alias shares the storage)."""
    return without_tied_aliases(module, module.state_dict())


def optimizer_tensors(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> dict[str, Any]:
    """The optimizer's per-parameter state in the shared layout (`state.<name>.<key>`). Parameters under one name
    (copies of a shared weight on one rank: a pipeline's tied embedding or split head) are saved and read as the
    first of them in the optimizer's order; its strategy gives the others that state after a read."""
    out: dict[str, Any] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            for key, value in optimizer.state.get(param, {}).items():
                if torch.is_tensor(value):
                    out.setdefault(f"state.{names[id(param)]}.{key}", value)
    return out


def load_optimizer_tensors(optimizer: torch.optim.Optimizer, names: dict[int, str], read: Read) -> None:
    """Create the optimizer's state (torch's own zero-gradient, zero-lr step), then fill it in place from the
    checkpoint: DCP copies each saved tensor into the matching local one, resharding DTensors.

    A parameter of which the checkpoint holds no state at all had none when it was saved: AdamW makes it at a
    parameter's first gradient, which some never had yet (an expert no token was routed to, a layer the loss
    does not reach; every parameter where each step so far was skipped, an fp16 overflow at the first scale).
    Such a resume was refused. Its state is dropped again, so it starts as it would have (with the zero-lr step's
    state it would count one Adam step too many), said in one line."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    _init_optim_state(optimizer)
    template = optimizer_tensors(optimizer, names)
    by_name: dict[str, list[str]] = {}
    for key in template:
        by_name.setdefault(key.rsplit(".", 1)[0], []).append(key)  # state.<name>: its keys
    stateless = {name for name, keys in by_name.items() if not any(f"optim.{key}" in read.keys for key in keys)}
    read({"optim": {key: value for key, value in template.items() if key.rsplit(".", 1)[0] not in stateless}})
    for group in optimizer.param_groups:
        for param in group["params"]:
            if f"state.{names[id(param)]}" in stateless:
                optimizer.state.pop(param, None)
    if stateless:
        first = min(stateless).removeprefix("state.")
        say_once(f"[toolkit] resume: {len(stateless)} parameter(s) had no optimizer state when the checkpoint was "
                 f"saved (no update had reached them yet: {first}, ...): they start without one, as they would have")


def schedule_state(scheduler, scaler) -> dict[str, Any]:
    """The LR schedule's state (its position is what a resume reads) and the fp16 loss scaler's state: plain
    numbers, kept in the manifest."""
    state = {"scheduler": _plain(scheduler.state_dict())}
    if scaler is not None:
        state["scaler"] = _plain(scaler.state_dict())
    return state


def load_schedule_state(scheduler, scaler, extra: dict[str, Any]) -> None:
    """The checkpoint's position on this run's schedule (built from its recipe: see schedule.py), and the fp16
    loss scale. The saved schedule itself (base lrs, lambdas, a DeepSpeed scheduler's settings) is not
    loaded: that kept the checkpoint's lr while the recipe said another."""
    schedule.advance(scheduler, schedule.schedule_steps(extra.get("scheduler") or {}))
    saved = extra.get("scaler")
    if scaler is not None and saved:
        if "scale" not in saved:  # written by DeepSpeed's loss scaler: its scale goes on
            saved = {**scaler.state_dict(), "scale": saved["cur_scale"]}
        scaler.load_state_dict(saved)


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if torch.is_tensor(value):
        return value.item()
    return value


# --- saving ---------------------------------------------------------------------------------------------------

class PendingSave:
    """A checkpoint whose tensors are being written in the background (checkpoint.async).

    Three things finish in order: the staging copy (training may not update the weights before it is done:
    `wait_staged()`), every rank's files (DCP's coordinator on rank 0 writes the metadata after gathering every
    rank's write results, so rank 0's future is done only when all are), then rank 0's commit (manifest,
    rename, keep_last), which runs on a thread of its own so training is not held for it. `commit()` waits for
    all three and raises what failed."""

    def __init__(self, *, step: int, out_dir: Path, env: DistEnv, response, copied: Future,
                 finish: Callable[[], None]):
        self.step, self.out_dir, self.env = step, out_dir, env
        self.staging: Future = copied  # the copy training waits for (the gather of ZeRO's pieces comes after)
        self.writing: Future = response.upload_completion
        self._failure: BaseException | None = None
        self._committer: threading.Thread | None = None
        if env.is_main:
            def commit_when_written() -> None:
                try:
                    self.writing.result()
                    finish()
                except BaseException as exc:  # noqa: BLE001 - re-raised by commit() on the main thread
                    self._failure = exc

            # a daemon: a run that dies while a save is in flight exits without it (the save stays partial)
            self._committer = threading.Thread(target=commit_when_written, name="toolkit-checkpoint-commit",
                                               daemon=True)
            self._committer.start()

    def wait_staged(self) -> float:
        """Seconds waited for the staging copy (before an update may change the weights it copies)."""
        if self.staging.done():
            self.staging.result()  # raises a failed copy
            return 0.0
        start = time.perf_counter()
        self.staging.result()
        return time.perf_counter() - start

    def commit(self) -> Path:
        with written(self.out_dir, self.step):
            self.staging.result()
            self.writing.result()
            if self._committer is not None:
                self._committer.join()
                if self._failure is not None:
                    raise self._failure
        return store.final_path(self.out_dir, self.step)


@contextlib.contextmanager
def written(out_dir: Path, step: int) -> Iterator[None]:
    """Around the writing of a checkpoint's files: a write that fails (a full disk: ENOSPC; a file size limit:
    EFBIG) is a CheckpointWriteError naming the step, the OS error, the free space and the checkpoint to resume
    from, in one line, instead of DCP's traceback of every rank's failure."""
    try:
        yield
    except CheckpointException as exc:  # DCP's own (a BaseException): every rank's failure, gathered
        raise store.write_failed(out_dir, step, why=_failures_text(exc), on_every_rank=True) from exc
    except OSError as exc:  # rank 0's small files (manifest, recipe, hf/, digests) or the rename
        raise store.write_failed(out_dir, step, why=os_error_text(exc)) from exc


def _failures_text(exc: CheckpointException) -> str:
    """What failed on which ranks: the OS error where there is one (OsErrorWriter), else the error's first line."""
    ranks_by_why: dict[str, list[int]] = {}
    for rank, failure in sorted(exc.failures.items()):
        error = failure[0] if isinstance(failure, tuple) else failure
        os_error = os_error_under(error)
        ranks_by_why.setdefault(os_error_text(os_error) if os_error else first_line(error), []).append(rank)
    return "; ".join(f"{why} on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
                     for why, ranks in ranks_by_why.items()) or first_line(exc)


class OsErrorWriter(FileSystemWriter):
    """DCP's file writer (as dcp.save makes it from a checkpoint_id), whose failed write raises the OSError itself.

    Why: torch.save reports a failed write (a full disk, a file size limit) as a RuntimeError, "unexpected pos
    704 vs 598", whose context is the OSError; DCP pickles every rank's failure to gather them, and pickling
    drops the context, so rank 0 would know only that RuntimeError. An OSError pickles with its errno."""

    def write_data(self, plan, planner):
        try:
            return super().write_data(plan, planner)
        except RuntimeError as exc:
            os_error = os_error_under(exc)
            if os_error is None:
                raise
            raise os_error from None


def save(strategy, *, step: int, out_dir: Path, env: DistEnv, recipe, manifest: dict, hf_files,
         keep_last: int, background=None) -> PendingSave | None:
    """Collective: every rank hands its part to DCP. Synchronous: written and committed on return (None).
    With `background` (an AsyncWriter: a process group of its own, so the writes' collectives never
    interleave with training's, and a stager that copies in a thread): returns the PendingSave."""
    partial = store.partial_path(out_dir, step)  # DCP creates it; Saver removed stale ones at the start
    tensors = strategy.state.checkpoint_tensors()
    pieces = tensors if isinstance(tensors, Fragments) else None  # each rank writes its own (fragments.py)
    planner: DefaultSavePlanner | None = None  # DCP's default, except for pieces (async: given the copy once made)
    if pieces is not None:
        planner = PiecesSavePlanner(pieces if background is None else None)
        tensors = pieces.state() if background is None else {"model": {}, "optim": {}}
    elif replicas_apart(strategy):
        # DCP writes one copy of what several ranks hold alike, each from whichever rank has written least so far:
        # with local SGD's replicas apart, a tensor from one replica, the next from another. The lowest rank
        # holding each is the first replica's (rank 0's, HSDP's first group): one replica, whole, for `toolkit
        # convert` and a resume on another number of ranks (each rank's own state is in its "comm" entry)
        planner = DefaultSavePlanner(dedup_save_to_lowest_rank=True)
    state = {"model": tensors["model"], "optim": tensors["optim"],
             **{key: {str(env.rank): held} for key, held in _generators(env).items()}}
    communication = strategy.state.communication_state()  # each rank its own (PowerSGD's error)
    if communication is not None:
        state["comm"] = {str(env.rank): torch.frombuffer(bytearray(communication), dtype=torch.uint8)}
    extra = strategy.state.checkpoint_extra()  # now: training moves the schedule on while the files are written

    def finish() -> None:
        store.write_manifest(partial, {**manifest, "step": step, "world_size": env.world_size, "extra": extra},
                             recipe=recipe, hf_files=hf_files)
        store.commit(out_dir, step, keep_last=keep_last, digests=recipe.checkpoint.digests)

    if background is None:
        with written(out_dir, step):
            dcp.save(state, checkpoint_id=str(partial), storage_writer=OsErrorWriter(partial), planner=planner)
            if env.is_main:
                finish()
        barrier(env)
        return None
    response = dcp.async_save(state, checkpoint_id=str(partial), storage_writer=OsErrorWriter(partial),
                              planner=planner, process_group=background.group,
                              async_stager=background.stager)  # type: ignore[arg-type]  # AsyncStager protocol
    copied = background.stager.start(pieces=pieces, planner=planner if pieces is not None else None)
    return PendingSave(step=step, out_dir=out_dir, env=env, response=response, copied=copied, finish=finish)


def replicas_apart(strategy) -> bool:
    """Whether this rank's replicas differ now by design (local SGD between syncs): every rank alike."""
    return any(each.synced is not None and not each.synced() for each in strategy.state.replicas())


class DeferredStager:
    """dcp.async_save's stager (torch's AsyncStager protocol), copying on a thread of its own that lives as
    long as the run, but only once `start()` is called, after async_save returned.

    Why: async_save starts its writer thread after asking for the copy, and starting a thread waits until
    that thread holds the GIL; a copy already running in Python takes it for its switch intervals, which on
    a CPU held training up by ~10 ms per save (measured with torch's own threaded stager). Deferred, the
    writer thread starts at once and waits for the copy, which then runs whenever training releases the
    GIL (every torch op does)."""

    _synchronize_after_execute = False  # the loop waits for the copy before the next update (before_update)

    def __init__(self, copier, *, device: torch.device) -> None:
        self._copier = copier  # torch's DefaultStager, synchronous: the copy itself
        # on a GPU the thread works on this rank's device (not GPU 0, CUDA's default for a new thread)
        on_gpu = device.type == "cuda"
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="toolkit-checkpoint-copy",
                                          initializer=(lambda: torch.cuda.set_device(device)) if on_gpu else None)
        self._job: tuple[Future, Any] | None = None

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict: dict[str, Any]) -> Future:
        future: Future = Future()
        self._job = (future, state_dict)
        return future

    def start(self, *, pieces: Fragments | None = None, planner: PiecesSavePlanner | None = None) -> Future:
        """Copy the state dict async_save was given (and a ZeRO rank's pieces, handed to `planner`) on the copy
        thread. Returns the future of that copy, after which training may update; DCP's writer plans and
        writes once the whole state dict is staged."""
        assert self._job is not None
        future, state_dict = self._job
        self._job = None
        copied: Future = Future()

        def copy() -> None:
            try:
                staged = self._copier.stage(state_dict)
                if pieces is not None and planner is not None:
                    planner.fragments = pieces.flatten()
                    for part, tensors in planner.fragments.state().items():
                        staged[part].update(tensors)
                copied.set_result(None)
                future.set_result(staged)
            except BaseException as exc:  # noqa: BLE001 - the writer thread and wait_staged() raise it
                if not copied.done():
                    copied.set_exception(exc)
                future.set_exception(exc)

        self._thread.submit(copy)
        return copied

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        self._thread.shutdown(wait=True)
        self._copier.close()


@dataclass
class AsyncWriter:
    """What every async save of a run shares: its process group and its stager."""

    group: Any
    stager: DeferredStager

    @classmethod
    def create(cls, env: DistEnv) -> "AsyncWriter":
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        import torch.distributed as dist

        group = None
        if dist.is_initialized():  # also a group of one (fsdp/zero without a launcher), NCCL-only on a GPU
            group = dist.new_group(backend="gloo")  # collective: every rank reaches its first save together
        # a plain copy on the stager's thread; pinned memory speeds up the copies from a GPU
        on_gpu = torch.device(env.device).type == "cuda"
        copier = DefaultStager(StagingOptions(use_pinned_memory=on_gpu, use_shared_memory=False,
                                              use_async_staging=False, use_non_blocking_copy=False))
        return cls(group=group, stager=DeferredStager(copier, device=torch.device(env.device)))

    def close(self) -> None:
        self.stager.close()


# --- loading --------------------------------------------------------------------------------------------------

def saved_keys(path: Path) -> set[str]:
    """The keys of a checkpoint whose files are all there (RecipeError, one line, otherwise)."""
    return set(verify.read_metadata(path).state_dict_metadata)


def _load(state: dict, path: Path, *, pieces: Fragments | None = None) -> None:
    try:
        dcp.load(state, checkpoint_id=str(path), storage_reader=verify.SafeReader(str(path)),
                 planner=PiecesLoadPlanner(pieces) if pieces is not None else None)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - (DCP's own is a BaseException)
        text = str(exc).strip().splitlines()
        raise RecipeError(f"checkpoint {path} cannot be read into this model ({type(exc).__name__}: "
                          f"{text[-1][:200] if text else ''}); it is corrupted or was written for another model") from None


def load_weights(model: nn.Module, path: Path) -> None:
    """Into the plain model, before the strategy wraps it (every rank; collective when distributed)."""
    target = model_tensors(model)
    verify.check_model_fits(path, verify.read_metadata(path), {k: v.shape for k, v in target.items()}, whole=True)
    _load({"model": target}, path)


def load_part_weights(part: nn.Module, path: Path, *, aliases: dict[str, str]) -> None:
    """Into a materialized part of the model (a pipeline stage: whole tensors under the whole model's names), its
    tensors only: DCP reads no other (collective: every rank calls it as many times). `aliases`: a tied weight's
    names -> the one the checkpoint holds it under (a last stage's lm_head.weight is model.embed_tokens.weight)."""
    target: dict[str, Any] = {}
    for name, tensor in part.state_dict().items():
        target.setdefault(aliases.get(name, name), tensor)  # a tied weight's two names: one tensor, read once
    verify.check_model_fits(path, verify.read_metadata(path), {k: v.shape for k, v in target.items()}, whole=False)
    _load({"model": target}, path)


def read_model_tensors(path: Path, shapes: dict[str, Any],
                       metadata: Metadata | None = None) -> dict[str, torch.Tensor]:
    """Collective: the named weights of a checkpoint as full fp32 tensors, on every rank. `metadata`: its
    verify.read_metadata, where a caller reading it part by part has it already (its files checked once)."""
    verify.check_model_fits(path, metadata or verify.read_metadata(path), shapes, whole=False)
    target = {name: torch.empty(tuple(shape), dtype=torch.float32) for name, shape in shapes.items()}
    _load({"model": target}, path)
    return target


class OptimizerReader:
    """The Read of the checkpoint at `path`: a key it lacks is one line naming --resume-weights-only."""

    def __init__(self, path: Path) -> None:
        self.path, self.keys = path, frozenset(saved_keys(path))

    def __call__(self, template: dict[str, Any], *, pieces: Fragments | None = None) -> dict[str, Any]:
        wanted = [f"{part}.{k}" for part, entries in template.items() for k in entries]
        wanted += [p.key for p in pieces.pieces] if pieces is not None else []
        missing = [key for key in wanted if key not in self.keys]
        if missing:
            raise RecipeError(f"checkpoint {self.path} holds no {missing[0]!r}; resume with --resume-weights-only "
                              "to start the optimizer afresh from its weights")
        _load(template, self.path, pieces=pieces)
        return template


def load_communication(path: Path, *, env: DistEnv, saved_world: int) -> bytes | None:
    """This rank's saved communication state (TorchState.communication_state), or None, said in one line, where the
    checkpoint holds none for it (saved without the hook, or by another number of ranks: each rank's is its own)."""
    key = f"comm.{env.rank}"
    held = verify.read_metadata(path).state_dict_metadata.get(key)
    if saved_world != env.world_size or held is None:
        if env.is_main:
            why = f"saved by {saved_world} ranks, now {env.world_size}" if saved_world != env.world_size else \
                "the checkpoint holds none"
            print(f"[toolkit] resume: gradient compression state starts afresh ({why}): PowerSGD reduces "
                  "plainly for its powersgd_start_step steps again, then compresses with a zero error and new "
                  "factors", file=sys.stderr, flush=True)
        return None
    state = {"comm": {str(env.rank): torch.empty(tuple(held.size), dtype=torch.uint8)}}  # type: ignore[union-attr]
    _load(state, path)
    return state["comm"][str(env.rank)].numpy().tobytes()


def read_rng(path: Path, *, env: DistEnv, saved_world: int) -> dict[str, torch.Tensor] | None:
    """This rank's generators' states as the checkpoint holds them (set by `set_rng`), when the world size is the
    one that saved them (they only drive dropout); None otherwise."""
    if saved_world != env.world_size:
        if env.is_main:
            print(f"[toolkit] resume: random generators not restored (saved by {saved_world} ranks, now "
                  f"{env.world_size}); only dropout masks depend on them", file=sys.stderr, flush=True)
        return None
    saved = saved_keys(path)  # a checkpoint saved on the CPU (or before the toolkit kept it) has no GPU's
    rank = str(env.rank)
    state = {key: {rank: held} for key, held in _generators(env).items() if f"{key}.{rank}" in saved}
    _load(state, path)  # into the copies _generators made: nothing is set yet
    return {key: held[rank] for key, held in state.items()}


def set_rng(states: dict[str, torch.Tensor] | None, *, env: DistEnv) -> None:
    """The generators read by `read_rng` set (nothing where it read none)."""
    if states is None:
        return
    torch.set_rng_state(states["rng"])
    if "device_rng" in states:
        torch.cuda.set_rng_state(states["device_rng"], env.device)


def _generators(env: DistEnv) -> dict[str, torch.Tensor]:
    """This rank's random generators' states: the CPU's, and on a GPU its own (model.build's manual_seed reset
    both: a resumed GPU run drew the first steps' dropout masks again)."""
    held = {"rng": torch.get_rng_state()}
    if env.device.type == "cuda":
        held["device_rng"] = torch.cuda.get_rng_state(env.device)
    return held
