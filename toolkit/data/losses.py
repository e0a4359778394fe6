"""Forward and the loss of one micro-batch, shared by the training loop and evaluation.

The loss is a *sum* over the micro-batch's loss terms (tokens for causal LM, samples for
classification); the loop divides by the count over the whole global batch, so any split of that
batch into ranks and micro-batches gives the same mean.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

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
        return _cross_entropy_sum(logits.flatten(0, -2), labels.flatten())
    if task == "causal-lm":  # predict token t+1 from tokens <= t
        # The labels move, not the logits: the last position gets IGNORE_INDEX (no loss), so the logits are
        # flattened as a view. Slicing them instead copies them in fp32 (T × vocab × 4 bytes) and fills a
        # zero gradient of that size in backward: 14 -> 12 bytes per token × vocab at the head's peak in bf16.
        return _cross_entropy_sum(logits.flatten(0, -2), next_token_labels(labels).flatten())
    return F.cross_entropy(logits, labels, reduction="sum", ignore_index=IGNORE_INDEX)


def next_token_labels(labels: torch.Tensor) -> torch.Tensor:
    """A causal LM's labels moved one left: position t names token t+1 (the last position no loss)."""
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def row_stats(logits: torch.Tensor, labels: torch.Tensor, *, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, over the logits of vocabulary rows [start, start + logits.shape[-1]) (strategy.split_head: a
    pipeline stage's share of the head): their log-sum-exp and the next token's logit where it is one of them
    (else 0), in fp32. `labels` as the loop gives them (not yet moved)."""
    target = next_token_labels(labels.to(logits.device))
    inside = (target >= start) & (target < start + logits.shape[-1])
    index = torch.where(inside, target - start, torch.zeros_like(target))
    return _RowStats.apply(logits, index, inside)


class _RowStats(torch.autograd.Function):
    """row_stats' log-sum-exp (max-shifted, as torch.logsumexp) and picked logit, with one tensor of the logits'
    size kept for backward and one made in it: torch.logsumexp's forward and backward made five (measured: a
    third of a llama-tiny pipeline stage's step with its share of the head, in page faults and passes)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, index: torch.Tensor, inside: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        scores = logits.float()
        top = scores.amax(dim=-1, keepdim=True)
        exp = (scores - top).exp_()
        total = exp.sum(dim=-1, keepdim=True)
        log_sum_exp = (top + total.log()).squeeze(-1)
        picked = scores.gather(-1, index.unsqueeze(-1)).squeeze(-1)
        ctx.save_for_backward(exp, total, index, inside)
        ctx.dtype = logits.dtype
        return log_sum_exp, torch.where(inside, picked, torch.zeros_like(picked))

    @staticmethod
    def backward(ctx: Any, grad_lse: torch.Tensor | None, grad_picked: torch.Tensor | None
                 ) -> tuple[torch.Tensor, None, None]:
        exp, total, index, inside = ctx.saved_tensors
        grad = exp * (grad_lse.unsqueeze(-1) / total) if grad_lse is not None else torch.zeros_like(exp)
        if grad_picked is not None:
            picked = torch.where(inside, grad_picked, torch.zeros_like(grad_picked))
            grad.scatter_add_(-1, index.unsqueeze(-1), picked.unsqueeze(-1))
        return grad.to(ctx.dtype), None, None


def split_head_loss_sum(log_sum_exp: torch.Tensor, target_logit: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The causal-LM cross-entropy sum from the stages' combined row stats: log-sum-exp over the whole vocabulary
    minus the next token's logit, summed over the positions that carry a loss (as micro_batch_loss_sum)."""
    target = next_token_labels(labels.to(log_sum_exp.device))
    terms = log_sum_exp - target_logit
    return torch.where(target != IGNORE_INDEX, terms, torch.zeros_like(terms)).sum()


def _cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy summed over [tokens, vocab] logits. Logits that are a DTensor sharded over the vocabulary
    (strategy.loss_parallel: model/tp_plan.py vocab_plan) reduce across the ranks inside it (torch's loss_parallel);
    the sum, replicated on every rank, returns as a plain tensor."""
    if type(logits) is torch.Tensor or not _is_dtensor(logits):  # a plain tensor, or the plan's fake one
        return F.cross_entropy(logits, labels, reduction="sum", ignore_index=IGNORE_INDEX)
    with vocab_parallel(True):
        loss = F.cross_entropy(logits, labels, reduction="sum", ignore_index=IGNORE_INDEX)
    return loss.to_local()  # type: ignore[attr-defined]


def _is_dtensor(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor  # only where a tensor is of a subclass

    return isinstance(tensor, DTensor)


_VOCAB_PARALLEL = [0]  # how many vocab_parallel(True) contexts are open


@contextlib.contextmanager
def vocab_parallel(on: bool) -> Iterator[None]:
    """Where `on`, torch's loss_parallel: cross-entropy over vocabulary-sharded DTensor logits, forward and backward
    (the strategy's backward opens it too). Nested ones are one: torch's context removes its handlers when it
    exits, which an inner one would do under an outer one. Its handlers are removed on an exception too (torch
    2.13's context does so only when the block ends normally: it is resumed as if it had)."""
    if not on or _VOCAB_PARALLEL[0]:
        yield
        return
    from torch.distributed.tensor.parallel import loss_parallel

    context = loss_parallel()
    context.__enter__()
    _VOCAB_PARALLEL[0] += 1
    try:
        yield
    finally:
        _VOCAB_PARALLEL[0] -= 1
        context.__exit__(None, None, None)


def forward_loss_sum(output: torch.Tensor, batch: dict, task: str) -> torch.Tensor:
    """A micro-batch's loss sum from what its forward returned: under train.tiled_loss (batch[TILED]) the forward
    computed the sum itself, in tiles (strategies/base.py logits_of); else `output` is its logits."""
    if batch.get(TILED):
        return output
    return micro_batch_loss_sum(output, batch["labels"], task, shifted="labels_shifted" in batch)


TILED = "tiled_loss"  # a micro-batch's key: its loss is computed in tiles (train.tiled_loss), set by the loop
TILE_LOGITS = 2 ** 25  # elements of one tile's logits under train.tiled_loss (128 MiB in fp32)


def tile_tokens(vocab: int) -> int:
    """Tokens per tile under train.tiled_loss: a tile's logits hold at most TILE_LOGITS elements."""
    return max(1, TILE_LOGITS // max(1, vocab))


def tiled_loss_sum(hidden: torch.Tensor, head, labels: torch.Tensor, *, shifted: bool = False,
                   tile: int | None = None, vocab: int | None = None) -> torch.Tensor:
    """micro_batch_loss_sum of a causal LM from its last hidden states [B, T, H] and its output layer `head` (a
    callable: hidden -> logits over `vocab` tokens; tiles of tile_tokens(vocab) unless `tile` is given),
    computed in tiles of `tile` tokens: each tile's logits are made, reduced to its loss sum and let go, and made
    again in backward (activation checkpointing of the tile), so the micro-batch's whole [B·T, vocab] logits and
    their fp32 copy and gradient never exist at once, only one tile's. The same sum and gradients as the full
    logits' (the terms are summed in another order)."""
    from torch.utils.checkpoint import checkpoint

    labels = labels.to(hidden.device, non_blocking=True)
    if not shifted:  # predict token t+1 from tokens <= t, as micro_batch_loss_sum
        labels = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    flat, targets = hidden.flatten(0, -2), labels.flatten()
    step = tile or tile_tokens(vocab or int(head.weight.shape[0]))

    def piece(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(head(h).float(), y, reduction="sum", ignore_index=IGNORE_INDEX)

    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, flat.shape[0], step):
        total = total + checkpoint(piece, flat[start:start + step], targets[start:start + step], use_reentrant=False)
    return total
