"""A model folder's files, checked before any rank loads them: a folder, config.json, every weight file whole."""

from __future__ import annotations

import json
import re
from pathlib import Path

from toolkit.errors import RecipeError, first_line


def check_model_dir(path: Path, key: str) -> None:
    if path.is_file():
        raise RecipeError(f"{key}: {path} is a file; point it at the folder save_pretrained wrote (the one "
                          "holding config.json)")
    if not path.is_dir():
        if _looks_like_hub_id(path):
            raise RecipeError(f"{key}: {path} is no folder here, and hub ids are not downloaded; fetch it with "
                              f"`hf download {path} --local-dir DIR` and point {key} at DIR")
        raise RecipeError(f"{key}: {path} does not exist; point it at a folder written by save_pretrained")
    if key == "model.path" and not (path / "config.json").is_file():
        adapter = _adapter_base(path)
        if adapter is not None:
            raise RecipeError(f"{key}: {path} holds a LoRA adapter (adapter_config.json), not a model; point {key} "
                              f"at its base model{adapter}, or export a whole model from the run that trains the "
                              "adapter (model.lora.merge_on_export: true)")
        raise RecipeError(f"{key}: {path} has no config.json; point it at a folder written by save_pretrained")
    if key == "model.path":
        _check_weight_files(path)


def _adapter_base(path: Path) -> str | None:
    """For a peft adapter's folder (a LoRA run's output_dir/model): ' (BASE)', its base model's path or id as the
    adapter names it, or '' where it names none; None for any other folder."""
    try:
        config = json.loads((path / "adapter_config.json").read_text())
    except (OSError, ValueError):
        return None
    base = config.get("base_model_name_or_path") if isinstance(config, dict) else None
    return f" ({base})" if isinstance(base, str) and base else ""


def _check_weight_files(path: Path) -> None:
    """The weights from_pretrained reads are there: one file, or every shard its index names (a download or a
    save that stopped part way leaves config.json alone, or an index without all its shards)."""
    from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME

    if (path / SAFE_WEIGHTS_NAME).is_file():
        _check_safetensors(path / SAFE_WEIGHTS_NAME)
        return
    if (path / WEIGHTS_NAME).is_file():
        _check_torch_file(path / WEIGHTS_NAME)
        return
    index = next((path / name for name in (SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_INDEX_NAME) if (path / name).is_file()),
                 None)
    if index is None:
        raise RecipeError(f"model.path: {path} has config.json but no weights ({SAFE_WEIGHTS_NAME}, "
                          f"{SAFE_WEIGHTS_INDEX_NAME} with its shards, or {WEIGHTS_NAME}); finish the download or "
                          "save_pretrained there, or use model.config to train from scratch")
    try:
        shards = set(json.loads(index.read_text())["weight_map"].values())
    except (ValueError, KeyError, TypeError, AttributeError):
        raise RecipeError(f"model.path: {index} is not a weight index (JSON with a weight_map); download it "
                          "again") from None
    missing = sorted(shard for shard in shards if not (path / shard).is_file())
    if missing:
        raise RecipeError(f"model.path: {index} names {len(missing)} missing shard file(s), e.g. {missing[0]}; "
                          "finish the download or save_pretrained there")
    for shard in sorted(shards):
        if shard.endswith(".safetensors"):
            _check_safetensors(path / shard)
        else:
            _check_torch_file(path / shard)


def _check_torch_file(file: Path) -> None:
    """A torch.save file (pytorch_model.bin) is a zip archive whose directory is at its end: one cut short
    has none, and every rank's from_pretrained failed with torch's "failed finding central directory"
    traceback. Reads the directory only; a file of torch's legacy (pre-zip) format is left to torch."""
    import zipfile

    with open(file, "rb") as handle:
        if handle.read(4) != b"PK\x03\x04":
            return
    try:
        with zipfile.ZipFile(file) as archive:
            archive.infolist()
    except (zipfile.BadZipFile, OSError) as exc:  # zipfile: "File is not a zip file", of one that starts as one
        raise RecipeError(f"model.path: {file} is not a complete torch weight file (a zip archive cut short: "
                          f"{first_line(exc)}); finish the download or copy, or save_pretrained again") from None


def _looks_like_hub_id(path: Path) -> bool:
    """`bert-base-uncased` or `owner/name` as a user copies it from the hub: relative, one or two parts, a hub
    id's characters."""
    text = str(path)
    return re.fullmatch(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?", text) is not None


def _check_safetensors(file: Path) -> None:
    """The file's header parses and its tensors end where the file ends (safetensors checks both on opening;
    reads the header only): a download or copy that stopped part way is one line here, not a traceback from
    every rank's from_pretrained."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as opened:
            opened.keys()
    except Exception as exc:  # noqa: BLE001 - safetensors' own error type (SafetensorError) is its Rust core's
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:150]
        raise RecipeError(f"model.path: {file} is not a complete safetensors file ({reason}); finish the download "
                          "or copy, or save_pretrained again") from None
