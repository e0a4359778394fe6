"""run.json: what a run was (strategy, world, batch arithmetic, FLOPs/token, versions), the precision
audit and model-state bytes read from the live objects, and per-rank peak memory at the end."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from toolkit.atomic import write_text_whole
from toolkit.checkpoint.store import CheckpointWriteError, complete_checkpoints, read_run_info
from toolkit.checkpoint.run import launch_identity
from toolkit.config.files import dump_recipe
from toolkit.config.recipe import BatchPlan, Recipe
from toolkit.errors import NO_ROOM, RecipeError, first_line
from toolkit.model.blocks import BlockForwards
from toolkit.model.build import flops_per_token
from toolkit.observe.idle import idle_over_span
from toolkit.observe.metrics import (live_tensor_storages, measured_matmul_flops, peak_memory_bytes,
                                     peak_reserved_bytes, storage_key, strict_json)
from toolkit.observe.versions import versions
from toolkit.process import host_memory
from toolkit.process.dist import DistEnv, all_reduce_max, gather_objects, peer_lost
from toolkit.process.stopping import NonFinite, OutputWriteError, SkippedSteps, Stopped, write_error_text
from toolkit.strategies import layout_line, strategy_degrees
from toolkit.strategies.base import storage_bytes
from toolkit.strategies.optim.adamw import schedule_label


@dataclass(eq=False)
class RunRecord:
    """run.json as a run builds it: `fields` is the file's content, written whole; beside it, what the run keeps
    for later writes and never writes. Reads and writes of run.json's keys go through `record[key]`."""

    fields: dict[str, Any]
    out_dir: Path
    schedule: str = ""  # the recipe's lr schedule in words: the audit's scheduler row, unless the strategy has its own
    last_step: int = 0  # the last step metrics.jsonl holds (run.json's ended, where the run does not complete)
    block_forwards: BlockForwards | None = None  # counts the first step's block forwards (activation checkpointing)
    recompute: str = "none"  # train.activation_checkpointing in one name (none | full | selective)
    first_backward: dict[str, Any] | None = None  # this rank's reads after the first backward, until that step ends
    setup_peak: int | None = None  # this rank's peak memory by the end of setup, before the first step
    longest_tokens: int = 0  # the longest padded length of this rank's training micro-batches so far, in tokens

    def __getitem__(self, key: str) -> Any:
        return self.fields[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self.fields[key] = value

    def __contains__(self, key: str) -> bool:
        return key in self.fields

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def write(self) -> None:
        """Rank 0, mid-run: what is known so far, kept in case the run is killed outright. On a full disk it is
        passed over: the record stays in memory for the run's last write, and the next checkpoint or metrics line
        that finds no room ends the run in its own line."""
        try:
            _write(self.fields, self.out_dir)
        except OSError as exc:
            if exc.errno not in NO_ROOM:
                raise


def device_name(env: DistEnv) -> str:
    if env.device.type == "cuda":
        return torch.cuda.get_device_name(env.device)
    return f"cpu ({os.cpu_count()} cores, {torch.get_num_threads()} threads/rank)"


def _cpu_peak(recipe: Recipe, env: DistEnv, model) -> dict | None:
    """On CPU, MFU needs a peak: every rank measures matmuls at once (they share the cores), on a square
    shape and on the model's own linear shapes (tokens × hidden × MLP width, and the LM head's)."""
    if env.device.type != "cpu":
        return None
    dtype = torch.bfloat16 if recipe.precision == "bf16" else torch.float32
    # rows of the measured matmuls: a micro-batch of max_length samples, at most 8192 (as many fill the vector
    # units; a long data.max_length would allocate gigabytes here, and a batch is only as long as its longest sample)
    tokens = min(recipe.batch.micro_batch_size * recipe.data.max_length, 8192)
    hidden = getattr(model.config, "hidden_size", 0)
    shapes = [(1024, 1024, 1024)]
    if hidden:
        width = getattr(model.config, "intermediate_size", 0) or 4 * hidden
        shapes += [(tokens, hidden, width), (tokens, width, hidden), (tokens, hidden, hidden)]
        if recipe.model.task == "causal-lm":
            shapes.append((tokens, hidden, min(getattr(model.config, "vocab_size", 0) or hidden, 8192)))
    peaks = gather_objects(measured_matmul_flops(shapes, dtype=dtype), env)
    slowest = min(peaks, key=lambda p: p["flops_per_s"])  # ranks share the cores: the slowest rank is the bound
    return {"flops_per_s": slowest["flops_per_s"], "shape": slowest["shape"],
            "dtype": recipe.precision if recipe.precision == "bf16" else "fp32", "threads": torch.get_num_threads()}


def predict_memory(recipe: Recipe, env: DistEnv, *, runtime_bytes: int, resuming: bool = False) -> dict | None:
    """Rank 0, before setup: toolkit plan's prediction for this run (kept beside what the run measures), and a
    warning when its peak exceeds what the device has."""
    if not env.is_main:
        return None
    from toolkit.plan.predict import MiB, default_memory_per_rank, predict

    try:
        prediction = predict(recipe, world_size=env.world_size, runtime_bytes=runtime_bytes,
                             device_type=env.device.type, both=False, resuming=resuming)
    except RecipeError as exc:  # a model the planner cannot read (the run itself may still work)
        return {"error": str(exc)}
    limit, what = default_memory_per_rank(env.world_size if env.device.type == "cpu" else 1)
    if prediction.peak_bytes > limit:
        print(f"[toolkit] warning: predicted peak {prediction.peak_bytes / MiB:,.0f} MiB per rank exceeds "
              f"{limit / MiB:,.0f} MiB ({what}); `toolkit plan` shows which strategies fit",
              file=sys.stderr, flush=True)
    return prediction.as_dict()


def set_host_memory(recipe: Recipe, env: DistEnv, *, prediction: dict | None) -> tuple[str | None, str | None]:
    """train.host_memory on CPU, before the model is built: rank 0 chooses (auto: from its prediction's peak),
    every rank sets the same (toolkit.process.host_memory). The mode (None on a GPU), and on rank 0 the line that says why
    auto chose predictable, for the run to print once it goes ahead (a user's mistake found before stays one line)."""
    if env.device.type != "cpu":
        return None, None
    from toolkit.plan.predict import MiB, default_memory_per_rank

    setting = recipe.train.host_memory
    peak = prediction.get("peak_bytes") if prediction else None
    share, what = default_memory_per_rank(env.world_size)
    mode = host_memory.choose(setting, predicted_peak_bytes=peak, memory_per_rank_bytes=share)
    if setting == "auto" and env.distributed:  # rank 0 alone holds the prediction: its choice (others send 0)
        chosen = torch.tensor([host_memory.MODES.index(mode) if env.is_main else 0])
        mode = host_memory.MODES[int(all_reduce_max(chosen, env)[0])]
    host_memory.apply(mode)
    if not (setting == "auto" and mode == "predictable" and env.is_main):
        return mode, None
    room = f"{peak / MiB:,.0f} MiB × {host_memory.FAST_HEADROOM} > {share / MiB:,.0f} MiB ({what})" if peak \
        else "no prediction"
    return mode, (f"[toolkit] host memory: predictable ({room}): freed tensors leave the resident set, each new "
                  "one costs page faults; train.host_memory=fast is quicker where memory is not tight")


def start(recipe: Recipe, *, env: DistEnv, plan: BatchPlan, total_steps: int, model, num_params: int,
          out_dir: Path, prediction: dict | None = None, data: dict | None = None) -> RunRecord:
    lm_head = recipe.model.task == "causal-lm"
    info: dict[str, Any] = {
        "status": "running", "strategy": recipe.strategy.name, "world_size": env.world_size,
        "parallel": strategy_degrees(recipe, world_size=env.world_size).as_dict(),  # the degrees it runs at
        "precision": recipe.precision, "total_steps": total_steps,
        "batch": {"micro_batch_size": plan.micro_batch_size, "grad_accum_steps": plan.grad_accum_steps,
                  "global_batch_size": plan.global_batch_size, "data_parallel_ranks": plan.world_size},
        "num_params": num_params,
        "flops": flops_per_token(model.config, num_params=num_params, seq_len=recipe.data.max_length,
                                 lm_head=lm_head),
        "device": device_name(env), "device_type": env.device.type, "versions": versions(),
        "threads_per_rank": torch.get_num_threads(),
        "cpu_matmul_peak": _cpu_peak(recipe, env, model),
        "memory_prediction": prediction,
        "data": data,
        "command": " ".join(sys.argv),
        "launch": launch_identity(),  # a restart of this launch finds its run here (checkpoint.run.after_restart)
    }
    failure = None
    if env.is_main:
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            write_text_whole(out_dir / "recipe.yaml", dump_recipe(recipe))
            _write(info, out_dir)
        except OSError as exc:  # a full disk: one line, and nothing of this run left there (rank.py)
            failure = f"{out_dir} could not be written before the first step ({write_error_text(exc)})"
    if all_reduce_max(torch.tensor([float(failure is not None)]), env).item():  # every rank ends on it alike
        raise OutputWriteError(failure or f"{out_dir} could not be written", before_first_step=True)
    if env.is_main:
        b = info["batch"]
        print(f"[toolkit] strategy {layout_line(recipe, world_size=env.world_size)} · world {env.world_size} · "
              f"{recipe.precision} · "
              f"global batch {b['global_batch_size']} = {plan.world_size} data-parallel rank(s) × micro "
              f"{b['micro_batch_size']} "
              f"× accum {b['grad_accum_steps']} · {total_steps} steps · {num_params / 1e6:.1f}M params · "
              f"{info['device']} · output {out_dir}", file=sys.stderr, flush=True)
    return RunRecord(fields=info, out_dir=out_dir, schedule=schedule_label(recipe.optim))


def record_before_first_step(info: RunRecord, strategy, *, env: DistEnv) -> None:
    """Gradients exist now (after the first backward) and the optimizer has not stepped."""
    forwards, info.block_forwards = info.block_forwards, None
    if forwards is not None:  # this rank's blocks (a pipeline stage's own), every micro-batch of the step
        info["activation_checkpointing"] = {"recompute": info.recompute, **forwards.stop()}
    tensors = strategy.state.state_tensors()
    info.first_backward = {"grads_bytes": storage_bytes(tensors["grads"]), "audit": strategy.state.precision_audit(),
                           "other_live": _other_live(tensors)}


def _other_live(tensors: dict[str, list[torch.Tensor]]) -> dict:
    """What the process holds besides the counted model states, from a census of every live tensor: a
    strategy's buffers (DeepSpeed's buckets, DDP's) that the counters above do not name. Batches are small."""
    counted = {storage_key(t) for group in tensors.values() for t in group if t is not None}
    other = {k: v for k, v in live_tensor_storages().items() if k not in counted}
    largest = sorted(other.values(), reverse=True)[:3]
    return {"bytes": sum(v[0] for v in other.values()),
            "largest": [{"bytes": b, "dtype": d, "numel": n} for b, d, n in largest]}


def record_after_first_step(info: RunRecord, strategy, *, env: DistEnv) -> None:
    """The optimizer has allocated its state now. Collective: gathers every rank's numbers."""
    tensors = strategy.state.state_tensors()
    local, info.first_backward = info.first_backward, None
    assert local is not None  # record_before_first_step ran in this step
    audit_after = strategy.state.precision_audit()
    # grads come from before the step (they are freed after it); masters/optimizer state from after
    audit = {**local["audit"], "master_weights": audit_after["master_weights"],
             "optimizer_state": audit_after["optimizer_state"]}
    audit.setdefault("scheduler", info.schedule)  # the recipe's, unless the strategy ran one of its own
    mine = {"params_bytes": storage_bytes(tensors["params"]), "grads_bytes": local["grads_bytes"],
            "optim_bytes": storage_bytes(tensors["optim"]), "audit": audit, "other_live": local["other_live"]}
    ranks = gather_objects(mine, env)
    info["precision_audit"] = ranks[0]["audit"]
    info["model_state_bytes"] = [{k: r[k] for k in ("params_bytes", "grads_bytes", "optim_bytes")} for r in ranks]
    info["other_live_tensor_bytes"] = [r["other_live"] for r in ranks]  # after the first backward, per rank
    if env.is_main:
        info.write()


def record_lever_state(info: RunRecord, strategy, *, env: DistEnv) -> None:
    """The optimizer's state measured again at the step a communication lever is steady, with what the lever keeps
    beside it: PowerSGD makes its error and factors at its first compressed step, after the first step's count.
    Collective."""
    optim = gather_objects(storage_bytes(strategy.state.state_tensors()["optim"]), env)
    for entry, now in zip(info["model_state_bytes"], optim, strict=True):
        entry["optim_bytes"] = max(entry["optim_bytes"], now)
    if env.is_main:
        info.write()


def record_comm(info: RunRecord, summary: dict, *, step: int, env: DistEnv, shapes: list[tuple[int, ...]]) -> None:
    """Collective input bytes of one step: rank 0's by op, and every rank's total and point-to-point sends
    (a pipeline's stages send different things: activations forward, gradients back), with each rank's
    micro-batch shapes (samples, padded length) in that step. Collective."""
    ranks = gather_objects({"total_bytes": summary["total_bytes"], "shapes": [list(s) for s in shapes],
                            "send_bytes": summary["bytes_by_op"].get("send", 0)}, env)
    info["comm_per_step"] = {"step": step, **summary,
                             "total_bytes_per_rank": [r["total_bytes"] for r in ranks],
                             "micro_batch_shapes_per_rank": [r["shapes"] for r in ranks],
                             "p2p_send_bytes_all_ranks": sum(r["send_bytes"] for r in ranks),
                             "counts": "input bytes handed to c10d collectives and sends (not wire bytes)"}


def note_drift(info: RunRecord, record: dict) -> None:
    """run.json's summary of local SGD's replica drift (each step's is in metrics.jsonl): the largest the replica
    check measured between syncs, the largest just before a sync, and how many syncs were checked equal."""
    if "replica_drift" not in info.fields:
        info["replica_drift"] = {"largest_max_abs": 0.0, "largest_relative_norm": 0.0, "largest_before_sync": 0.0,
                                 "syncs": 0, "checked_equal": 0}
    seen = info["replica_drift"]
    measured = record.get("replica_drift")
    if measured is not None:
        seen["largest_max_abs"] = max(seen["largest_max_abs"], measured["max_abs"])
        seen["largest_relative_norm"] = max(seen["largest_relative_norm"], measured["relative_norm"])
    before = record.get("replica_drift_before_sync")
    if before is not None:
        seen["syncs"] += 1
        seen["largest_before_sync"] = max(seen["largest_before_sync"], before)
        seen["checked_equal"] += measured is not None  # the replica check ran after it, and found them equal


def finish(info: RunRecord, *, env: DistEnv, out_dir: Path, losses: list[float], strategy, skips: SkippedSteps) -> None:
    mine = {"peak_mem_bytes": peak_memory_bytes(env.device), "peak_reserved_bytes": peak_reserved_bytes(env.device),
            "setup_peak_bytes": info.setup_peak, "longest_micro_batch_tokens": info.longest_tokens}
    info["peak_memory"] = gather_objects(mine, env)
    measured = idle_over_span(gather_objects(strategy.report().measurements, env))
    if any(measured):
        info["strategy_measurements"] = measured  # per rank
    info["status"] = "completed"
    info["final_loss"] = losses[-1] if losses else None
    info["skipped_steps"] = skips.summary()
    if env.is_main:
        _write(info.fields, out_dir)
        adapter = (out_dir / "model" / "adapter_config.json").is_file()  # LoRA: the export is peft's adapter
        model = f"{'adapter' if adapter else 'model'} {out_dir / 'model'} ({_disk(out_dir / 'model')})"
        if adapter and (out_dir / "model-merged").is_dir():
            model += f" · merged model {out_dir / 'model-merged'} ({_disk(out_dir / 'model-merged')})"
        if (out_dir / "checkpoints").is_dir():  # what resuming costs on disk (checkpoint.keep_last, .final)
            model += f" · checkpoints {out_dir / 'checkpoints'} ({_disk(out_dir / 'checkpoints')})"
        if info.get("final_checkpoint_skipped"):
            model += f" · {info['final_checkpoint_skipped']}"
        skipped = f"{skips.note()} · " if skips.note() else ""  # first: a run that trained on few steps says so
        evaluated = info.get("final_eval") or {}
        if evaluated:
            skipped += "final " + ", ".join(f"{key} {value:.4f}" if abs(value) < 1000 else
                                            f"{key} {value:,.0f}" if abs(value) < 1e9 else f"{key} {value:.3g}"
                                            for key, value in evaluated.items()) + " · "
        print(f"[toolkit] done: {skipped}metrics {out_dir / 'metrics.jsonl'} · {model} · run info "
              f"{out_dir / 'run.json'}", file=sys.stderr, flush=True)


def _disk(folder: Path) -> str:
    """What the files under `folder` take on disk, in MB."""
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    return f"{size / 1e6:,.0f} MB" if size >= 1e6 else f"{size / 1e3:,.0f} kB"


@contextlib.contextmanager
def ending(info: RunRecord, *, env: DistEnv, out_dir: Path, skips: SkippedSteps) -> Iterator[None]:
    """Around a started run: when it ends other than completing (finish writes "completed"), rank 0 rewrites
    run.json's "running" as it goes: "stopped" (a stop signal, a non-finite value) or "failed" (an exception),
    and `ended` says why (ended_record). Best effort: a process killed outright writes nothing, and a write
    that fails is passed over, so the run's own error is what is reported. No collective: ranks may be gone."""
    try:
        yield
    except BaseException as exc:
        if env.is_main and info.get("status") == "running":
            with contextlib.suppress(Exception):
                _write({**info.fields, **ended_record(info, exc, out_dir=out_dir, skips=skips, env=env)}, out_dir)
        raise


def ended_record(info: RunRecord, exc: BaseException, *, out_dir: Path, skips: SkippedSteps, env: DistEnv) -> dict:
    """run.json's status, ended and skipped_steps for a run that `exc` ended. ended: the reason in one line,
    steps_done (the last step metrics.jsonl holds) and the newest complete checkpoint (or null); a stop signal
    adds the signal and resumable (its checkpoint is of steps_done); a non-finite value what, value and step
    (and skipped_from, under train.on_nonfinite skip); a failure the error (a checkpoint not written: its step;
    another rank's process gone: peer_lost, and the launcher that knows which rank and how rewrites the reason)."""
    found = complete_checkpoints(out_dir)
    ended: dict[str, Any] = {"reason": "", "steps_done": info.last_step,
                             "checkpoint": str(found[-1]) if found else None}
    status = "stopped"
    if isinstance(exc, Stopped):
        name = signal.Signals(exc.signum).name
        ended.update(reason=f"interrupted at step {exc.step} of {exc.total}" if exc.signum == signal.SIGINT
                     else f"stopped by {exc}", signal=name, checkpoint=str(exc.checkpoint), resumable=True)
    elif isinstance(exc, NonFinite):
        ended.update(reason=str(exc), what=exc.what, value=repr(float(exc.value)), step=exc.step)
        if exc.skipped_from is not None:
            ended["skipped_from"] = exc.skipped_from
    elif isinstance(exc, KeyboardInterrupt):  # a second Ctrl-C: out at once, without a checkpoint
        ended["reason"] = "interrupted (a second Ctrl-C: no checkpoint written)"
    elif isinstance(exc, (CheckpointWriteError, OutputWriteError)):  # the whole line (first_line would cut it)
        status = "failed"
        ended.update(reason=str(exc), error=type(exc).__name__, step=exc.step)
    elif peer_lost(exc, env):
        status = "failed"
        ended.update(reason=f"another rank left the run ({first_line(exc)})", error=type(exc).__name__,
                     peer_lost=True)
    else:
        status = "failed"
        ended.update(reason=f"{type(exc).__name__}: {first_line(exc)}", error=type(exc).__name__)
    return {"status": status, "ended": ended, "skipped_steps": skips.summary()}


def mark_left_running(out_dir: Path, *, reason: str, stopped_by: str | None = None) -> bool:
    """After every rank is gone (the launcher's last word): a run.json still "running" (rank 0 was killed outright,
    SIGKILL or the out-of-memory killer, or stopped by its launcher before it could write) becomes "failed", ended
    with `reason`, the last step metrics.jsonl holds and the newest complete checkpoint. `stopped_by`: the stop
    signal the launcher forwarded before it killed the ranks: "stopped" with that signal, resumable where a
    checkpoint is. True when rewritten."""
    info = read_run_info(out_dir)
    if info is None or info.get("status") != "running":
        return False
    steps = 0
    with contextlib.suppress(OSError):
        for line in (out_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines():
            with contextlib.suppress(ValueError, TypeError):
                steps = max(steps, int(json.loads(line)["step"]))
    found = complete_checkpoints(out_dir)
    ended: dict[str, Any] = {"reason": reason, "steps_done": steps, "checkpoint": str(found[-1]) if found else None}
    if stopped_by is not None:
        ended.update(signal=stopped_by, resumable=bool(found))
    info.update(status="failed" if stopped_by is None else "stopped", ended=ended)
    return _rewrite(info, out_dir)


def name_failed_rank(out_dir: Path, *, reason: str) -> bool:
    """After every rank is gone: a failed run.json whose rank 0 saw only a peer's connection close (peer_lost)
    takes the launcher's `reason`, which names the rank that failed and how; rank 0's own words stay beside it."""
    info = read_run_info(out_dir)
    ended = (info or {}).get("ended") or {}
    if info is None or info.get("status") != "failed" or not ended.get("peer_lost"):
        return False
    info["ended"] = {**ended, "reason": reason, "rank_0_saw": ended.get("reason")}
    return _rewrite(info, out_dir)


def _rewrite(info: dict, out_dir: Path) -> bool:
    with contextlib.suppress(OSError):  # best effort, as `ending`: the launch's own line is what is reported
        _write(info, out_dir)
        return True
    return False


def _write(info: dict, out_dir: Path) -> None:
    """run.json, whole (atomic) and strict JSON: a non-finite number is null, named in "nonfinite". Where the disk
    has no room for a new copy (ENOSPC, EDQUOT; EFBIG under a file size limit), which is how a checkpoint or
    metrics.jsonl fails there too: the same record in compact JSON over the old file's own bytes, where it fits in
    them, so that no new block is needed and a run that ends on a full disk does not stay "running". Not atomic:
    a reader at that instant may find it cut short, which every reader takes as a run that did not complete
    (read_run_info). Else the OSError of the whole write."""
    path, record = out_dir / "run.json", strict_json(info)
    try:
        write_text_whole(path, json.dumps(record, indent=2, allow_nan=False))
    except OSError as exc:
        if exc.errno not in NO_ROOM or not path.is_file():
            raise
        data = (json.dumps(record, separators=(",", ":"), allow_nan=False) + "\n").encode()
        with open(path, "r+b") as handle:
            if len(data) > _room(os.fstat(handle.fileno())):
                raise
            handle.write(data)
            handle.truncate()


def _room(stat: os.stat_result) -> int:
    """The bytes a file can hold without a new block of its disk: its size, or the blocks it has (a file takes
    whole blocks), within this process's file size limit (ulimit -f)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    held = stat.st_blocks * 512
    return max(stat.st_size, held if soft == resource.RLIM_INFINITY else min(held, soft))
