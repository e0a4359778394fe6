"""Data: the recipe's splits through `datasets` (toolkit/data_files.py: which files, what they must hold),
tokenized once (cached on disk), and the global-batch sampler.

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

from toolkit.data_files import (DataSource, check_labels, check_text_column, class_names, data_source,
                                read_rows)
from toolkit.dist import DistEnv, broadcast_object
from toolkit.errors import RecipeError
from toolkit.instruct import check_messages, check_tokenizer, encode_batch
from toolkit.losses import IGNORE_INDEX
from toolkit.recipe import BatchPlan, DataConfig


def load_split(key: str, *, data: DataConfig, task: str, num_labels: int, tokenizer, env: DistEnv,
               names: list[str] | None = None) -> tuple[Any, list[str] | None, int]:
    """The tokenized `datasets.Dataset` of recipe key `key` (data.train / data.eval) with input_ids (+ label, or
    labels for instruction data), the class names its labels were mapped from (None: class ids), and how many
    samples were left out for having no token to learn from (see left_out_note). Rank 0 tokenizes; the others
    read its cache. `names`: data.train's (an eval split's labels must be among them)."""
    source = data_source(key, getattr(data, key.split(".")[-1]))
    error = None
    if env.is_main:
        try:
            split = _tokenized(source, data=data, task=task, num_labels=num_labels, tokenizer=tokenizer, names=names)
        except RecipeError as exc:
            error = str(exc)
    error = broadcast_object(error, env)  # the other ranks fail with rank 0's message instead of hanging
    if error is not None:
        raise RecipeError(error)
    if not env.is_main:  # reads rank 0's cache
        split = _tokenized(source, data=data, task=task, num_labels=num_labels, tokenizer=tokenizer, names=names)
    return split


def left_out_note(key: str, num_left_out: int, data: DataConfig) -> str:
    return (f"[toolkit] {key}: {num_left_out} sample(s) have no token to learn from within data.max_length "
            f"{data.max_length} (a prompt that fills it, an empty response, a one-token text); left out")


def check_rows(raw, source: DataSource, *, data: DataConfig, task: str, num_labels: int,
               names: list[str] | None = None) -> list[str] | None:
    """The columns the recipe's format reads exist and hold what training needs. Returns the class names a
    training split's named labels map from (sorted: the class id is the position), None for class ids."""
    if data.format == "chat":
        if data.messages_column not in raw.column_names:
            raise RecipeError(f"{source.key}: {source.path} has no column {data.messages_column!r} (it has "
                              f"{', '.join(raw.column_names)}); set data.messages_column to one of those")
        check_messages(raw[data.messages_column], source.key, source.path, data.messages_column)
    elif data.format == "prompt-response":
        check_text_column(raw, source, data.prompt_column, "data.prompt_column")
        check_text_column(raw, source, data.response_column, "data.response_column")
    else:
        check_text_column(raw, source, data.text_column, "data.text_column")
    if task != "sequence-classification":
        return None
    assert data.label_column is not None  # Recipe: required for sequence-classification
    if names is None and source.key == "data.train":
        names = class_names(raw, source, data.label_column)
        if names is not None and len(names) != num_labels:
            raise RecipeError(f"{source.key}: {source.path} has {len(names)} labels ({', '.join(names[:8])}) but "
                              f"model.num_labels is {num_labels}; set model.num_labels: {len(names)}")
    elif names is None and class_names(raw, source, data.label_column) is not None:
        raise RecipeError(f"{source.key}: {source.path} has label names in column {data.label_column!r} where "
                          "data.train has class ids; use one kind in both")
    check_labels(raw, source, data, num_labels=num_labels, names=names)
    return names


def check_room(data: DataConfig, tokenizer) -> None:
    """data.max_length holds more than the special tokens the tokenizer adds to every sample."""
    special = tokenizer.num_special_tokens_to_add()
    if data.format != "chat" and data.max_length <= special:  # the tokenizer would not truncate at all
        raise RecipeError(f"data.max_length {data.max_length} leaves no room for text: the tokenizer adds {special} "
                          f"special tokens to every sample; set data.max_length above {special}")


def _tokenized(source: DataSource, *, data: DataConfig, task: str, num_labels: int, tokenizer,
               names: list[str] | None) -> tuple[Any, list[str] | None, int]:
    """The tokenized split, its class names, and how many samples were left out for having nothing to learn."""
    raw = read_rows(source)
    names = check_rows(raw, source, data=data, task=task, num_labels=num_labels, names=names)
    check_room(data, tokenizer)
    cache = _cache_key(source, data=data, task=task, tokenizer=tokenizer, names=names)
    text, label = data.text_column, data.label_column
    if data.format != "text":
        check_tokenizer(data, tokenizer)

    def encode(batch):
        if data.format != "text":
            return encode_batch(batch, data, tokenizer)
        out = tokenizer(batch[text], truncation=True, max_length=data.max_length)
        result = {"input_ids": out["input_ids"]}
        if task == "sequence-classification":
            result["label"] = [names.index(str(v)) if names else int(v) for v in batch[label]]
        return result

    dataset = raw.map(encode, batched=True, remove_columns=raw.column_names, new_fingerprint=cache)
    if task == "causal-lm" and data.packing:
        unpacked = dataset
        dataset = dataset.map(_packer(data.max_length), batched=True, remove_columns=dataset.column_names,
                              new_fingerprint=cache + "-packed")
        if len(dataset) == 0:
            tokens = sum(len(ids) for ids in unpacked["input_ids"])
            raise RecipeError(f"{source.key}: {source.path} has {tokens} tokens, fewer than one packed block of "
                              f"data.max_length {data.max_length}; lower data.max_length or add data")
    if task == "sequence-classification":
        return dataset, names, 0
    kept = dataset.filter(_learnable, batched=True, new_fingerprint=cache + "-learnable")
    if len(kept) == 0:
        raise RecipeError(f"{source.key}: {source.path}: no sample has a token to learn from within data.max_length "
                          f"{data.max_length} (prompts that fill it, empty responses, one-token texts); raise "
                          "data.max_length or fix the data")
    return kept, names, len(dataset) - len(kept)


def _learnable(batch) -> list[bool]:
    """Causal LM samples with a position the loss counts (the labels shifted by one, as losses.py does): a prompt
    that fills data.max_length, an empty response or a one-token text teaches nothing, and a global batch of
    only such samples would have no mean loss."""
    labels = batch["labels"] if "labels" in batch else batch["input_ids"]
    return [any(label != IGNORE_INDEX for label in row[1:]) for row in labels]


def _cache_key(source: DataSource, *, data: DataConfig, task: str, tokenizer, names: list[str] | None) -> str:
    """Cache identity: the source's files + tokenizer vocabulary and template + every setting that changes the
    tokens or labels."""
    digest = hashlib.sha256(source.fingerprint().encode())
    digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    digest.update(json.dumps([type(tokenizer).__name__, data.text_column, data.label_column, data.max_length,
                              data.packing, task, data.format, data.messages_column, data.prompt_column,
                              data.response_column, data.chat_template or getattr(tokenizer, "chat_template", None),
                              tokenizer.eos_token, names]).encode())
    return digest.hexdigest()[:32]


def _packer(block: int):
    """Concatenate samples into blocks of `block` tokens; instruction data packs its labels alongside."""
    def pack(batch):
        out = {}
        for column in [c for c in ("input_ids", "labels") if c in batch]:
            stream = [tok for ids in batch[column] for tok in ids]
            usable = len(stream) // block * block
            out[column] = [stream[i:i + block] for i in range(0, usable, block)]
        return out

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
            if "labels" in samples[0]:  # instruction data: the response tokens only
                labels = torch.full((len(samples), length), IGNORE_INDEX, dtype=torch.long)
                for row, sample in enumerate(samples):
                    labels[row, :len(sample["labels"])] = torch.tensor(sample["labels"], dtype=torch.long)
                batch["labels"] = labels
            else:
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
