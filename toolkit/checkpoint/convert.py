"""`toolkit convert CHECKPOINT OUT`: a Hugging Face model folder from any checkpoint, in one CPU process.

Needs nothing but the checkpoint: its `hf/` folder holds the model's config and tokenizer, and DCP reads
the weights whatever strategy and world size wrote them. A LoRA run's checkpoint (its recipe.yaml names
model.lora) comes out with its adapters merged: a plain model, as merge_on_export writes it.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import sys
from pathlib import Path

import torch

from toolkit.checkpoint import digest, state, store
from toolkit.errors import RecipeError, first_line
from toolkit.model.export import replace_folder
from toolkit.model.tied import without_tied_aliases
from toolkit.process.cleanup import make_folders, remove_empty
from toolkit.process.stopping import write_error_text


def convert(checkpoint_path: Path, out: Path) -> Path:
    try:
        return _convert(checkpoint_path, out)
    finally:
        store.done_reading()


def _convert(checkpoint_path: Path, out: Path) -> Path:
    import transformers

    newest = store.newest_checkpoint_in(checkpoint_path)
    if newest is not None:  # a run's folder or its checkpoints/: its newest complete checkpoint, as --resume takes
        print(f"[toolkit] convert: {newest}, the newest complete checkpoint in {checkpoint_path}", file=sys.stderr,
              flush=True)
        checkpoint_path = newest
    checkpoint = store.read_checkpoint(checkpoint_path, resuming=False)
    check_out(out, checkpoint=checkpoint.path)
    store.hold_for_reading(checkpoint)  # a live run's: its keep_last leaves it until the model is written
    digest.check(checkpoint.path, expected=checkpoint.records_digests)  # bytes changed since the save: before reading
    hf = checkpoint.path / "hf"
    if not (hf / "config.json").is_file():
        raise RecipeError(f"checkpoint {checkpoint.path} has no hf/config.json; it is incomplete")
    config = _read_hf(checkpoint.path, lambda: transformers.AutoConfig.from_pretrained(str(hf)))
    tokenizer = _read_hf(checkpoint.path, lambda: transformers.AutoTokenizer.from_pretrained(str(hf)))
    task = checkpoint.manifest.get("task", "causal-lm")
    auto = (transformers.AutoModelForCausalLM if task == "causal-lm"
            else transformers.AutoModelForSequenceClassification)
    with torch.device("cpu"):
        model = auto.from_config(config, dtype=torch.float32)
    lora = lora_of(checkpoint.path)
    if lora is None:
        state.load_weights(model, checkpoint.path)  # no process group: DCP reads every shard in this process
    else:  # the checkpoint holds the adapted model: its adapters merged, a plain model comes out
        from toolkit.model.lora import merged_model

        model = merged_model(model, lora, task=task, load=lambda m: state.load_weights(m, checkpoint.path))
    tmp = out.parent / f".{out.name}.partial"
    made = make_folders(out.parent)  # the folders OUT needs above it: a failed write takes them back
    try:
        with stop_signals_raise():
            shutil.rmtree(tmp, ignore_errors=True)
            model.save_pretrained(str(tmp), state_dict=without_tied_aliases(model, model.state_dict()))
            tokenizer.save_pretrained(str(tmp))
            replace_folder(tmp, out)  # out is new (check_out): renamed into place, as readable as the umask allows
    except BaseException as exc:  # nothing half-written: the partial folder and the folders made for it go
        shutil.rmtree(tmp, ignore_errors=True)
        remove_empty(made[::-1])
        text = write_error_text(exc)
        if text is None:
            raise
        fix = "free space or choose another folder" if any(name in text for name in ("ENOSPC", "EDQUOT", "EFBIG")) \
            else "choose another folder"
        raise ConvertWriteError(f"{out} could not be written ({text}); nothing of it was kept: {fix}") from None
    return out


class ConvertWriteError(Exception):
    """The model folder could not be written (a full disk, a quota): one line, exit 1; nothing of it is kept."""


@contextlib.contextmanager
def stop_signals_raise():
    """SIGTERM (and SIGHUP) while the model is written end the command as Ctrl-C does, through the same clean-up,
    instead of killing the process with its partial folder left behind."""
    def stop(signum, frame):
        raise Stopped(signum)

    previous = {signum: signal.signal(signum, stop) for signum in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            if handler is not None:  # None: set from outside Python, nothing to give back
                signal.signal(signum, handler)


class Stopped(BaseException):
    """A stop signal while the model was written (stop_signals_raise): the command's exit is 128 + the signal."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _read_hf(path: Path, read):
    """The checkpoint's hf/ config or tokenizer, read by transformers; a damaged file is one line naming the
    checkpoint (transformers' own refusal, of a config.json that is not JSON, is a traceback)."""
    try:
        return read()
    except (OSError, ValueError) as exc:
        raise RecipeError(f"checkpoint {path}: its hf/ folder (the model's config and tokenizer) is unreadable "
                          f"({first_line(exc)}); the checkpoint is damaged, use an earlier one") from None


def lora_of(path: Path):
    """The LoraOptions of the run that wrote the checkpoint (its recipe.yaml's model.lora), or None."""
    from toolkit.config.recipe import LoraOptions

    raw = store.saved_recipe(path)
    if raw is None:
        raise RecipeError(f"checkpoint {path}: recipe.yaml is unreadable (missing, or no recipe); it is incomplete")
    model = raw.get("model")
    options = model.get("lora") if isinstance(model, dict) else None
    if not options:
        return None
    try:
        targets = options.get("target_modules")
        return LoraOptions(**{**options, "target_modules": tuple(targets) if targets is not None else None})
    except (AttributeError, TypeError, RecipeError) as exc:
        raise RecipeError(f"checkpoint {path}: recipe.yaml's model.lora is not one this toolkit wrote ({exc}); "
                          "the checkpoint is damaged") from None


def check_out(out: Path, *, checkpoint: Path) -> None:
    """OUT is a new folder outside the checkpoint, in a place where a folder can be made: before any weight is
    read, so that a mistake costs nothing and leaves nothing behind."""
    if out.resolve().is_relative_to(checkpoint.resolve()):
        raise RecipeError(f"{out} is inside the checkpoint {checkpoint}; write the model to a folder outside it")
    store.check_creatable(out, what="model folder")
    store.check_not_in_a_run(out, what="model folder", fix="write the model to a folder outside it")
    if out.exists():
        raise RecipeError(f"{out} already exists; pass a new folder to write the model into")
