"""Held-out loss: the token- (or sample-) weighted mean over the whole eval split, sharded over the data
shards (every rank of a shard runs the same batches; only ranks that compute the loss count it); beside it
accuracy for classification and perplexity (exp of the mean token loss) for a causal LM."""

from __future__ import annotations

import math

import torch

from toolkit.config.recipe import Recipe
from toolkit.data.losses import IGNORE_INDEX, TILED, forward_loss_sum
from toolkit.data.splits import DataLayout, eval_index_batches
from toolkit.process.dist import DistEnv, all_reduce_sum
from toolkit.strategies.base import Strategy


@torch.no_grad()
def evaluate(strategy: Strategy, dataset, *, collator, recipe: Recipe, env: DistEnv, layout: DataLayout,
             group: int) -> dict[str, float]:
    """`group`: micro-batches per forward_only call (a pipeline runs them through its schedule together).
    Returns eval_loss and eval_accuracy (classification) or eval_perplexity (causal LM)."""
    classify = recipe.model.task == "sequence-classification"
    correct = torch.zeros((), dtype=torch.float64)  # of the calls in flight: kept where the call counts its items

    def loss_sum(logits: torch.Tensor, batch: dict) -> torch.Tensor:
        if classify:  # a filler batch's labels are IGNORE_INDEX: never a class, never counted
            correct.add_((logits.argmax(-1).cpu() == batch["labels"]).sum())
        return forward_loss_sum(logits, batch, recipe.model.task)

    def collated(indices: list[int], counted: bool) -> dict:
        batch = collator([dataset[i] for i in indices])
        if not counted:  # a filler that keeps every rank's forward count equal: no loss, no items
            batch["labels"].fill_(IGNORE_INDEX)
            batch["num_items"] = 0
        if recipe.train.tiled_loss:
            batch[TILED] = True
        return batch

    strategy.model.eval()
    sums = torch.zeros(3, dtype=torch.float64)  # loss sum, loss terms, correct predictions
    index_batches = eval_index_batches(len(dataset), micro_batch_size=recipe.batch.micro_batch_size, layout=layout)
    for start in range(0, len(index_batches), group):
        # collated a group at a time: the whole split's batches at once held its tokens three times over (ids,
        # mask, labels as int64) in every rank's memory: 1.2 GB for 100,000 samples of 512 tokens
        batches = [collated(indices, counted) for indices, counted in index_batches[start:start + group]]
        correct.zero_()
        loss, items = strategy.forward_only(batches, loss_sum=loss_sum)  # collective
        sums[0] += loss.item()
        sums[1] += items
        if items:  # a rank that computed the loss but does not count it (a TP group's others) adds nothing
            sums[2] += correct
    strategy.model.train()
    all_reduce_sum(sums, env)
    mean = (sums[0] / sums[1]).item()
    if classify:
        return {"eval_loss": mean, "eval_accuracy": (sums[2] / sums[1]).item()}
    return {"eval_loss": mean, "eval_perplexity": math.exp(min(mean, 700.0))}  # exp(709) is float64's largest
