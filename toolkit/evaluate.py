"""Held-out loss: the token- (or sample-) weighted mean over the whole eval split, sharded over ranks."""

from __future__ import annotations

import torch

from toolkit.data import eval_index_batches
from toolkit.dist import DistEnv, all_reduce_sum
from toolkit.losses import forward_logits, micro_batch_loss_sum
from toolkit.recipe import Recipe


@torch.no_grad()
def evaluate(strategy, dataset, *, collator, recipe: Recipe, env: DistEnv) -> float:
    strategy.model.eval()
    sums = torch.zeros(2, dtype=torch.float64)
    for indices, counts in eval_index_batches(len(dataset), micro_batch_size=recipe.batch.micro_batch_size, env=env):
        batch = collator([dataset[i] for i in indices])
        logits = forward_logits(strategy, batch, env.device)  # every rank runs forward: sharded params gather
        if counts:
            sums[0] += micro_batch_loss_sum(logits, batch["labels"].to(env.device), recipe.model.task).item()
            sums[1] += batch["num_items"]
    strategy.model.train()
    all_reduce_sum(sums, env)
    return (sums[0] / sums[1]).item()
