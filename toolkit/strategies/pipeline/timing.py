"""strategy.split_by=time: how much longer a block takes per FLOP than the head, measured on the rank at setup.

The default split balances FLOPs (pipeline/split.py). A block also runs memory-bound work its FLOPs do not count:
its norms, rotary embedding, softmax over the scores and gated activation read and write every element of the
hidden states a few times. At hidden 128 on a CPU that is 1 % of a block's FLOPs but a fifth of its time, so a
FLOP-balanced stage of blocks runs longer than a stage of head rows (llama-tiny under split_head: 13 % longer
per micro-batch, the other stage idle for it). Here each rank runs one block and some rows of the head (a
rows-only stage: the matmul, the log-sum-exp and the next-token logit, as training runs them) forward and backward
at the micro-batch's shape on random weights, and the ratio of their seconds per FLOP, averaged over the ranks
(every rank splits alike) and rounded to 2 digits, weights the blocks' FLOPs in the split."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, ContextManager

import torch
from torch import nn

from toolkit.config.recipe import Recipe
from toolkit.cost.op_cost import probe_stage
from toolkit.model.precision import DTYPES
from toolkit.process.dist import DistEnv, all_reduce_sum
from toolkit.strategies.pipeline.split import block_flops

# timed forward + backward passes of each, after one untimed; the median is kept. At 3 the two ranks of a 2-core
# machine, timing at once, read ratios 0.97 and 1.26 for llama-tiny; at 10 they agreed within 0.1
REPEATS, LEAST, BUDGET_S = 10, 3, 2.0  # at least LEAST, then more while under BUDGET_S seconds
PROBE_BYTES = 256 * 2 ** 20  # the most weight of the head's rows timed


def pin_block_time(recipe: Recipe, *, env: DistEnv, length: Callable[[], int] | None = None,
                   resumed: Path | None = None) -> Recipe:
    """`recipe` with strategy.block_time_ratio measured (every rank: collective) where split_by time leaves it
    unset, else as it is: before the run predicts its memory and writes its recipe.yaml, so that both, and a
    toolkit plan of that recipe.yaml, see the rows and blocks the stages get. `length()`: the sequence length to
    time at (steps_length), else data.max_length. A run resuming from checkpoint `resumed` takes the ratio its run
    used, the same stages (none measured: every rank reads the same file)."""
    from toolkit.config.recipe import plan_batch
    from toolkit.model.build import meta_model
    from toolkit.model.precision import Amp
    from toolkit.strategies.pipeline.layout import grid_of

    options = recipe.strategy
    if options.split_by != "time" or options.block_time_ratio is not None:
        return recipe
    kept = _resumed_ratio(resumed) if resumed is not None else None
    if kept is not None:
        if env.is_main:
            print(f"[toolkit] strategy.split_by time: the checkpoint's run weighted a block {kept:g}x the head's "
                  "seconds per FLOP; so does this one (the same stages)", file=sys.stderr, flush=True)
        return dataclasses.replace(recipe, strategy=dataclasses.replace(options, block_time_ratio=kept))
    grid = grid_of(recipe, env.world_size)
    micro_batch = plan_batch(recipe.batch, world_size=grid.dp).micro_batch_size
    start = time.perf_counter()
    tokens = length() if length is not None else recipe.data.max_length
    model = meta_model(recipe.model)
    ratio = measured_ratio(model, recipe, env=env, micro_batch=micro_batch, length=tokens,
                           rows=probe_rows(model, recipe, grid), autocast=Amp(recipe.precision, env.device).autocast)
    if env.is_main:
        print(f"[toolkit] strategy.split_by time: a block takes {ratio:g}x the head's seconds per FLOP here "
              f"(micro-batches of {micro_batch} × {tokens} tokens, measured in {time.perf_counter() - start:.1f} s, "
              f"the ranks' mean); strategy.block_time_ratio={ratio:g} pins it", file=sys.stderr, flush=True)
    return dataclasses.replace(recipe, strategy=dataclasses.replace(options, block_time_ratio=ratio))


def _resumed_ratio(checkpoint: Path) -> float | None:
    """The block_time_ratio a checkpoint's run split by (its recipe.yaml), None where it holds none."""
    from toolkit.checkpoint.store import saved_recipe

    strategy = (saved_recipe(checkpoint) or {}).get("strategy")
    ratio = strategy.get("block_time_ratio") if isinstance(strategy, dict) else None
    if isinstance(ratio, (int, float)) and not isinstance(ratio, bool) and math.isfinite(ratio) and ratio > 0:
        return float(ratio)
    return None


def probe_rows(model: nn.Module, recipe: Recipe, grid: Any) -> int:
    """The rows of the head to time: as many as the stage with the most of them holds under the FLOP split (the
    whole head without split_head), at most PROBE_BYTES of weight. A row's time grows with the rows a stage holds
    (their weight and gradient leave the caches): llama-tiny, 4 × 24 tokens, read ratios 1.19–1.38 at 8,192 rows,
    1.54–1.58 at the 18,349 its rows-only stage holds, 1.62–1.65 at all 30,522."""
    from toolkit.strategies.pipeline.layout import head_rows_of

    flops = dataclasses.replace(recipe, strategy=dataclasses.replace(recipe.strategy, split_by="flops",
                                                                       block_time_ratio=None))
    held = [end - start for start, end in (r for r in head_rows_of(model, flops, grid) if r is not None)]
    config: Any = model.config
    most = max(held) if held else int(config.vocab_size)
    element = DTYPES[recipe.model.load_dtype].itemsize
    return max(1, min(most, PROBE_BYTES // (int(config.hidden_size) * element)))


def steps_length(train_ds: Any, sampler: Any, *, max_length: int, steps: int = 64) -> int:
    """The median length the first `steps` steps pad their micro-batches to (the pipeline pads a step's to their
    longest: batches.padded_length), from the lengths of the samples this rank's `sampler` gives them."""
    from toolkit.strategies.pipeline.batches import padded_length

    lengths = []
    for step in range(min(steps, max(1, sampler.steps_per_epoch))):
        ids = [index for micro in sampler.micro_batches(step) for index in micro]
        lengths.append(padded_length([len(train_ds[index]["input_ids"]) for index in ids], max_length=max_length))
    return int(statistics.median_low(lengths))


def measured_ratio(model: nn.Module, recipe: Recipe, *, env: DistEnv, micro_batch: int, length: int,
                   rows: int, autocast: Callable[[], ContextManager] = contextlib.nullcontext) -> float:
    """The blocks' seconds per FLOP over the head's, on this rank (its first block, `rows` rows of the head, on
    `micro_batch` × `length` tokens), averaged over the world's ranks where a process group runs. At small
    lengths a block's fixed costs weigh more: llama-tiny read 1.16–1.21 at 64 tokens, 1.54–1.58 at 24 (18,349
    rows). Block 0 stands for every block: a stack of blocks unlike each other (dense and expert layers, local and
    global attention) is weighted by its first."""
    config: Any = model.config
    hidden, device = config.hidden_size, env.device
    rows = min(int(config.vocab_size), rows)
    # the whole head, as the stage holding rows of it keeps it (its weight and a gradient buffer of its size): a
    # row's time depends on it (llama-tiny, 24 tokens, 18,349 rows: the ratio read 10 % lower with a head of those
    # rows alone)
    # fresh stages of the model's class (no weights copied), random weights, the recipe's dropout, on the device:
    # transient, before the run builds its model (the head probe holds the head's weight and a gradient buffer of
    # its size, less than the stage holding the head keeps through the run)
    probe = functools.partial(probe_stage, model, device=device, autocast=autocast,
                              dtype=DTYPES[recipe.model.load_dtype], dropout=recipe.model.dropout,
                              blocks=recipe.strategy.blocks)
    block = probe(layer_ids=[0], last=False, head_rows=None)
    head = probe(layer_ids=[], last=True, head_rows=(0, rows))
    dtype = next(block.parameters()).dtype
    x = torch.randn(micro_batch, length, hidden, device=device, dtype=dtype)
    mask = torch.ones(micro_batch, length, dtype=torch.long, device=device)
    labels = torch.randint(0, rows, (micro_batch, length), device=device)
    # a block's FLOPs as the split counts them (split.block_costs, attention at data.max_length, no recomputation),
    # so that the ratio times the split's cost is the time measured
    flops = block_flops(block.blocks()[0], config, length=recipe.data.max_length)
    head_flops = 6.0 * hidden * rows

    def run_block() -> None:
        inputs = x.detach().requires_grad_()
        out = block(inputs, attention_mask=mask)
        out.backward(torch.ones_like(out))

    def run_head() -> None:
        inputs = x.detach().requires_grad_()
        log_sum_exp, target = head(inputs, attention_mask=mask, labels=labels)
        (log_sum_exp - target).sum().backward()

    ratio = (_seconds(run_block, device) / flops) / (_seconds(run_head, device) / head_flops)
    del block, head, x, mask, labels
    if device.type == "cuda":  # the probe's memory is not the run's: its peak is the setup's, as the plan counts
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    ratio = all_reduce_sum(torch.tensor([ratio], dtype=torch.float64), env).item() / env.world_size
    if not math.isfinite(ratio) or ratio <= 0:
        raise RuntimeError(f"strategy.split_by=time measured a block-to-head time ratio of {ratio}; pin "
                           "strategy.block_time_ratio or use split_by flops")
    return max(0.01, round(ratio, 2))  # the ranks' noise is larger than the digits left out


def _seconds(step: Callable[[], None], device: torch.device) -> float:
    times: list[float] = []
    for repeat in range(REPEATS + 1):
        if len(times) >= LEAST and sum(times) > BUDGET_S:
            break
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if repeat:
            times.append(time.perf_counter() - start)
    return statistics.median(times)
