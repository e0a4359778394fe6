"""A pipeline step's micro-batches as the stages exchange them: one shape for the whole step, since a stage's
receive buffers take the shape of the step that built them: micro × the step's longest sample rounded up to a
multiple of PAD_MULTIPLE (at most data.max_length). Padding every step to max_length cost short texts most of
their compute (the reviews: 16 tokens a sample on average, a step's longest ~23, padded to 64); a multiple of 8
leaves few shapes (two on the reviews: 24 and 32), the last KEPT_SHAPES built kept (strategy.PipelineStrategy)."""

from __future__ import annotations

import torch

from toolkit.data.losses import IGNORE_INDEX


PAD_MULTIPLE = 8
# padded lengths whose stages a rank keeps at once, the least recently used dropped beyond (each keeps receive
# buffers: micro-batches × micro × length × hidden each way); the reviews use 2 lengths, 24 and 32
KEPT_SHAPES = 2


def padded_length(lengths: list[int], *, max_length: int) -> int:
    """The length a step's micro-batches are padded to: their longest, rounded up to PAD_MULTIPLE."""
    return min(max_length, -(-max(lengths) // PAD_MULTIPLE) * PAD_MULTIPLE)


def longest_kept(max_length: int, *, packing: bool) -> list[int]:
    """The padded lengths whose buffers can be held at once at most: the KEPT_SHAPES longest (toolkit plan).
    Packed data has one: every block is max_length tokens (a map batch's partial last block is left out)."""
    if packing:
        return [max_length]
    top = -(-max_length // PAD_MULTIPLE) * PAD_MULTIPLE
    return [min(max_length, top - k * PAD_MULTIPLE) for k in range(KEPT_SHAPES) if top - k * PAD_MULTIPLE > 0]


def stacked(micro_batches: list[dict], *, length: int, rows: int,
            device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The micro-batches as one batch of `rows` × `length` per micro-batch, in order: input ids, attention
    mask and labels, padded (a missing row attends to its first token and carries no loss)."""
    ids, masks, labels = [], [], []
    for batch in micro_batches:
        pad = length - batch["input_ids"].shape[1]
        missing = rows - batch["input_ids"].shape[0]
        ids.append(_pad(batch["input_ids"], pad, missing, 0))
        mask = _pad(batch["attention_mask"], pad, missing, 0)
        if missing:
            mask[-missing:, 0] = 1  # a filler row attends to its first token (no all-masked row); no loss
        masks.append(mask)
        label = batch["labels"]
        labels.append(_pad(label, pad, missing, IGNORE_INDEX) if label.dim() == 2 else
                      torch.cat([label, label.new_full((missing,), IGNORE_INDEX)]))
    return torch.cat(ids).to(device), torch.cat(masks).to(device), torch.cat(labels).to(device)


def filler(like: dict) -> dict:
    """A micro-batch that carries no loss: one row, ignored labels (padded to shape by `stacked`)."""
    labels = like["labels"][:1].clone().fill_(IGNORE_INDEX)
    return {"input_ids": like["input_ids"][:1], "attention_mask": like["attention_mask"][:1], "labels": labels,
            "num_items": 0}


def _pad(tensor: torch.Tensor, columns: int, rows: int, value: int) -> torch.Tensor:
    return torch.nn.functional.pad(tensor, (0, columns, 0, rows), value=value)
