"""Before any tensor is read: is a checkpoint whole, and was it written for this model? Each answer is one line.

Both come from DCP's own `.metadata` (written last, by the coordinator, once every rank's files were complete):
it lists every storage file with the bytes each entry occupies, and every tensor's saved size. A copy that lost a
file, or a model whose tensors differ from the saved ones, is refused here, before DCP's own load would fail deep
inside its planner or reader (or, for tensors the model does not have, silently skip them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

from toolkit.errors import RecipeError

OTHER_MODEL = "it was written for another model; train with the model settings of its recipe.yaml"


def read_metadata(path: Path) -> Metadata:
    """The checkpoint's DCP metadata, once every storage file it names is checked to be on disk, whole."""
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as exc:  # noqa: BLE001 - any unreadable metadata is the same user-facing fact
        raise RecipeError(f"checkpoint {path}: its DCP metadata is unreadable ({type(exc).__name__}); the "
                          "checkpoint is corrupted, use an earlier one") from None
    check_files(path, metadata)
    return metadata


def check_files(path: Path, metadata: Metadata) -> None:
    """Every file `.metadata` lists exists and reaches the last byte an entry of it occupies."""
    ends: dict[str, int] = {}  # storage file -> the end of its last entry
    for info in (metadata.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        file = path / name
        if not file.is_file():
            raise RecipeError(f"checkpoint {path} is incomplete: its file {name}, listed in its .metadata, is "
                              "missing; copy the whole folder again, or use an earlier checkpoint")
        size = file.stat().st_size
        if size < end:
            raise RecipeError(f"checkpoint {path} is incomplete: its file {name} has {size} bytes, its .metadata "
                              f"lists {end}; copy the whole folder again, or use an earlier checkpoint")


def check_model_fits(path: Path, metadata: Metadata, shapes: dict[str, Any], *, whole: bool) -> None:
    """The model's tensors (name -> full shape) are in the checkpoint with those shapes; with `whole`, the
    checkpoint holds no model tensor beyond them (DCP would leave such a tensor unread, without a word)."""
    saved = {key.removeprefix("model."): entry for key, entry in metadata.state_dict_metadata.items()
             if key.startswith("model.")}
    missing = [name for name in shapes if name not in saved]
    if missing:
        raise RecipeError(f"checkpoint {path} has no weight {missing[0]!r} ({len(missing)} missing): {OTHER_MODEL}")
    for name, shape in shapes.items():
        size = getattr(saved[name], "size", None)  # a tensor's; no size: a non-tensor entry, not compared
        if size is not None and tuple(size) != tuple(shape):
            raise RecipeError(f"checkpoint {path} holds {name!r} with shape {list(size)}, this model's is "
                              f"{list(shape)}: {OTHER_MODEL}")
    extra = [name for name in saved if name not in shapes] if whole else []
    if extra:
        raise RecipeError(f"checkpoint {path} holds weight {extra[0]!r} that this model does not have ({len(extra)} "
                          f"such): {OTHER_MODEL}")
