"""Data: local files through `datasets`, tokenized once (cached on disk), and the global-batch sampler.

The samples of optimizer step k depend only on the seed and the global batch size: step k takes
positions [k·G, (k+1)·G) of a seeded permutation of the train set (a new permutation each epoch).
Ranks and micro-batches then split that global batch; the loss is normalised over all of it, so
world size, micro-batch size and accumulation change the arithmetic order, not the maths.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from toolkit.dist import DistEnv, broadcast_object
from toolkit.errors import RecipeError
from toolkit.losses import IGNORE_INDEX
from toolkit.recipe import BatchPlan, DataConfig

FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}


def load_split(key: str, *, data: DataConfig, task: str, num_labels: int, tokenizer, env: DistEnv):
    """The tokenized `datasets.Dataset` of recipe key `key` (data.train / data.eval) with input_ids (+ label).
    Rank 0 tokenizes; the others read its cache."""
    path = getattr(data, key.split(".")[-1])
    file = data_file(key, path)
    error = None
    if env.is_main:
        try:
            dataset = _tokenized(file, key=key, data=data, task=task, num_labels=num_labels, tokenizer=tokenizer)
        except RecipeError as exc:
            error = str(exc)
    error = broadcast_object(error, env)  # the other ranks fail with rank 0's message instead of hanging
    if error is not None:
        raise RecipeError(error)
    if not env.is_main:  # reads rank 0's cache
        dataset = _tokenized(file, key=key, data=data, task=task, num_labels=num_labels, tokenizer=tokenizer)
    return dataset


def data_file(key: str, path: str) -> Path:
    file = Path(path)
    if not file.is_file():
        what = "is a folder" if file.is_dir() else "not found"
        raise RecipeError(f"{key}: {path} {what}; give a local json/jsonl/csv/parquet/txt file")
    if file.suffix not in FORMATS:
        raise RecipeError(f"{key}: {path}: unknown format {file.suffix!r}; use one of {', '.join(FORMATS)}")
    return file


def read_rows(file: Path, *, key: str):
    """The file's rows, untokenized. A file without rows (empty, or a CSV header alone) or one that does not
    parse as its suffix says is one line naming it."""
    import datasets

    if file.stat().st_size == 0:
        raise RecipeError(f"{key}: {file} is empty: it has no rows; point {key} at a file with data")
    datasets.disable_progress_bars()
    fmt = FORMATS[file.suffix]
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # a parse error is the one line below, not the
    try:                                                        # library's log of it too
        raw = datasets.load_dataset(fmt, data_files=str(file), split="train")
    except ValueError as exc:
        if "corresponds to no data" not in str(exc):
            raise
        raw = None
    except datasets.exceptions.DatasetGenerationError as exc:
        cause = str(exc.__cause__ or exc).strip().splitlines()
        raise RecipeError(f"{key}: {file} cannot be read as {fmt} ({cause[-1][:200] if cause else 'no detail'}); "
                          "fix the file or give it the suffix of its format") from None
    finally:
        datasets.logging.set_verbosity(verbosity)
    if raw is None or len(raw) == 0:
        raise RecipeError(f"{key}: {file} has no rows (a header at most); point {key} at a file with data")
    return raw


def check_rows(raw, file: Path, *, key: str, data: DataConfig, task: str, num_labels: int) -> None:
    """The named columns exist and hold what training needs: text, and class ids within model.num_labels."""
    import datasets

    needed = [data.text_column] + ([data.label_column] if task == "sequence-classification" else [])
    for column in needed:
        if column not in raw.column_names:
            raise RecipeError(f"{key}: {file} has no column {column!r} (it has {', '.join(raw.column_names)}); "
                              f"set data.text_column / data.label_column to one of those")
    text = raw.features[data.text_column]
    if not (isinstance(text, datasets.Value) and text.dtype in TEXT_DTYPES):
        raise RecipeError(f"{key}: {file} column {data.text_column!r} holds {_describe(text)}, not text; set "
                          "data.text_column to the column with the text")
    if raw.data.column(data.text_column).null_count:  # arrow's count: no Python pass over the column
        missing = next(i for i, v in enumerate(raw[data.text_column]) if v is None)
        raise RecipeError(f"{key}: {file} row {missing + 1} has no {data.text_column!r}; fill or drop it")
    if task != "sequence-classification":
        return
    assert data.label_column is not None  # Recipe: required for sequence-classification
    label = raw.features[data.label_column]
    values = raw.unique(data.label_column)
    ids = _class_ids(label, values)
    if ids is None:
        example = next((v for v in values if v is not None), None)
        raise RecipeError(f"{key}: {file} column {data.label_column!r} holds {_describe(label)} (e.g. {example!r}); "
                          f"labels must be class ids 0..{num_labels - 1}")
    if None in ids:
        raise RecipeError(f"{key}: {file} has a row without a {data.label_column!r}; fill or drop it")
    bad = sorted(v for v in ids if not 0 <= v < num_labels)
    if bad:
        raise RecipeError(f"{key}: {file} has label {bad[0]!r} in column {data.label_column!r}, outside "
                          f"0..{num_labels - 1} (model.num_labels: {num_labels}); fix the data or set "
                          "model.num_labels")


TEXT_DTYPES = ("string", "large_string", "string_view")


def _class_ids(feature, values: list) -> list | None:
    """The label values as class ids (None in place of a missing one), or None when they are not ids:
    integers, booleans, whole floats and digit strings are (`int(v)` is what training feeds the model)."""
    import datasets

    if isinstance(feature, datasets.ClassLabel):
        return values
    dtype = getattr(feature, "dtype", "")
    present = [v for v in values if v is not None]
    ids = (dtype.startswith(("int", "uint")) or dtype == "bool"
           or (dtype.startswith("float") and all(float(v).is_integer() for v in present))  # a CSV column with a gap
           or (dtype in TEXT_DTYPES and all(v.strip().isdigit() for v in present)))
    return [None if v is None else int(v) for v in values] if ids else None


def _describe(feature) -> str:
    dtype = getattr(feature, "dtype", None)
    if dtype in TEXT_DTYPES:
        return "text"
    return f"{dtype} values" if dtype else type(feature).__name__


def _tokenized(file: Path, *, key: str, data: DataConfig, task: str, num_labels: int, tokenizer):
    raw = read_rows(file, key=key)
    check_rows(raw, file, key=key, data=data, task=task, num_labels=num_labels)
    cache = _cache_key(file, data=data, task=task, tokenizer=tokenizer)
    text, label = data.text_column, data.label_column

    def encode(batch):
        out = tokenizer(batch[text], truncation=True, max_length=data.max_length)
        result = {"input_ids": out["input_ids"]}
        if task == "sequence-classification":
            result["label"] = [int(v) for v in batch[label]]
        return result

    dataset = raw.map(encode, batched=True, remove_columns=raw.column_names, new_fingerprint=cache)
    if task == "causal-lm" and data.packing:
        unpacked = dataset
        dataset = dataset.map(_packer(data.max_length), batched=True, new_fingerprint=cache + "-packed")
        if len(dataset) == 0:
            tokens = sum(len(ids) for ids in unpacked["input_ids"])
            raise RecipeError(f"{key}: {file} has {tokens} tokens, fewer than one packed block of data.max_length "
                              f"{data.max_length}; lower data.max_length or add data")
    return dataset


def _cache_key(file: Path, *, data: DataConfig, task: str, tokenizer) -> str:
    """Cache identity: file contents + tokenizer vocabulary + every setting that changes the tokens."""
    digest = hashlib.sha256()
    stat = file.stat()
    digest.update(f"{file.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    digest.update(json.dumps([type(tokenizer).__name__, data.text_column, data.label_column,
                              data.max_length, data.packing, task]).encode())
    return digest.hexdigest()[:32]


def _packer(block: int):
    def pack(batch):
        stream = [tok for ids in batch["input_ids"] for tok in ids]
        usable = len(stream) // block * block
        return {"input_ids": [stream[i:i + block] for i in range(0, usable, block)]}

    return pack


@dataclass(frozen=True)
class DataLayout:
    """Which shard of every global batch a rank reads: ranks with the same `rank` read the same samples
    (the stages of one pipeline), `size` shards make up the global batch (the data-parallel ranks)."""

    rank: int
    size: int


@dataclass(frozen=True)
class GlobalBatchSampler:
    """Which samples each rank's micro-batches hold at optimizer step k (see module docstring)."""

    num_samples: int
    plan: BatchPlan
    rank: int
    seed: int

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.plan.global_batch_size

    def global_batch(self, step: int) -> list[int]:
        epoch, pos = divmod(step, self.steps_per_epoch)
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        order = torch.randperm(self.num_samples, generator=generator)
        size = self.plan.global_batch_size
        return order[pos * size:(pos + 1) * size].tolist()

    def micro_batches(self, step: int) -> list[list[int]]:
        per_rank = self.plan.micro_batch_size * self.plan.grad_accum_steps
        mine = self.global_batch(step)[self.rank * per_rank:(self.rank + 1) * per_rank]
        micro = self.plan.micro_batch_size
        return [mine[i:i + micro] for i in range(0, per_rank, micro)]


class StepIndexStream:
    """Batch sampler for a DataLoader: micro-batch index lists for steps [start, stop)."""

    def __init__(self, sampler: GlobalBatchSampler, *, start: int, stop: int):
        self.sampler, self.start, self.stop = sampler, start, stop

    def __iter__(self):
        for step in range(self.start, self.stop):
            yield from self.sampler.micro_batches(step)

    def __len__(self) -> int:
        return (self.stop - self.start) * self.sampler.plan.grad_accum_steps


def eval_index_batches(num_samples: int, *, micro_batch_size: int, layout: DataLayout) -> list[tuple[list[int], bool]]:
    """Eval batches for this rank's data shard: every rank gets the same number (sharded strategies run
    collectives in forward); a shard with nothing left repeats sample 0 flagged `counted False`."""
    chunk = micro_batch_size * layout.size
    out = []
    for start in range(0, num_samples, chunk):
        mine = list(range(start, min(start + chunk, num_samples)))[layout.rank * micro_batch_size:]
        mine = mine[:micro_batch_size]
        out.append((mine, True) if mine else ([0], False))
    return out


class Collator:
    """Pads a micro-batch to its longest sample; labels carry IGNORE_INDEX on padding."""

    def __init__(self, *, pad_token_id: int, task: str):
        self.pad_token_id, self.task = pad_token_id, task

    def __call__(self, samples: list[dict]) -> dict:
        length = max(len(s["input_ids"]) for s in samples)
        ids = torch.full((len(samples), length), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(samples), length), dtype=torch.long)
        for row, sample in enumerate(samples):
            n = len(sample["input_ids"])
            ids[row, :n] = torch.tensor(sample["input_ids"], dtype=torch.long)
            mask[row, :n] = 1
        batch: dict[str, Any] = {"input_ids": ids, "attention_mask": mask}
        if self.task == "causal-lm":
            batch["labels"] = ids.masked_fill(mask == 0, IGNORE_INDEX)
            batch["num_items"] = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
        else:
            batch["labels"] = torch.tensor([s["label"] for s in samples], dtype=torch.long)
            batch["num_items"] = len(samples)
        batch["num_tokens"] = int(mask.sum())
        return batch


def train_loader(dataset, *, sampler: GlobalBatchSampler, start: int, stop: int, collator: Collator,
                 data: DataConfig):
    return torch.utils.data.DataLoader(
        dataset, batch_sampler=StepIndexStream(sampler, start=start, stop=stop), collate_fn=collator,
        num_workers=data.num_workers, pin_memory=data.pin_memory)
