"""Before any tensor is read: is a checkpoint whole, and was it written for this model? Each answer is one line.

Both come from DCP's own `.metadata` (written last, by the coordinator, once every rank's files were complete):
it lists every storage file with the bytes each entry occupies, and every tensor's saved size. A copy that lost a
file, or a model whose tensors differ from the saved ones, is refused here, before DCP's own load would fail deep
inside its planner or reader (or, for tensors the model does not have, silently skip them).
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta

from toolkit.errors import RecipeError

OTHER_MODEL = "it was written for another model; train with the model settings of its recipe.yaml"
LORA_WORD = ".lora_A."  # in every adapted layer's parameter names (peft)


class MetadataUnpickler(pickle._Unpickler):  # the Python unpickler: its BUILD step can be checked (load_build)
    """DCP writes `.metadata` with pickle, and its own reader loads it with pickle.load, which runs whatever code
    the file names: a checkpoint from elsewhere could run anything at `--resume` or `toolkit convert`. This
    unpickler builds only what DCP's metadata is made of (its metadata dataclasses, _StorageInfo, torch.Size,
    dtypes and layouts, the checkpoint's path) and refuses any other global, and sets state (pickle's BUILD) only
    on instances of DCP's own classes: BUILD on a class would set its attributes for the whole process (a
    PosixPath whose every instance names another folder). (DCP reads the tensors themselves with
    torch.load(weights_only=True); SafeReader refuses the entries it would read otherwise.)"""

    ALLOWED = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
               ("torch.serialization", "_get_layout"), ("collections", "OrderedDict")}
    PATHS = ("Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")  # pathlib's, pathlib._local's

    dispatch = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]

    def find_class(self, module: str, name: str) -> Any:
        if "." not in name and ((module, name) in self.ALLOWED or self._metadata_type(module, name) or
                                self._torch_constant(module, name) or self._path_type(module, name)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a DCP checkpoint's metadata")

    def load_build(self) -> None:
        target = self.stack[-2]  # type: ignore[attr-defined]
        if isinstance(target, type) or not self._builds(type(target)):
            raise pickle.UnpicklingError(f"it sets the state of {target!r}, which DCP's metadata never does")
        pickle._Unpickler.load_build(self)  # type: ignore[attr-defined]

    dispatch[pickle.BUILD[0]] = load_build  # type: ignore[assignment]

    @classmethod
    def _builds(cls, kind: type) -> bool:  # DCP's dataclasses, whose state pickle sets as a dict
        return cls._metadata_type(kind.__module__, kind.__name__) or \
            (kind.__module__, kind.__name__) == ("torch.distributed.checkpoint.filesystem", "_StorageInfo")

    @staticmethod
    def _metadata_type(module: str, name: str) -> bool:  # a class (dataclass, enum) of DCP's metadata module
        value = getattr(dcp_metadata, name, None) if module == dcp_metadata.__name__ else None
        return isinstance(value, type) and value.__module__ == module

    @staticmethod
    def _torch_constant(module: str, name: str) -> bool:  # torch.float32, torch.strided, torch.contiguous_format
        return module == "torch" and isinstance(getattr(torch, name, None),
                                                (torch.dtype, torch.layout, torch.memory_format))

    @classmethod
    def _path_type(cls, module: str, name: str) -> bool:  # Python 3.13 pickles PosixPath from pathlib._local
        return module in ("pathlib", "pathlib._local") and name in cls.PATHS


class SafeReader(FileSystemReader):
    """DCP's file reader, its `.metadata` unpickled by MetadataUnpickler (torch's read_metadata, otherwise)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        where = getattr(self, "_get_metadata_path", None)  # rank-local metadata: newer torch only
        path = where(kwargs.get("rank")) if where is not None else self.fs.concat_path(self.path, ".metadata")
        with self.fs.create_stream(path, "rb") as file:
            metadata = MetadataUnpickler(file).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"the file holds a {type(metadata).__name__}, not DCP's Metadata")
        # an entry stored as bytes is read back with torch.load(weights_only=False), a pickle that runs what it names;
        # the toolkit writes tensors only (weights, optimizer state, generators, positions)
        pickled = next((key for key, entry in (metadata.state_dict_metadata or {}).items()
                        if isinstance(entry, BytesStorageMetadata)), None)
        if pickled is not None:
            raise pickle.UnpicklingError(f"{pickled!r} is stored as a pickled object, which no toolkit checkpoint "
                                         "holds")
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = getattr(self, "load_id", None)
        metadata.storage_meta = storage_meta
        return metadata


def read_metadata(path: Path) -> Metadata:
    """The checkpoint's DCP metadata, once every storage file it names is checked to be on disk, whole."""
    try:
        metadata = SafeReader(str(path)).read_metadata()
    except Exception as exc:  # noqa: BLE001 - any unreadable metadata is the same user-facing fact
        why = f": {exc}" if isinstance(exc, pickle.UnpicklingError) else ""
        raise RecipeError(f"checkpoint {path}: its DCP metadata is unreadable ({type(exc).__name__}{why}); the "
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
    adapters_saved, adapters_here = (any(LORA_WORD in name for name in names) for names in (saved, shapes))
    # the one setting that differs, named (peft renames every adapted layer); not for a part of the model (a
    # pipeline stage, a ZeRO-3 module), whose strategies refuse LoRA themselves
    if whole and adapters_saved != adapters_here:
        raise RecipeError(f"checkpoint {path} holds a model {'with' if adapters_saved else 'without'} LoRA adapters "
                          f"and this run's has {'none' if adapters_saved else 'them'}: " +
                          ("set the model.lora of its recipe.yaml" if adapters_saved else
                           "drop model.lora to continue it, or write it out with `toolkit convert` and adapt that "
                           "folder (model.path) afresh"))
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


def load_blob(blob: bytes) -> Any:
    """A strategy's own state as its state_bytes wrote it into a checkpoint (a `comm.<rank>` tensor: PowerSGD's
    factors and generator, local SGD's anchor and outer optimizer), read with torch.load(weights_only=True):
    tensors, numbers, strings and containers, and numpy arrays (PowerSGD's generator state), nothing else built."""
    import io

    import numpy as np

    core = getattr(np, "_core", None) or np.core  # numpy 2 names it _core
    with torch.serialization.safe_globals([core.multiarray._reconstruct, np.ndarray, np.dtype,
                                           type(np.dtype(np.uint32))]):
        return torch.load(io.BytesIO(blob), weights_only=True)
