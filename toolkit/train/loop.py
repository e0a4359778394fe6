"""The one training loop. It never names a strategy: everything parallel is behind `strategy`.

Per optimizer step:
  1. fetch this rank's grad_accum_steps micro-batches (the global batch is fixed by seed + step)
  2. all-reduce the loss-term count of the whole global batch, so every micro-batch's loss is
     normalised by it (accumulating 4×2 gives exactly one batch of 8, padding included)
  3. forward + backward each micro-batch; gradient reduction only on the last one
  4. clip + optimizer step + schedule (strategy.step)
  5. log: the global-batch mean loss, grad norm, tokens/s, peak memory
"""

from __future__ import annotations

import functools
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from toolkit.checkpoint import run as checkpoints, store
from toolkit.checkpoint.loading import ModelSource, num_parameters, own_memory, whole_parameters
from toolkit.checkpoint.run import Resume
from toolkit.checkpoint.schedule import data_changes, schedule_changes
from toolkit.config.parallel import resolve
from toolkit.config.recipe import BatchPlan, Recipe
from toolkit.data.losses import TILED, forward_loss_sum
from toolkit.data.splits import Collator, DataLayout, train_loader
from toolkit.model.blocks import BlockForwards, layer_stack
from toolkit.model.build import padding_id
from toolkit.observe.routing import RoutingCounter, spread
from toolkit.model.export import export_model
from toolkit.observe import profiling, tracking
from toolkit.observe.comm import CollectiveCounter, count_step, counting
from toolkit.observe.consistency import check_groups, check_replicas, drift
from toolkit.observe.gradient_scale import GradientScale
from toolkit.observe.metrics import (Progress, compile_graph_breaks, compile_seconds, peak_memory_bytes,
                                     synchronize)
from toolkit.process import faults
from toolkit.process.dist import DistEnv, all_reduce_max, all_reduce_sum, restart_count
from toolkit.process.stopping import (NonFinite, OutputWriteError, SkippedSteps, StopSignals, Stopped,
                                      write_error_text)
from toolkit.plan.predict import run_base_bytes
from toolkit.strategies import import_runtime_modules, strategy_degrees
from toolkit.strategies.pipeline.timing import pin_block_time, steps_length
from toolkit.strategies.base import ROUTER_LOSS, Replicas, SetupArgs, Strategy
from toolkit.strategies.dims import compression
from toolkit.strategies.optim.adamw import build_adamw, build_scheduler
from toolkit.train import runinfo
from toolkit.train.evaluate import evaluate
from toolkit.train.prepare import prepare


@dataclass
class TrainResult:
    output_dir: Path
    strategy: Strategy
    losses: list[float]


def run_microbatches(strategy: Strategy, micro_batches: list[dict], *, task: str, env: DistEnv,
                     layout: DataLayout) -> tuple[float, dict]:
    """Forward/backward every micro-batch of one optimizer step; returns the global mean loss + counts."""
    counts = torch.tensor([sum(b["num_items"] for b in micro_batches), sum(b["num_tokens"] for b in micro_batches),
                           sum(len(b["input_ids"]) for b in micro_batches)], dtype=torch.float64)
    all_reduce_sum(counts, env)  # one tiny collective: the denominator of the global-batch mean
    counts /= env.world_size // layout.size  # ranks that read the same shard (a pipeline's stages) counted it alike
    num_items = counts[0].item()
    # Each micro-batch's loss sum over the global count is its share of the global-batch mean: summed over
    # every shard's shares, the gradients are those of that mean. A reduction that averages over the data
    # shards divides by their number, so the shares are multiplied by it first.
    scale = layout.size if strategy.info.averages_gradients else 1

    def loss_sum(logits: torch.Tensor, batch: dict) -> torch.Tensor:
        total = forward_loss_sum(logits, batch, task)
        router = batch.pop(ROUTER_LOSS, None)
        if router is not None:  # a MoE router's loss, weighted like its micro-batch's share of the global mean
            total = total + router.to(total.device) * batch["num_items"]
        return total

    local = strategy.forward_backward(micro_batches, loss_sum=loss_sum, share=lambda s: s / num_items * scale)
    total = all_reduce_sum(local.to(env.device), env).item()  # device sync: once per step, for the logged loss
    return total / num_items, {"items": int(num_items), "tokens": int(counts[1]), "samples": int(counts[2])}


def setup_strategy(strategy: Strategy, model, *, source: ModelSource, env: DistEnv, plan, total_steps: int) -> None:
    """`strategy` wrapped around `model` (built by strategy.build_model), with the recipe's AdamW and schedule."""
    recipe = source.recipe
    strategy.setup(model, SetupArgs(
        recipe=recipe, env=env, grad_accum_steps=plan.grad_accum_steps, total_steps=total_steps,
        build_optimizer=functools.partial(build_adamw, config=recipe.optim),
        build_scheduler=lambda o: build_scheduler(o, config=recipe.optim, total_steps=total_steps), source=source))


def announce_schedule_changes(recipe: Recipe, checkpoint, *, env: DistEnv, total_steps: int,
                              train_data: dict) -> None:
    """Rank 0: one line where the resumed schedule (always this recipe's) differs from the checkpoint's run, and
    one where the train split does (`train_data`: its samples and tokens)."""
    if not env.is_main:
        return
    manifest = checkpoint.manifest
    changes = schedule_changes(recipe, checkpoint.path, total_steps=total_steps,
                               saved_total_steps=manifest.get("total_steps"),
                               saved_state=manifest["extra"].get("scheduler") or {})
    if changes:
        print(f"[toolkit] resume: the lr schedule follows this recipe ({'; '.join(changes)})",
              file=sys.stderr, flush=True)
    data = data_changes(manifest, train_data)
    if data:
        print(f"[toolkit] resume: data.train is not the split the checkpoint's run read ({data}): the steps from "
              "here read its samples in another order than that run would have, some again and some not at all "
              "this epoch; resume with the same data to continue that order", file=sys.stderr, flush=True)


def train(recipe: Recipe, env: DistEnv, *, resume: Resume | None = None) -> TrainResult:
    try:
        return _train(recipe, env, resume=resume)
    finally:  # a resumed checkpoint still held where the run ended before it was read (its process may go on)
        store.done_reading()


def _train(recipe: Recipe, env: DistEnv, *, resume: Resume | None) -> TrainResult:
    recipe = resolve(recipe, world_size=env.world_size)  # parallel degrees -> their preset: one form from here on
    prepared = prepare(recipe, env)
    plan, layout, strategy, tokenizer = prepared.plan, prepared.layout, prepared.strategy, prepared.tokenizer
    total_steps, notes = prepared.total_steps, prepared.notes
    import_runtime_modules(recipe)  # DeepSpeed's 51-105 MiB: part of the runtime, as toolkit plan counts it
    # what the process holds before any model, with the model's code and the data reader's: as toolkit plan's
    runtime_bytes = run_base_bytes(recipe)
    # before anything below, so no rank can have written into output_dir yet (collective)
    checkpoint = checkpoints.starting_point(recipe, resume, plan=plan, total_steps=total_steps, env=env)
    # strategy.split_by time: the ratio the split weights blocks by (a resumed run's, else measured), before the
    # memory prediction uses it
    recipe = pin_block_time(recipe, env=env, length=lambda: steps_length(
        prepared.train_ds, prepared.sampler, max_length=recipe.data.max_length),
        resumed=checkpoint.path if checkpoint is not None else None)
    # warns before setup if too big; a resumed run's weights come from its checkpoint
    prediction = runinfo.predict_memory(recipe, env, runtime_bytes=runtime_bytes, resuming=checkpoint is not None)
    host_memory, host_note = runinfo.set_host_memory(recipe, env, prediction=prediction)  # CPU: fast or predictable
    notes += [host_note] if host_note else []
    source = ModelSource(recipe=recipe, tokenizer=tokenizer, checkpoint=checkpoint.path if checkpoint else None)
    model = strategy.build_model(source, env=env)  # whole, or empty / partitioned under low-memory loading
    check_replicas(whole_parameters(model), env, when="at start (before setup)")
    num_params = num_parameters(model)
    # the blocks' forwards in the first step: twice per micro-batch shows the recomputation happened. Not under
    # train.compile: the counting hooks would run inside the compiled checkpoint, where dynamo refuses a side
    # effect and falls back to eager for the whole block (measured: no compile at all, step as slow as eager)
    counted = recipe.train.activation_checkpointing and not recipe.train.compile
    block_classes = {type(block) for block in layer_stack(model, guess=True)} if counted else set()
    setup_strategy(strategy, model, source=source, env=env, plan=plan, total_steps=total_steps)
    # the blocks this rank holds once set up (a pipeline stage's own, in its copy of the model)
    forwards = BlockForwards.among(strategy.model, block_classes) if counted else None
    # the strategy holds what it kept; what it dropped (a pipeline's other stages and head) goes, and what it kept
    # as loaded lets go of the weight file, whose pages of the dropped weights would otherwise stay resident
    del model
    own_memory(strategy.model)
    setup_peak = peak_memory_bytes(env.device)  # the build, load and setup: what the plan's setup peak predicts
    # transformers returns models in eval mode: dropout and activation checkpointing act in train mode only
    # (before this, training ran without dropout until the first evaluation switched the model back)
    strategy.model.train()
    done, tokens_seen = 0, 0
    train_data = {key: prepared.data_info["train"][key] for key in ("samples", "tokens")}
    weights_only = bool(resume and resume.weights_only)
    if checkpoint is not None:
        done = checkpoints.restore(strategy, checkpoint, weights_only=weights_only, env=env, total_steps=total_steps)
        announce_schedule_changes(recipe, checkpoint, env=env, total_steps=total_steps, train_data=train_data)
        tokens_seen = int(checkpoint.manifest.get("tokens_seen", 0))
        rng = checkpoints.read_rng(checkpoint, env=env)
        faults.before_letting_go_of_checkpoint(env)
        store.done_reading()  # every byte it gives is read: its run's keep_last may remove it from here
    out_dir = Path(recipe.output_dir)
    info = runinfo.start(recipe, env=env, plan=plan, total_steps=total_steps, model=strategy.state.export_module(),
                         num_params=num_params, out_dir=out_dir, prediction=prediction, data=prepared.data_info)
    info["host_memory"] = host_memory
    info.setup_peak = setup_peak
    info.last_step = done
    skips = SkippedSteps(recipe.train.max_consecutive_skips, done=done)
    # rank 0: run.json's status stopped or failed when the run ends otherwise than completing
    with runinfo.ending(info, env=env, out_dir=out_dir, skips=skips):
        info.block_forwards, info.recompute = forwards, recipe.train.recompute
        if checkpoint is not None:
            info["resumed_from"] = {"checkpoint": str(checkpoint.path), "step": done,
                                    "weights_only": weights_only}
        if restarts := restart_count():  # torch's agent restarted the ranks after one failed (--max-restarts)
            info["restarts"] = restarts
        said = strategy.report()
        info["layout"] = said.layout
        fallback = said.fallback
        if fallback is not None:  # what ran is not what the recipe names: a report flags it
            info["fallback"] = fallback
        if env.is_main:
            print(f"[toolkit] layout: {info['layout']}", file=sys.stderr, flush=True)
            if fallback is not None:
                print(f"[toolkit] warning: {fallback}", file=sys.stderr, flush=True)
            for note in notes:  # said once the run goes ahead: a user's mistake found before stays one line
                print(note, file=sys.stderr, flush=True)
        if prepared.label_names is not None:  # named labels: their class ids, in the exported config
            name_labels(strategy.state.export_module(), prepared.label_names, info=info, env=env)
        replicas = announce_replica_check(strategy, recipe=recipe, env=env, info=info)
        collator = Collator(pad_token_id=padding_id(tokenizer), task=recipe.model.task)
        loader = iter(train_loader(prepared.train_ds, sampler=prepared.sampler, start=done, stop=total_steps,
                                   collator=collator, data=recipe.data))  # a function of seed + step: resumes exactly
        if env.is_main:
            checkpoints.continue_metrics(out_dir, done_steps=done)
        # rank 0: metrics.jsonl and the trackers of train.report_to, closed however the run ends
        with tracking.metrics_log(recipe, out_dir=out_dir, done_steps=done, main=env.is_main) as writer:
            progress = Progress(total=total_steps, enabled=env.is_main and recipe.train.progress,
                                log_every=recipe.train.log_every)
            scale = GradientScale() if recipe.train.record_gradient_scale else None
            saver = checkpoints.Saver(recipe, env=env, plan=plan, total_steps=total_steps, tokenizer=tokenizer,
                                      done_steps=done, tokens_seen=tokens_seen, train_data=train_data)
            signals = StopSignals().install()
            profiler = profiling.StepProfiler(recipe, env=env, out_dir=out_dir, done=done)
            if checkpoint is not None:  # last before the first step: nothing draws from the restored generator
                checkpoints.restore_rng(rng, env=env)
            try:
                parts = StepParts(recipe=recipe, env=env, plan=plan, layout=layout, total_steps=total_steps, info=info,
                                  eval_ds=prepared.eval_ds, collator=collator, saver=saver, writer=writer,
                                  progress=progress, scale=scale, replicas=replicas, signals=signals,
                                  profiler=profiler, skips=skips, routing=RoutingCounter.among(
                                      strategy.state.export_module(), copies=strategy_degrees(
                                          recipe, world_size=env.world_size).tp))
                losses = run_steps(strategy, loader, parts, done=done)
                saver.close()  # an async checkpoint still being written is committed before the run ends
                if saver.final_skipped:  # checkpoint.final null on a quick run: the done line says it
                    info["final_checkpoint_skipped"] = saver.final_skipped
            except (Stopped, NonFinite, OutputWriteError):  # every rank alike: a checkpoint in flight is a good one
                saver.close()
                raise
            finally:
                signals.restore()
                profiler.close()  # a run that ended inside the window keeps what was recorded
                if profiler.written:
                    info["profile"] = {"steps": profiler.recorded, "folder": str(out_dir / "profile")}
            progress.close()
            try:
                export_model(strategy, tokenizer=tokenizer, out_dir=out_dir, env=env, lora=recipe.model.lora,
                             task=recipe.model.task)
            except OutputWriteError as exc:  # its line says which steps a resume trains again
                exc.last_step = total_steps
                raise
            if scale is not None:
                info["gradient_scale"] = scale.summary()
            if writer is not None and writer.switched_off:
                info["trackers_switched_off"] = writer.switched_off
            runinfo.finish(info, env=env, out_dir=out_dir, losses=losses, strategy=strategy, skips=skips)
    return TrainResult(output_dir=out_dir, strategy=strategy, losses=losses)


@dataclass(frozen=True, kw_only=True)
class StepParts:
    """What run_steps drives besides the strategy: the run's settings and the parts that record and end it."""

    recipe: Recipe
    env: DistEnv
    plan: BatchPlan
    layout: DataLayout  # this rank's shard of every global batch
    total_steps: int
    info: runinfo.RunRecord
    eval_ds: Any | None  # the tokenized eval split, None without data.eval
    collator: Collator
    saver: checkpoints.Saver
    writer: Any | None  # rank 0's metrics log and trackers (tracking.metrics_log), None on the other ranks
    progress: Progress
    scale: GradientScale | None  # train.record_gradient_scale
    replicas: list[Replicas]  # what the replica check compares (announce_replica_check)
    signals: StopSignals
    profiler: profiling.StepProfiler
    skips: SkippedSteps
    routing: RoutingCounter | None  # a mixture-of-experts model's tokens per expert, None for a dense one


def run_steps(strategy: Strategy, loader, parts: StepParts, *, done: int) -> list[float]:
    """Steps done+1 .. total_steps: train, evaluate, check replicas, checkpoint, log; stop after a step when
    any rank got a stop signal (a checkpoint first), or at the train.max_consecutive_skips-th non-finite step
    skipped in a row (once it is logged)."""
    recipe, env, info, saver, profiler = parts.recipe, parts.env, parts.info, parts.saver, parts.profiler
    losses = []
    steady = compression.first_steady_step(recipe)
    comm_step = count_step(done=done, total_steps=parts.total_steps, profiled=recipe.train.profile_steps,
                           steady_from=steady)
    for step in range(done + 1, parts.total_steps + 1):
        micro_batches = [next(loader) for _ in range(parts.plan.grad_accum_steps)]
        if recipe.train.tiled_loss:  # each micro-batch's loss in tiles of its tokens (strategies/base.py logits_of)
            for batch in micro_batches:
                batch[TILED] = True
        profiler.before(step)
        if parts.routing is not None:
            parts.routing.reset()  # the step's own forwards, not the last evaluation's
        record = train_step(strategy, micro_batches, recipe=recipe, env=env, layout=parts.layout, step=step,
                            info=info, count_comm=step == comm_step, gradient_scale=parts.scale,
                            first=step == done + 1, before_update=saver.before_update)
        if step == steady > done + 1:  # a lever's state made after the first step (PowerSGD's first compressed)
            runinfo.record_lever_state(info, strategy, env=env)
        if parts.routing is not None:  # collective: every rank, every step
            record["expert_tokens"] = parts.routing.take(env)
            record["expert_spread"] = spread(record["expert_tokens"])
            info["experts"] = parts.routing.summary()
        if profiler.covers(step):
            record["profiled"] = True
        profiler.after(step)
        saver.tokens_seen += record["tokens"]
        if "compile_s" in record:  # run.json: the compile time of the whole run, apart from the steps'
            info["compile_s"] = info.get("compile_s", 0.0) + record["compile_s"]
        if recipe.train.compile:
            note_graph_breaks(info, first=step == done + 1, env=env)
        every = recipe.train.eval_every
        if parts.eval_ds is not None and ((every and step % every == 0) or step == parts.total_steps):
            evaluated = evaluate(strategy, parts.eval_ds, collator=parts.collator, recipe=recipe, env=env,
                                 layout=parts.layout, group=parts.plan.grad_accum_steps)
            record.update(evaluated)
            if step == parts.total_steps:  # the exported model's: in run.json and the run's last line
                info["final_eval"] = evaluated
        check_every = recipe.train.consistency_check_every
        if parts.replicas and check_every and step % check_every == 0:
            fresh = strategy.state.replicas()  # the live tensors of this step
            assert len(fresh) == len(parts.replicas)  # what a strategy had replicated at start it has now
            # local SGD between syncs: replicas apart by design, by how much is measured (every rank alike)
            apart = [each for each in fresh if each.synced is not None and not each.synced()]
            if apart:
                record["replica_drift"] = drift(apart[0].named, env, apart[0].group)
            # one collective per group, in the same order on the ranks of each group; a drift stops every rank
            check_groups([(each.named, each.group) for each in fresh if not any(each is a for a in apart)], env,
                         when=f"at step {step}")
            if any(each.synced is not None for each in fresh) and not apart:
                record["replica_drift"] = {"max_abs": 0.0, "relative_norm": 0.0}  # a sync: checked equal above
        losses.append(record["loss"])
        unrecoverable = parts.skips.count(record)  # every rank alike: the loss and the norm are global
        if "replica_drift" in record or "replica_drift_before_sync" in record:
            runinfo.note_drift(info, record)
        if saver.due(step):
            record["checkpoint_s"] = saver.save(strategy, step=step)  # outside step_time_s
        if parts.writer:
            try:
                faults.before_metrics_write(step, parts.writer.jsonl.file)  # tests only: a full disk
                parts.writer.write(record)
            except OSError as exc:  # a full disk, a file made read-only: every rank stops after this step (below)
                parts.signals.write_failure = (f"{parts.writer.jsonl.path} could not be written at step {step} "
                                               f"({write_error_text(exc)})")
        info.last_step = step  # before anything else can fail: run.json's steps_done is what metrics.jsonl holds
        parts.progress.update(record)
        if unrecoverable is not None:
            raise unrecoverable
        faults.after_step(step, env, out_dir=Path(parts.recipe.output_dir))  # tests only: a killed rank, a full disk
        # every rank alike: all stop after this same step, or all write checkpoint.every_minutes' checkpoint
        signum, clock_due, write_failed = parts.signals.agree(env, checkpoint_due=saver.clock_due(step))
        # a stop signal, or metrics.jsonl unwritable (the steps from here would have no record): every rank stops,
        # the weights kept in a checkpoint of this step
        if write_failed or (signum and step < parts.total_steps):
            if saver.last_step != step:
                saver.save(strategy, step=step, wait=True)
            if write_failed:
                raise OutputWriteError(parts.signals.write_failure or "metrics.jsonl could not be written",
                                       step=step)
            raise Stopped(signum, step, parts.total_steps, saver.last_path)
        if clock_due and saver.last_step != step:  # after this step's metrics line: what it held goes in run.json
            held = saver.save(strategy, step=step)
            clock = info.get("clock_checkpoints") or {"count": 0, "held_s": 0.0}
            info["clock_checkpoints"] = {"count": clock["count"] + 1, "held_s": clock["held_s"] + held}
    return losses


def note_graph_breaks(info: runinfo.RunRecord, *, first: bool, env: DistEnv) -> None:
    """run.json's compile_graph_breaks (this rank's count so far, by reason), said once on rank 0 after the
    first step: a break inside a block leaves it eager, so the compile costs time and gains nothing there."""
    breaks = compile_graph_breaks()
    info["compile_graph_breaks"] = {"total": sum(breaks.values()), "reasons": breaks}
    if first and breaks and env.is_main:
        reason = max(breaks, key=lambda r: breaks[r]).splitlines()[0][:160]
        print(f"[toolkit] train.compile: {sum(breaks.values())} graph break(s) in the first step, the code around "
              f"them runs eager (most frequent: {reason})", file=sys.stderr, flush=True)


def step_compile_seconds(before_s: float, env: DistEnv) -> float:
    """Collective: the most seconds any rank compiled in this step (every rank's step waited for it: a
    pipeline's stages compile different blocks)."""
    spent = torch.tensor([compile_seconds() - before_s], dtype=torch.float64)
    return float(all_reduce_max(spent, env)[0])


def name_labels(module, names: list[str], *, info: runinfo.RunRecord, env: DistEnv) -> None:
    """data.train's label names (a name's position is its class id: model.path's id2label order where it names
    these labels, else sorted) into the model config's
    id2label / label2id, which every export and checkpoint writes; said once and kept in run.json."""
    module.config.id2label = dict(enumerate(names))
    module.config.label2id = {name: index for index, name in enumerate(names)}
    info["labels"] = names
    if env.is_main:
        mapped = ", ".join(f"{name} → {index}" for index, name in enumerate(names))
        print(f"[toolkit] labels: {mapped} (id2label in the exported config)",
              file=sys.stderr, flush=True)


def announce_replica_check(strategy, *, recipe: Recipe, env: DistEnv, info: runinfo.RunRecord):
    """Say once what the periodic replica check compares, or that there is nothing to compare."""
    every = recipe.train.consistency_check_every
    replicas = strategy.state.replicas()
    if env.world_size == 1:
        text = "one rank: nothing to compare"
    elif not every:
        text = "off (train.consistency_check_every is null); checked once at start"
    elif not replicas:
        text = (f"nothing to compare after setup: {strategy.info.name} on {env.world_size} rank(s) holds no "
                "replicated parameters (checked once at start)")
    else:  # rank 0's groups (it writes run.json); a pipeline's other stages check theirs alike
        text = f"every {every} step(s): " + "; ".join(
            f"{each.description}, {len(each.named)} tensor{'s' if len(each.named) != 1 else ''}" for each in replicas)
    info["replica_check"] = text
    if env.is_main and every:
        print(f"[toolkit] replica check: {text}", file=sys.stderr, flush=True)
    return replicas


def train_step(strategy: Strategy, micro_batches: list[dict], *, recipe: Recipe, env: DistEnv, layout: DataLayout,
               step: int, info: runinfo.RunRecord, count_comm: bool, gradient_scale: GradientScale | None, first: bool,
               before_update: Callable[[], float] = lambda: 0.0) -> dict:
    """One optimizer step. `before_update` waits for what must not change under the update (an async
    checkpoint's copy of the weights); its seconds are the checkpoint's, not the step's."""
    synchronize(env.device)
    start = time.perf_counter()
    compiled_s = compile_seconds() if recipe.train.compile else 0.0
    lr = strategy.lr()
    comm = CollectiveCounter() if count_comm else None
    with counting(comm):
        loss, counts = run_microbatches(strategy, micro_batches, task=recipe.model.task, env=env, layout=layout)
        if first:
            runinfo.record_before_first_step(info, strategy, env=env)  # local reads only, no collective
    # each padded to its longest sample: compare predicts the peak again at the longest (toolkit/compare/predictions)
    info.longest_tokens = max(info.longest_tokens, *(int(b["input_ids"].shape[1]) for b in micro_batches))
    probe_s, abs_max = 0.0, None
    if gradient_scale is not None:  # outside the collective count and the step time: a measurement aid
        probe_start = time.perf_counter()
        abs_max = strategy.state.gradient_abs_max()
        probe_s = time.perf_counter() - probe_start
    stop_on_nonfinite = recipe.train.on_nonfinite == "stop"
    held_s = before_update()
    loss = faults.step_loss(step, loss)  # tests only: a non-finite loss
    if math.isfinite(loss):
        faults.before_update(step, strategy.model)  # tests only: an fp16 overflow
        with counting(comm):
            result = strategy.step(max_grad_norm=recipe.optim.max_grad_norm)
    elif stop_on_nonfinite:  # before the update: no weight, no checkpoint holds it
        raise NonFinite("loss", loss, step)
    else:
        result = strategy.discard_step()
    # a finite loss with non-finite gradients (fp16 loss scaling handles its own overflows): the torch
    # strategies skipped the update (precision.Amp); stop before any checkpoint can hold it
    if stop_on_nonfinite and result.nonfinite:
        raise NonFinite("gradient norm", result.grad_norm, step)
    if gradient_scale is not None and abs_max is not None and not result.skipped:
        gradient_scale.update(abs_max, grad_norm=result.grad_norm)
    if comm is not None:  # with each micro-batch's (samples, padded length): what the prediction is taken for
        shapes = [tuple(b["input_ids"].shape[:2]) for b in micro_batches]
        runinfo.record_comm(info, comm.summary(), step=step, env=env, shapes=shapes)
    if first:
        runinfo.record_after_first_step(info, strategy, env=env)
    synchronize(env.device)
    compile_s = step_compile_seconds(compiled_s, env) if recipe.train.compile else 0.0
    step_time_s = time.perf_counter() - start - probe_s - held_s - compile_s
    return {"step": step, "loss": loss, "lr": lr, "grad_norm": result.grad_norm,
            "tokens": counts["tokens"], "samples": counts["samples"], "loss_items": counts["items"],
            "tokens_per_s": counts["tokens"] / step_time_s, "samples_per_s": counts["samples"] / step_time_s,
            "step_time_s": step_time_s, "peak_mem_bytes": peak_memory_bytes(env.device),
            "loss_scale": result.loss_scale, "skipped": result.skipped,
            # dropped by train.on_nonfinite skip (fp16 loss scaling's own skips are not)
            **({"skipped_nonfinite": True} if result.skipped and result.nonfinite else {}),
            **({"comm_bytes": comm.total_bytes} if comm is not None else {}),
            **({"replica_drift_before_sync": result.drift_before_sync} if result.drift_before_sync is not None
               else {}),
            **({"checkpoint_wait_s": held_s} if held_s else {}), **({"compile_s": compile_s} if compile_s else {})}
