"""Data: the recipe's splits through `datasets` (toolkit/data/files.py: which files, what they must hold;
toolkit/data/labels.py: class labels), tokenized once (cached on disk), and the global-batch sampler.

The samples of optimizer step k depend only on the seed and the global batch size: step k takes
positions [k·G, (k+1)·G) of a seeded permutation of the train set (a new permutation each epoch).
Ranks and micro-batches then split that global batch; the loss is normalised over all of it, so
world size, micro-batch size and accumulation change the arithmetic order, not the maths.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import torch

from toolkit.config.recipe import BatchPlan, DataConfig
from toolkit.data.files import (DataSource, check_records, check_text_column, columns, data_source, drop_blank_lines,
                                numbers_as_text, read_rows, text_columns)
from toolkit.data.instruct import chat_template_text, check_messages, check_tokenizer, encode_batch, num_cut_tokens
from toolkit.data.labels import check_label_kind, check_labels, class_names, in_model_order, label_ids
from toolkit.data.losses import IGNORE_INDEX
from toolkit.data.progress import Progress
from toolkit.errors import RecipeError
from toolkit.process.dist import DistEnv, broadcast_object, first_error


@dataclass(frozen=True)
class SplitCounts:
    """What reading and tokenizing a split left out or cut, for rank 0's note (see data_note)."""

    num_left_out: int = 0  # samples with no token to learn from
    num_blank: int = 0  # blank lines of a text file, dropped before tokenizing
    num_cut: int = 0  # samples cut at data.max_length (without packing)
    num_tokens_cut: int = 0  # the tokens those lost
    num_tokens: int = 0  # in the split as tokenized whole (before any cut, or before packing)
    num_tokens_unpacked: int = 0  # packing: the tokens of each map batch's last, partial block
    pack_rows: int = 0  # packing: the samples of each map batch (pack_rows)


def load_split(key: str, *, data: DataConfig, task: str, num_labels: int, tokenizer, env: DistEnv,
               names: list[str] | None = None, model_names: list[str] | None = None,
               identity: str | None = None) -> tuple[Any, list[str] | None, SplitCounts]:
    """The tokenized `datasets.Dataset` of recipe key `key` (data.train / data.eval) with input_ids (+ label, or
    labels for instruction data), the class names its labels were mapped from (None: class ids), and what was
    left out or cut (see data_note). Rank 0 tokenizes; then the first rank of every other node reads its cache (the
    nodes share a filesystem) or tokenizes for its node (they do not: a node's own cache folder); then the node's
    other ranks read that cache. Every rank waits for each stage over a group of long timeout, so that a node
    tokenizing long is not a rank timing out in the run's first collective. `names`: data.train's (an eval
    split's labels must be among them); `model_names`: model.path's id2label (see check_rows); `identity`: the
    tokenizer's tokenizer_identity where the caller has it (0.15-0.3 s each for MiniLM's: once per run, not per
    split)."""
    identity = identity or tokenizer_identity(tokenizer)

    def read() -> Any:  # the file found there too: a node without it says so through the stages below
        source = data_source(key, getattr(data, key.split(".")[-1]))
        return _tokenized(source, data=data, task=task, num_labels=num_labels, tokenizer=tokenizer, names=names,
                          model_names=model_names, identity=identity)

    def read_or_error(who: str) -> tuple[Any, str | None]:
        try:
            return read(), None
        except RecipeError as exc:
            return None, f"{who}{exc}"
        except OSError as exc:  # a node's disk: its cache folder read-only or full, a file unreadable there
            return None, f"{who}{key}: {exc}"
    split: Any = None
    error: str | None = None
    if env.is_main:
        split, error = read_or_error("")
    # the other ranks fail with rank 0's message instead of hanging, and wait as long as its tokenizing takes
    error = broadcast_object(error, env)
    if error is not None:
        raise RecipeError(error)
    if env.local_rank == 0 and not env.is_main:  # a node's first rank: rank 0's cache, or its node's tokenizing
        split, error = read_or_error(f"rank {env.rank}: ")  # what another node's files say (one missing there)
    error = first_error(error, env)
    if error is not None:
        raise RecipeError(error)
    if env.local_rank != 0:  # reads its node's cache
        split = read()
    return split


def data_note(key: str, counts: SplitCounts, data: DataConfig) -> str | None:
    """One line on what of a split the run does not train or evaluate on; None where it uses all of it."""
    parts = []
    if counts.num_blank:
        parts.append(f"{counts.num_blank} blank line(s) left out")
    if counts.num_left_out and data.packing:  # instruction data: blocks of prompt text only (all full blocks)
        blocks = (counts.num_tokens - counts.num_tokens_unpacked) // data.max_length
        tokens = counts.num_left_out * data.max_length
        parts.append(f"{counts.num_left_out} of {blocks} packed blocks of data.max_length {data.max_length} tokens "
                     f"hold no response token: {tokens:,} of {counts.num_tokens:,} tokens "
                     f"({_share(tokens, counts.num_tokens)}) left out, and a response whose prompt began in "
                     "another block is trained without it; raise data.max_length, or leave data.packing off for "
                     "prompts this long")
    elif counts.num_left_out:
        parts.append(f"{counts.num_left_out} sample(s) have no token to learn from within data.max_length "
                     f"{data.max_length} (a prompt that fills it, an empty response, a one-token text); left out")
    if counts.num_cut:
        parts.append(f"{counts.num_cut} sample(s) longer than data.max_length {data.max_length} were cut, dropping "
                     f"{counts.num_tokens_cut:,} of {counts.num_tokens:,} tokens "
                     f"({_share(counts.num_tokens_cut, counts.num_tokens)}); raise data.max_length, or set "
                     "data.packing: true (causal-lm) to keep them")
    if counts.num_tokens_unpacked:
        parts.append(f"{counts.num_tokens_unpacked:,} of {counts.num_tokens:,} tokens "
                     f"({_share(counts.num_tokens_unpacked, counts.num_tokens)}) are left out of packing: the "
                     f"partial block at the end of every {counts.pack_rows} samples")
    return f"[toolkit] {key}: {'; '.join(parts)}" if parts else None


def data_record(counts: SplitCounts, *, num_samples: int, data: DataConfig) -> dict:
    """run.json's account of one split: the samples the run reads (blocks, under packing) and what reading and
    tokenizing left out or cut (the numbers of data_note's line, kept where the line scrolls away)."""
    return {"samples": num_samples, "packed": data.packing, "tokens": counts.num_tokens,
            "blank_lines_left_out": counts.num_blank, "samples_left_out": counts.num_left_out,
            "samples_cut": counts.num_cut, "tokens_cut": counts.num_tokens_cut,
            "tokens_left_out_of_packing": counts.num_tokens_unpacked}


def _share(part: int, whole: int) -> str:
    share = part / max(whole, 1)
    return "<0.1%" if 0 < share < 0.001 else f"{share:.1%}"


def check_one_batch(num_samples: int, *, global_batch_size: int, num_left_out: int = 0) -> None:
    """The train split fills one global batch (the sampler steps through whole global batches only)."""
    if num_samples < global_batch_size:
        left_out = f" ({num_left_out} left out: no token to learn from)" if num_left_out else ""
        raise RecipeError(f"data: {num_samples} train samples{left_out} are fewer than one global batch of "
                          f"{global_batch_size}; lower batch sizes or add data")


def check_rows(raw, source: DataSource, *, data: DataConfig, task: str, num_labels: int,
               names: list[str] | None = None, model_names: list[str] | None = None) -> list[str] | None:
    """The columns the recipe's format reads exist and hold what training needs. Returns the class names a
    training split's named labels map from (the class id is the position: model.path's id2label order where it
    names the same labels, `model_names`; else sorted), None for class ids."""
    check_records(raw, source)
    if data.format == "chat":
        if data.messages_column not in raw.column_names:
            raise RecipeError(f"{source.key}: {source.path} has no column {data.messages_column!r} (it has "
                              f"{columns(raw)}); set data.messages_column to one of those")
        check_messages(raw[data.messages_column], source.key, source.path, data.messages_column)
    elif data.format == "prompt-response":
        check_text_column(raw, source, data.prompt_column, "data.prompt_column", may_be_empty=True)
        check_text_column(raw, source, data.response_column, "data.response_column")
    else:
        check_text_column(raw, source, data.text_column, "data.text_column")
    if task != "sequence-classification":
        return None
    assert data.label_column is not None  # Recipe: required for sequence-classification
    if names is None and source.key == "data.train":
        names = in_model_order(class_names(raw, source, data.label_column), model_names)
        if names is not None and len(names) != num_labels:
            raise RecipeError(f"{source.key}: {source.path} has {len(names)} labels ({', '.join(names[:8])}) but "
                              f"model.num_labels is {num_labels}; set model.num_labels: {len(names)}")
    else:
        check_label_kind(raw, source, column=data.label_column, named=names is not None)
    check_labels(raw, source, data, num_labels=num_labels, names=names)
    return names


def check_room(data: DataConfig, tokenizer) -> None:
    """data.max_length holds more than the special tokens the tokenizer adds to every sample."""
    special = tokenizer.num_special_tokens_to_add()
    if data.format != "chat" and data.max_length <= special:  # the tokenizer would not truncate at all
        raise RecipeError(f"data.max_length {data.max_length} leaves no room for text: the tokenizer adds {special} "
                          f"special tokens to every sample; set data.max_length above {special}")


def _tokenized(source: DataSource, *, data: DataConfig, task: str, num_labels: int, tokenizer,
               names: list[str] | None, model_names: list[str] | None,
               identity: str) -> tuple[Any, list[str] | None, SplitCounts]:
    """The tokenized split, its class names, and what was left out or cut. Without packing each sample is cut at
    data.max_length; with it, samples are tokenized whole and their stream cut into blocks (as transformers'
    run_clm does): a long document becomes many blocks, none of it lost."""
    raw = read_rows(source, text=text_columns(data))
    names = check_rows(raw, source, data=data, task=task, num_labels=num_labels, names=names,
                       model_names=model_names)
    check_room(data, tokenizer)
    data = chat_template_text(data)  # a path to a template file: its text (what the cache keys, too)
    cache = _cache_key(source, data=data, task=task, tokenizer=tokenizer, names=names, identity=identity)
    text, label = data.text_column, data.label_column
    if data.format != "text":
        check_tokenizer(data, tokenizer)
    raw = numbers_as_text(raw, text_columns(data), fingerprint=cache + "-numbers")
    raw, num_blank = drop_blank_lines(raw, source, text, fingerprint=cache + "-lines")
    packing = task == "causal-lm" and data.packing
    label_feature = raw.features[label] if task == "sequence-classification" else None
    max_length = None if packing else data.max_length

    progress = Progress(source.key, total=len(raw))

    def encode(batch, indices):
        progress.advance(len(indices))
        if data.format != "text":
            return encode_batch(batch, data, tokenizer, indices=indices, where=f"{source.key}: {source.path}")
        out = tokenizer(batch[text], truncation=not packing, max_length=max_length)
        result = {"input_ids": out["input_ids"],
                  "num_cut": num_cut_tokens(batch[text], out["input_ids"], tokenizer, max_length=max_length)}
        if task == "sequence-classification":  # renamed to label below: a map's output column named as an input
            # column of large_string type (a CSV's or parquet's names) kept that type, the ids '0', '1' as text
            result[CLASS_ID] = label_ids(batch[label], label_feature, names)
        return result

    encoded = raw.map(encode, batched=True, with_indices=True, remove_columns=raw.column_names,
                      new_fingerprint=cache)
    progress.finish()
    num_tokens = _sum(pc.list_value_length(encoded.data.column("input_ids")))
    cut = encoded.data.column("num_cut")
    counts = SplitCounts(num_blank=num_blank, num_cut=_sum(pc.greater(cut, 0)), num_tokens_cut=_sum(cut),
                         num_tokens=num_tokens + _sum(cut))
    dataset = encoded.remove_columns("num_cut")
    if task == "sequence-classification":
        dataset = dataset.rename_column(CLASS_ID, "label")
    if packing:
        rows = pack_rows(data.max_length, rows=len(dataset), tokens=num_tokens)
        cache = f"{cache}-packed-{rows}"  # what follows is keyed by the packing batches too
        dataset = dataset.map(_packer(data.max_length), batched=True, batch_size=rows,
                              remove_columns=dataset.column_names, new_fingerprint=cache)
        if len(dataset) == 0:
            raise RecipeError(f"{source.key}: {source.path} has {num_tokens} tokens, fewer than one packed block of "
                              f"data.max_length {data.max_length}; lower data.max_length or add data")
        counts = replace(counts, num_tokens_unpacked=num_tokens - len(dataset) * data.max_length, pack_rows=rows)
    if task == "sequence-classification":
        return dataset, names, counts
    # keyed by what it filters (cache: the packed blocks' under packing): another packing's index list is other rows
    kept = dataset.filter(_learnable, batched=True, new_fingerprint=cache + "-learnable")
    if len(kept) == 0:
        raise RecipeError(f"{source.key}: {source.path}: no sample has a token to learn from within data.max_length "
                          f"{data.max_length} (prompts that fill it, empty responses, one-token texts); raise "
                          "data.max_length or fix the data")
    return kept, names, replace(counts, num_left_out=len(dataset) - len(kept))


def _sum(values) -> int:
    """An arrow column's sum as an int (0 for none): no Python pass over the column."""
    return int(pc.sum(values).as_py() or 0)


def _learnable(batch) -> list[bool]:
    """Causal LM samples with a position the loss counts (the labels shifted by one, as losses.py does): a prompt
    that fills data.max_length, an empty response or a one-token text teaches nothing, and a global batch of
    only such samples would have no mean loss."""
    labels = batch["labels"] if "labels" in batch else batch["input_ids"]
    return [any(label != IGNORE_INDEX for label in row[1:]) for row in labels]


# what the cached columns mean: a change to how samples are tokenized gives them a new name, so that a cache an
# older toolkit wrote is not read as this one's (v2: packing tokenizes whole documents; blank text lines dropped;
# v3: an instruction token that overlaps a response is trained, where v2 trained one that starts in it; v4: class
# ids mapped from names are ints, where a large_string label column kept them as text)
TOKENIZED_VERSION = "tokenized-v4"
CLASS_ID = "class_id"  # the tokenizing map's name for a sample's class id, `label` once mapped


def _cache_key(source: DataSource, *, data: DataConfig, task: str, tokenizer, names: list[str] | None,
               identity: str) -> str:
    """Cache identity: the source's files + how the tokenizer tokenizes + every setting that changes the tokens
    or labels."""
    digest = hashlib.sha256(source.fingerprint().encode())
    digest.update(TOKENIZED_VERSION.encode())
    digest.update(identity.encode())  # tokenizer_identity(tokenizer)
    digest.update(json.dumps([data.text_column, data.label_column, data.max_length, data.packing, task, data.format,
                              data.messages_column, data.prompt_column, data.response_column,
                              data.chat_template or getattr(tokenizer, "chat_template", None), names]).encode())
    return digest.hexdigest()[:32]


def tokenizer_identity(tokenizer) -> str:
    """A digest of everything that decides a tokenizer's ids: two tokenizers with one vocabulary can still
    tokenize differently (a post-processor that adds BOS, a normalizer that lower-cases, another truncation side).
    Stable across processes: file contents, never the folder's path."""
    digest = hashlib.sha256(type(tokenizer).__name__.encode())
    digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # a fast tokenizer: its whole pipeline, as tokenizer.json holds it
        state = json.loads(backend.to_str())
        for key in ("truncation", "padding"):  # set by each call from its own arguments (which the key has)
            state.pop(key, None)
        digest.update(json.dumps(state, sort_keys=True).encode())
    digest.update(json.dumps([tokenizer.truncation_side, _described(tokenizer.special_tokens_map),
                              _described(tokenizer.init_kwargs)], sort_keys=True).encode())
    return digest.hexdigest()


def _described(value: Any, key: str = "") -> Any:
    """init_kwargs as JSON: a file a slow tokenizer reads (vocab_file, a SentencePiece model) by its content, not
    its path; the folder's own path left out; AddedToken and other objects by their repr."""
    if key == "name_or_path":
        return None
    if isinstance(value, str) and key.endswith("_file") and Path(value).is_file():
        return hashlib.sha256(Path(value).read_bytes()).hexdigest()
    if isinstance(value, dict):
        return {str(k): _described(v, str(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_described(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return repr(value)


PACK_ROWS = 1000  # samples per packing batch at least: its stream's last partial block is left out (run_clm's
PACK_BLOCKS = 32  # group_texts); and enough samples for this many blocks on average, so that at most about 1/32 of
#   the tokens is left out however long a block is (1,000 short reviews did not fill one block of 16,384 tokens)


def pack_rows(block: int, *, rows: int, tokens: int) -> int:
    """Samples per packing batch for blocks of `block` tokens, of a split of `rows` samples and `tokens` tokens:
    PACK_ROWS, or more where that many hold fewer than PACK_BLOCKS blocks; at most the whole split."""
    wanted = -(-PACK_BLOCKS * block * rows // max(tokens, 1))
    return max(1, min(rows, max(PACK_ROWS, wanted)))


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
        # pinned pages only speed up copies to a GPU: without one torch warns (several lines) and pins nothing
        num_workers=data.num_workers, pin_memory=data.pin_memory and torch.cuda.is_available())
