"""The loop's side of checkpoints: where a run starts from, when it saves, and the metrics it continues."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import psutil
import torch

from toolkit.atomic import write_text_whole
from toolkit.checkpoint import digest, state, store
from toolkit.config.recipe import BatchPlan, Recipe
from toolkit.errors import RecipeError
from toolkit.model.build import with_own_dropout
from toolkit.observe.versions import versions
from toolkit.process.dist import DistEnv, all_reduce_max, barrier, restarted
from toolkit.process.orphans import LAUNCHED_AT_ENV


@dataclass(frozen=True)
class Resume:
    """What the command line asked for: --resume [PATH] and --resume-weights-only."""

    path: str | None = None  # None: the newest complete checkpoint in output_dir
    weights_only: bool = False
    continues_launch: bool = False  # a restart of this launch (after_restart): output_dir holds its own run


class NothingToResume(Exception):
    """--resume of a run that completed at the step its recipe ends with: nothing is trained or rewritten (its
    run.json, metrics and export stay as the run left them). The CLI says so in one line and exits 0."""


def starting_point(recipe: Recipe, resume: Resume | None, *, plan: BatchPlan, total_steps: int | None = None,
                   env: DistEnv | None = None) -> store.Checkpoint | None:
    """The checkpoint this run continues, or None for a fresh run into an output_dir that holds none.
    `total_steps`: the run's last step where known (the loop; the launcher knows train.max_steps only).
    `env`: the ranks' (collective), which also compare the files' bytes with their recorded digests."""
    out_dir = Path(recipe.output_dir)
    if resume is None and restarted():  # after_restart found no checkpoint of this launch: from scratch again
        if env is not None and env.is_main:
            print(f"[toolkit] warning: restarted with no complete checkpoint in {out_dir / 'checkpoints'}: "
                  "training again from step 1", file=sys.stderr, flush=True)
        return None
    store.check_output_dir(out_dir, resume=resume is not None)  # also where a resumed run writes elsewhere
    if resume is None:
        return None
    checkpoint = store.find_resume(out_dir, resume.path)
    if env is not None:  # the ranks read it from here until restore: its run's keep_last leaves it until then
        checkpoint = store.hold_for_reading(checkpoint)
    state.saved_keys(checkpoint.path)  # its DCP metadata is readable (a one-line error before any rank starts)
    if env is not None:  # the ranks, each hashing its share; not the launcher too: one pass over the bytes
        digest.check(checkpoint.path, expected=checkpoint.records_digests, env=env)
    saved = checkpoint.manifest.get("global_batch_size")
    if saved != plan.global_batch_size:
        raise RecipeError(f"checkpoint {checkpoint.path} was trained with global batch {saved}, this recipe has "
                          f"{plan.global_batch_size}: the data position would not carry over; set "
                          f"batch.global_batch_size={saved}")
    _check_seed(checkpoint, recipe)
    if not store.holds_checkpoint(out_dir, checkpoint.path) and store.holds_run(out_dir) and \
            not resume.continues_launch:  # a restart's: its first attempt's run, which it continues
        raise RecipeError(f"output_dir {out_dir} holds another run than the one checkpoint {checkpoint.path} "
                          "belongs to: their metrics and checkpoints would mix; continue this checkpoint into "
                          "a new folder with --set output_dir=NEW")
    last = total_steps if total_steps is not None else recipe.train.max_steps
    if last is not None and checkpoint.step > last:
        raise RecipeError(f"checkpoint {checkpoint.path} is at step {checkpoint.step}, past this run's last step "
                          f"{last}: resuming would train nothing and export older weights; set train.max_steps "
                          f"above {checkpoint.step} to train on, or resume an earlier checkpoint")
    if last is not None and checkpoint.step == last and store.completed_run(out_dir, total_steps=last):
        raise NothingToResume(f"[toolkit] nothing to resume: {out_dir} holds the completed run (step {last} of "
                              f"{last}), left as it is; set train.max_steps above {last} to train on")
    return checkpoint


def after_restart(recipe: Recipe, resume: Resume | None, *, env: DistEnv) -> Resume | None:
    """Collective: what the ranks resume, alike (rank 0 decides). On the first attempt, what the command line
    says. torch's agent restarts the ranks (--max-restarts) with the command line they started with, where
    `--resume PATH` would go back to PATH each time: set aside every checkpoint written since, train those steps
    again (with --resume-weights-only, from a fresh optimizer again) or, PATH another run's, be refused in an
    output_dir that now holds this one. So a restart continues from the newest checkpoint this launch wrote
    (launch_identity in its manifest), weights and optimizer state; where it wrote none, from what the command
    line says (without --resume: from step 1, said in starting_point)."""
    if not restarted():
        return resume
    out_dir = Path(recipe.output_dir)
    choice = torch.tensor([-1.0, 0.0], dtype=torch.float64)  # the step to resume (-1: none), output_dir's run ours
    if env.is_main:
        me = launch_identity()
        written = store.complete_checkpoints(out_dir)  # without --resume, all are this launch's
        if resume is not None:  # an output_dir resumed holds older ones too: those this launch wrote
            written = [path for path in written
                       if me is not None and store.read_checkpoint(path).manifest.get("launch") == me]
        choice[0] = store.step_of(written[-1]) if written else -1
        choice[1] = float(me is not None and (store.read_run_info(out_dir) or {}).get("launch") == me)
    choice = all_reduce_max(choice, env)  # the other ranks offer (-1, 0): rank 0's choice
    if choice[0] >= 0:
        return Resume(path=str(store.final_path(out_dir, int(choice[0]))), continues_launch=True)
    return replace(resume, continues_launch=bool(choice[1])) if resume is not None else None


def launch_identity() -> str | None:
    """Which launch this rank belongs to, the same over its restarts and in no other launch (checkpoints and
    run.json record it: after_restart): `toolkit launch`'s start time, which it gives its ranks, else torch's
    agent (torchrun, accelerate launch: the ranks' parent) by its run id and start time. None outside a
    launch."""
    if os.environ.get(LAUNCHED_AT_ENV):
        return f"toolkit launch {os.environ[LAUNCHED_AT_ENV]}"
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    try:
        return f"{os.environ['TORCHELASTIC_RUN_ID']} {psutil.Process(os.getppid()).create_time()}"
    except psutil.Error:
        return None


def _check_seed(checkpoint: store.Checkpoint, recipe: Recipe) -> None:
    """The data position is the step, and the sampler's order a function of seed + step: another seed would
    continue with other samples (as another global batch would)."""
    saved = (store.saved_recipe(checkpoint.path) or {}).get("seed")  # none readable: no seed to compare
    if saved is not None and saved != recipe.seed:
        raise RecipeError(f"checkpoint {checkpoint.path} was trained with seed {saved}, this recipe has seed "
                          f"{recipe.seed}: the data order would not carry over; set seed={saved}")


def restore(strategy, checkpoint: store.Checkpoint, *, weights_only: bool, env: DistEnv, total_steps: int) -> int:
    """After setup: optimizer state, schedule, loss scale (the RNG: restore_rng). Returns the optimizer steps
    already done."""
    if not weights_only:
        strategy.state.load_optimizer_state(state.OptimizerReader(checkpoint.path))
    strategy.state.load_checkpoint_extra(checkpoint.manifest["extra"])
    if not weights_only:  # read only by a strategy that keeps such state (collective: every rank alike)
        strategy.state.load_communication_state(lambda: state.load_communication(
            checkpoint.path, env=env, saved_world=int(checkpoint.manifest["world_size"])))
    if env.is_main:
        m = checkpoint.manifest
        what = "weights (fresh optimizer state)" if weights_only else "weights and optimizer state"
        then = f"continuing at step {m['step'] + 1} of {total_steps}" if m["step"] < total_steps else \
            f"every step of {total_steps} trained: exporting its model"
        print(f"[toolkit] resume: {what} from {checkpoint.path} (step {m['step']}, {m['strategy']} on "
              f"{m['world_size']} rank(s)); {then}", file=sys.stderr, flush=True)
    return checkpoint.step


def read_rng(checkpoint: store.Checkpoint, *, env: DistEnv):
    """This rank's generators' states as the checkpoint holds them, read while it is held (restore_rng sets them)."""
    return state.read_rng(checkpoint.path, env=env, saved_world=int(checkpoint.manifest["world_size"]))


def restore_rng(states, *, env: DistEnv) -> None:
    """Each rank's CPU generator as the checkpoint left it (`read_rng`'s states): the loop's last act before the
    first step, so nothing in between draws from it (the CPU matmul peak measured at start did, and every dropout
    mask after a resume differed from the uninterrupted run's)."""
    state.set_rng(states, env=env)


def continue_metrics(out_dir: Path, *, done_steps: int) -> None:
    """Rank 0, resuming: the run goes on from `done_steps`. metrics.jsonl keeps the steps the checkpoint holds;
    the later steps are run again. Resumed from an earlier checkpoint than the newest, the run branches there:
    the later checkpoints and metrics belong to the steps given up, and are set aside in one folder under
    checkpoints/, said in one line, not deleted (nor counted by keep_last, nor taken by a later --resume)."""
    path = out_dir / "metrics.jsonl"
    read = [line for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    stepped = [(line, step) for line, step in ((line, _step_of_line(line)) for line in read) if step is not None]
    cut = len(read) - len(stepped)  # lines cut short (a full disk, a kill)
    if cut:
        print(f"[toolkit] resume: {cut} line(s) of {path} cut short (no JSON record of a step) left out",
              file=sys.stderr, flush=True)
    kept = [line for line, step in stepped if step <= done_steps]
    later = [line for line, step in stepped if step > done_steps]
    aside = store.set_aside_later(out_dir, done_steps)
    if aside is not None:
        (aside / "metrics.jsonl").write_text("".join(line + "\n" for line in later))
        moved = sorted(p.name for p in aside.iterdir() if p.is_dir())
        exports = [name for name in moved if name in store.EXPORTS]
        also = f", its exported {' and '.join(f'{name}/' for name in exports)}" if exports else ""
        print(f"[toolkit] resume from step {done_steps}: the run had gone further; its later checkpoints "
              f"({', '.join(name for name in moved if name not in exports)}){also} and the metrics of those "
              f"steps are set aside in {aside}", file=sys.stderr, flush=True)
    if later or cut:
        write_text_whole(path, "".join(line + "\n" for line in kept))


def _step_of_line(line: str) -> int | None:
    """A metrics.jsonl line's step (0 for a record without one); None where the line is no JSON object."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record.get("step", 0) if isinstance(record, dict) else None


# checkpoint.final null: a final checkpoint where this run trained at least this long (or continues a checkpoint)
FINAL_AUTO_MIN_S = 600.0


class Saver:
    """Writes the recipe's checkpoints: every `every_steps`, once `every_minutes` passed since the last (clock_due),
    and after the last step."""

    def __init__(self, recipe: Recipe, *, env: DistEnv, plan: BatchPlan, total_steps: int, tokenizer,
                 done_steps: int, tokens_seen: int, train_data: dict | None = None):
        self.recipe, self.env, self.plan, self.total_steps = recipe, env, plan, total_steps
        self.train_data = train_data  # the train split's samples and tokens (data_changes compares a resume's)
        self.tokenizer = tokenizer
        self.config = recipe.checkpoint
        self.done_steps = done_steps  # the step the run started from already has its checkpoint
        self.tokens_seen = tokens_seen
        self.last_step: int | None = None  # the newest checkpoint this run wrote
        self.last_path: Path | None = None
        self.pending: state.PendingSave | None = None  # an async save still being written
        self._writer: state.AsyncWriter | None = None
        self._manifest: dict | None = None
        self.started_s = time.perf_counter()
        self.saved_s = self.started_s  # when this run last wrote a checkpoint (or started)
        self.final_skipped: str | None = None  # why checkpoint.final null wrote no final checkpoint
        if env.is_main:  # (a stop signal saves even when the recipe asks for no checkpoint)
            store.remove_partials(Path(recipe.output_dir))
        barrier(env)  # once, so that no save needs a barrier before its ranks write

    def due(self, step: int) -> bool:
        if step <= self.done_steps:
            return False
        every = self.config.every_steps
        return bool(every and step % every == 0) or (step == self.total_steps and self._final())

    def clock_due(self, step: int) -> bool:
        """Whether this rank's clock says checkpoint.every_minutes has passed since the last checkpoint after `step`
        (the ranks' clocks differ: StopSignals.agree makes one rank's yes every rank's). Not after the last step,
        whose checkpoint is checkpoint.final's."""
        minutes = self.config.every_minutes
        return minutes is not None and self.done_steps < step < self.total_steps and \
            time.perf_counter() - self.saved_s >= 60 * minutes

    def _final(self) -> bool:
        """checkpoint.final; null: where this run trained FINAL_AUTO_MIN_S or more, or continues a checkpoint.
        Collective where null: the ranks' clocks differ, so one rank's yes is every rank's."""
        if self.config.final is not None:
            return self.config.final
        trained_s = time.perf_counter() - self.started_s
        wanted = torch.tensor([float(self.done_steps > 0 or trained_s >= FINAL_AUTO_MIN_S)])
        if bool(all_reduce_max(wanted, self.env)[0]):
            return True
        self.final_skipped = (f"no final checkpoint: a run of {trained_s:.0f} s, cheaper to run again than its "
                              f"checkpoint is to keep (checkpoint.final: true keeps one)")
        return False

    def save(self, strategy, *, step: int, wait: bool = False) -> float:
        """Collective. Returns the seconds the save held training up. With checkpoint.async the files are
        copied and written in the background (the next update waits for the copy: `before_update`) and
        committed on rank 0 once written; `wait` (or finish()) waits for all of it."""
        start = time.perf_counter()
        self.finish(barrier_after=False)  # the previous async save first: checkpoints are committed in order
        if self.config.async_save and self._writer is None:
            self._writer = state.AsyncWriter.create(self.env)
        module = strategy.state.export_module()

        def hf_files(folder: Path) -> None:
            # what `toolkit convert` exports: the model's dropout, not this run's model.dropout
            with_own_dropout(module.config).save_pretrained(str(folder))
            self.tokenizer.save_pretrained(str(folder))

        if self._manifest is None:  # what every checkpoint of the run says alike, made once
            self._manifest = {"strategy": self.recipe.strategy.name, "precision": self.recipe.precision,
                              "global_batch_size": self.plan.global_batch_size, "total_steps": self.total_steps,
                              "recipe_hash": store.recipe_hash(self.recipe), "task": self.recipe.model.task,
                              "versions": versions(), **({"train_data": self.train_data} if self.train_data else {})}
        manifest = {**self._manifest, "tokens_seen": self.tokens_seen, "time": time.time(),
                    "launch": launch_identity()}
        self.pending = state.save(strategy, step=step, out_dir=Path(self.recipe.output_dir), env=self.env,
                                  recipe=self.recipe, manifest=manifest, hf_files=hf_files,
                                  keep_last=self.config.keep_last, background=self._writer)
        if wait:
            self.finish()
        self.saved_s = time.perf_counter()
        seconds = self.saved_s - start
        self.last_step, self.last_path = step, store.final_path(Path(self.recipe.output_dir), step)
        if self.env.is_main:
            how = "writing in the background" if self.pending is not None else "written"
            print(f"[toolkit] checkpoint: step {step} → {self.last_path} ({how}; training held {seconds:.2f} s)",
                  file=sys.stderr, flush=True)
        return seconds

    def before_update(self) -> float:
        """Before an optimizer step: wait until an async save has copied the weights it writes. Seconds held."""
        return self.pending.wait_staged() if self.pending is not None else 0.0

    def finish(self, *, barrier_after: bool = True) -> None:
        """Wait for an async save still in flight and its commit; with `barrier_after`, until every rank has
        (not needed between two saves: nothing waits for the previous commit but the next one)."""
        if self.pending is not None:
            self.pending.commit()
            self.pending = None
            if barrier_after:
                barrier(self.env)

    def close(self) -> None:
        """After the last save: commit what is in flight, release the background writer."""
        self.finish()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
