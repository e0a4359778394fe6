"""Held-out loss: the token- (or sample-) weighted mean over the whole eval split, sharded over the data
shards (every rank of a shard runs the same batches; only ranks that compute the loss count it)."""

from __future__ import annotations

import torch

from toolkit.data import DataLayout, eval_index_batches
from toolkit.dist import DistEnv, all_reduce_sum
from toolkit.losses import IGNORE_INDEX, micro_batch_loss_sum
from toolkit.recipe import Recipe
from toolkit.strategies.base import Strategy


@torch.no_grad()
def evaluate(strategy: Strategy, dataset, *, collator, recipe: Recipe, env: DistEnv, layout: DataLayout,
             group: int) -> float:
    """`group`: micro-batches per forward_only call (a pipeline runs them through its schedule together)."""
    def loss_sum(logits: torch.Tensor, batch: dict) -> torch.Tensor:
        return micro_batch_loss_sum(logits, batch["labels"], recipe.model.task)

    strategy.model.eval()
    sums = torch.zeros(2, dtype=torch.float64)
    batches = []
    for indices, counted in eval_index_batches(len(dataset), micro_batch_size=recipe.batch.micro_batch_size,
                                               layout=layout):
        batch = collator([dataset[i] for i in indices])
        if not counted:  # a filler that keeps every rank's forward count equal: no loss, no items
            batch["labels"].fill_(IGNORE_INDEX)
            batch["num_items"] = 0
        batches.append(batch)
    for start in range(0, len(batches), group):
        loss, items = strategy.forward_only(batches[start:start + group], loss_sum=loss_sum)  # collective
        sums[0] += loss.item()
        sums[1] += items
    strategy.model.train()
    all_reduce_sum(sums, env)
    return (sums[0] / sums[1]).item()
