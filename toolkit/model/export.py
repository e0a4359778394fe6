"""Export the trained model as one Hugging Face folder (save_pretrained, safetensors), atomically."""

from __future__ import annotations

import contextlib
import shutil
import sys
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from toolkit.config.recipe import LoraOptions
from toolkit.model.build import own_dropout
from toolkit.model.lora import adapted
from toolkit.model.tied import without_tied_aliases
from toolkit.process.dist import DistEnv, all_reduce_max
from toolkit.process.stopping import OutputWriteError, write_error_text


@contextlib.contextmanager
def unwrapped_without_deepspeed() -> Iterator[None]:
    """save_pretrained unwraps the model through accelerate (`extract_model_from_parallel`), which imports
    DeepSpeed wherever it is installed, to recognise its engine: 1.4 s at the end of every run that never used
    it (measured: the largest part of a tiny run's export). A process that has not imported DeepSpeed holds no
    DeepSpeed engine, so the unwrap gives the same model without the import. Where accelerate no longer asks
    that way, nothing is changed."""
    import accelerate.utils.other as other

    if "deepspeed" in sys.modules or not hasattr(other, "is_deepspeed_available"):
        yield
        return
    asked = other.is_deepspeed_available
    other.is_deepspeed_available = lambda: False
    try:
        yield
    finally:
        other.is_deepspeed_available = asked


def export_model(strategy, *, tokenizer, out_dir: Path, env: DistEnv, lora: LoraOptions | None = None,
                 task: str = "causal-lm") -> Path:
    """Collective: gather full weights, then rank 0 writes a folder beside out_dir/model and swaps it in, so
    that a complete model is always at out_dir/model (the old one until the new one is complete). With LoRA,
    out_dir/model is the adapter (peft's format) and, with merge_on_export, out_dir/model-merged the merged
    plain model."""
    state_dict = strategy.state.full_state_dict()
    final = out_dir / "model"
    failure = None
    if env.is_main:
        tmp = out_dir / ".model.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        module = strategy.state.export_module()
        try:
            with own_dropout(module.config):  # the model's dropout, not model.dropout's override for this run
                _write_model(module, state_dict, tokenizer=tokenizer, out_dir=out_dir, tmp=tmp, lora=lora,
                             task=task)
            replace_folder(tmp, final)
        except Exception as exc:  # noqa: BLE001 - a failed write (write_error_text) ends the run in one line
            why = write_error_text(exc)
            if why is None:
                raise
            for partial in (tmp, out_dir / ".model-merged.partial"):  # what a full disk needs back
                shutil.rmtree(partial, ignore_errors=True)
            failure = f"the model could not be written to {final} ({why})"
    # every rank alike (and in step: the others wait for rank 0's files, as a barrier would): all end on it
    failed = all_reduce_max(torch.tensor([float(failure is not None)]), env)
    if failed.item():
        raise OutputWriteError(failure or "the model could not be written")
    return final


def _write_model(module, state_dict, *, tokenizer, out_dir: Path, tmp: Path, lora: LoraOptions | None,
                 task: str) -> None:
    """Rank 0: the model (or LoRA's adapter, and the merged model) and tokenizer files into tmp."""
    if lora is None:
        with unwrapped_without_deepspeed():
            module.save_pretrained(str(tmp), state_dict=without_tied_aliases(module, state_dict))
        tokenizer.save_pretrained(str(tmp))
        return
    merged = out_dir / ".model-merged.partial" if lora.merge_on_export else None
    if merged is not None:
        shutil.rmtree(merged, ignore_errors=True)
    export_adapter(module, state_dict, options=lora, task=task, tokenizer=tokenizer, adapter_dir=tmp,
                   merged_dir=merged)
    if merged is not None:
        replace_folder(merged, out_dir / "model-merged")


RENAME_EXCHANGE = 2  # linux/fs.h


def _readable_as_umask_allows(folder: Path) -> None:
    """The folder's files with the permissions the process's umask gives a new file (0644 under umask 022).
    safetensors' save_file creates its file 0600 whatever the umask, so an exported model's weights were the
    one file in the folder that a teammate, or the user a server runs as, could not read."""
    mode = 0o666 & ~_umask()
    for file in folder.rglob("*"):
        if file.is_file() and (file.stat().st_mode & 0o777) != mode:
            file.chmod(mode)


def _umask() -> int:
    """This process's umask, read without setting it (os.umask sets it, for every thread at once)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def replace_folder(new: Path, final: Path) -> None:
    """Put folder `new` at `final` (its files readable as the umask allows). An existing `final` is exchanged
    with `new` in one step (Linux renameat2), then deleted; where that call is missing, it is moved aside first
    and deleted after."""
    _readable_as_umask_allows(new)
    if not final.exists():
        new.rename(final)
        return
    if not _exchange(new, final):
        aside = final.with_name(f".{final.name}.old")
        shutil.rmtree(aside, ignore_errors=True)
        final.rename(aside)
        new.rename(final)
        new = aside
    shutil.rmtree(new)


def _exchange(a: Path, b: Path) -> bool:
    import ctypes
    import os

    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd = -100
    done = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), RENAME_EXCHANGE) == 0
    return bool(done)


def export_adapter(module: nn.Module, state_dict: dict[str, torch.Tensor], *, options: LoraOptions, task: str,
                   tokenizer, adapter_dir: Path, merged_dir: Path | None) -> None:
    """Rank 0: a fresh skeleton of the model with the same adapters, given the gathered weights; peft writes
    the adapter (adapter_config.json, adapter_model.safetensors) and, with `merged_dir`, the merged model."""
    with torch.device("meta"):
        skeleton: Any = type(module)(module.config)
    peft_model = adapted(skeleton, options, task=task)
    inner: Any = peft_model.base_model.model
    inner.load_state_dict(state_dict, assign=True)
    inner.tie_weights()
    with unwrapped_without_deepspeed():
        peft_model.save_pretrained(str(adapter_dir))
    tokenizer.save_pretrained(str(adapter_dir))
    if merged_dir is not None:
        # safe_merge: into a copy of each adapted weight. The state dict holds the trained model's own tensors
        # (on CPU the export reads them in place), which a merge in place would change under the live model
        merged: Any = peft_model.merge_and_unload(safe_merge=True)
        with unwrapped_without_deepspeed():
            merged.save_pretrained(str(merged_dir), state_dict=without_tied_aliases(merged, merged.state_dict()))
        tokenizer.save_pretrained(str(merged_dir))
