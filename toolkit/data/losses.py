"""Forward and the loss of one micro-batch, shared by the training loop and evaluation.

The loss is a *sum* over the micro-batch's loss terms (tokens for causal LM, samples for
classification); the loop divides by the count over the whole global batch, so any split of that
batch into ranks and micro-batches gives the same mean.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # label of a position that carries no loss (padding); the value transformers uses


def micro_batch_loss_sum(logits: torch.Tensor, labels: torch.Tensor, task: str, *, shifted: bool = False
                         ) -> torch.Tensor:
    """Sum (not mean) of the loss terms of one micro-batch, in fp32, on the logits' device (with a model
    split over devices that is the last one). A label IGNORE_INDEX carries no loss, in either task. `shifted`
    (causal LM): each label already names the next token (context parallel shifts them over the whole sequence
    before it splits it: strategies/dims/context.py)."""
    logits, labels = logits.float(), labels.to(logits.device, non_blocking=True)
    if task == "causal-lm" and shifted:
        return F.cross_entropy(logits.flatten(0, -2), labels.flatten(), reduction="sum", ignore_index=IGNORE_INDEX)
    if task == "causal-lm":  # predict token t+1 from tokens <= t
        # The labels move, not the logits: the last position gets IGNORE_INDEX (no loss), so the logits are
        # flattened as a view. Slicing them instead copies them in fp32 (T × vocab × 4 bytes) and fills a
        # zero gradient of that size in backward: 14 -> 12 bytes per token × vocab at the head's peak in bf16.
        labels = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        return F.cross_entropy(logits.flatten(0, -2), labels.flatten(), reduction="sum", ignore_index=IGNORE_INDEX)
    return F.cross_entropy(logits, labels, reduction="sum", ignore_index=IGNORE_INDEX)
