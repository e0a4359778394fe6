"""`toolkit convert CHECKPOINT OUT`: a Hugging Face model folder from any checkpoint, in one CPU process.

Needs nothing but the checkpoint: its `hf/` folder holds the model's config and tokenizer, and DCP reads
the weights whatever strategy and world size wrote them.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from toolkit.checkpoint import state, store
from toolkit.errors import RecipeError
from toolkit.export import without_tied_aliases


def convert(checkpoint_path: Path, out: Path) -> Path:
    import transformers

    checkpoint = store.read_checkpoint(checkpoint_path, resuming=False)
    check_out(out, checkpoint=checkpoint.path)
    hf = checkpoint.path / "hf"
    if not (hf / "config.json").is_file():
        raise RecipeError(f"checkpoint {checkpoint.path} has no hf/config.json; it is incomplete")
    config = transformers.AutoConfig.from_pretrained(str(hf))
    task = checkpoint.manifest.get("task", "causal-lm")
    auto = (transformers.AutoModelForCausalLM if task == "causal-lm"
            else transformers.AutoModelForSequenceClassification)
    with torch.device("cpu"):
        model = auto.from_config(config, dtype=torch.float32)
    state.load_weights(model, checkpoint.path)  # no process group: DCP reads every shard in this process
    tmp = out.parent / f".{out.name}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp), state_dict=without_tied_aliases(model, model.state_dict()))
    transformers.AutoTokenizer.from_pretrained(str(hf)).save_pretrained(str(tmp))
    tmp.rename(out)
    return out


def check_out(out: Path, *, checkpoint: Path) -> None:
    """OUT is a new folder outside the checkpoint, in a place where a folder can be made: before any weight is
    read, so that a mistake costs nothing and leaves nothing behind."""
    if out.resolve().is_relative_to(checkpoint.resolve()):
        raise RecipeError(f"{out} is inside the checkpoint {checkpoint}; write the model to a folder outside it")
    store.check_creatable(out, what="model folder")
    if out.exists():
        raise RecipeError(f"{out} already exists; pass a new folder to write the model into")
