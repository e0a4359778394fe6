"""The default pipeline split: consecutive blocks per stage, chosen so that the costliest stage costs as little as
it can, counted in forward + backward FLOPs from the model's shapes (toolkit/cost/flops.py):
  a block     6 × its matrix elements (a mixture of experts: the routed top-k) + 12 × hidden × sequence length
              (attention's scores and values), 4/3 of that under full activation checkpointing (the
              recomputation); under selective, 2 × the elements of the matrices it recomputes more
  the head    6 × hidden × vocabulary on the last stage (its matmul; the loss over the logits is ~1/hidden of it)
  embeddings  nothing: a lookup is not a matmul
On tensor-parallel stages the costs are a tp rank's: a block's matmuls and attention heads are split over the tp
ranks, the head only under loss_parallel (without it every tp rank computes the whole head), so there the head
weighs tp times more against the blocks.
Among splits whose costliest stage is equal, the one with the fewest blocks on its fullest stage wins (activation
memory grows with the blocks a stage keeps). A parameter count is the wrong measure: a tied embedding counts on the
first stage, where its lookup is nearly free, and the head's FLOPs on the last stage, which a parameter split
leaves with as many blocks as the first."""

from __future__ import annotations

from typing import Any

from torch import nn

from toolkit.config.recipe import Recipe
from toolkit.cost.flops import block_elements, head_elements


def block_costs(model: nn.Module, blocks: list[nn.Module], recipe: Recipe, *, tp: int,
                loss_parallel: bool) -> tuple[list[float], float]:
    """Per token, each block's forward + backward FLOPs, and the head's (on the last stage), on one tp rank of
    `tp` (the head split with them under `loss_parallel` only)."""
    config: Any = getattr(model, "config", None)
    recompute = recipe.train.recompute
    full = 4 / 3 if recompute == "full" else 1.0

    def cost(block: nn.Module) -> float:
        selective = 2.0 * block_elements(block, config, recomputed=True) if recompute == "selective" else 0.0
        return float(round(block_flops(block, config, length=recipe.data.max_length) * full + selective))

    head = 6.0 * head_elements(model)
    return [cost(block) / tp for block in blocks], head / tp if loss_parallel else head


def block_flops(block: nn.Module, config: Any, *, length: int) -> float:
    """Per token, a block's forward + backward FLOPs without recomputation: 6 × its matrix elements and 12 ×
    hidden × `length` (attention's scores and values)."""
    hidden = getattr(config, "hidden_size", 0) or 0
    return 6.0 * block_elements(block, config) + 12.0 * hidden * length


def cost_balanced_starts(costs: list[float], *, last_extra: float, num_parts: int) -> list[int]:
    """Block index where each later part starts: the split whose costliest part (the last one carrying
    `last_extra`) costs least, then whose fullest part holds the fewest blocks. Exact (dynamic programming over
    where the parts end), not greedy."""
    _, _, starts = _best_splits(costs, num_parts=num_parts, last_extra=last_extra)
    return _later_starts(starts, parts=num_parts, end=len(costs))


Table = list[list[tuple[float, int]]]


def _best_splits(costs: list[float], *, num_parts: int, last_extra: float = 0.0) -> tuple[list[float], Table,
                                                                                           list[list[int]]]:
    """The blocks' prefix sums and, by dynamic programming over where the parts end: best[j][i], the least
    (costliest part, most blocks in a part) of the first i blocks cut into j runs (the j-th carrying `last_extra`
    where j is num_parts), and starts[j][i], where the j-th run starts in that split."""
    n = len(costs)
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    worst = (float("inf"), n + 1)
    best = [[worst] * (n + 1) for _ in range(num_parts + 1)]
    starts = [[0] * (n + 1) for _ in range(num_parts + 1)]
    best[0][0] = (0.0, 0)
    for j in range(1, num_parts + 1):
        extra = last_extra if j == num_parts else 0.0
        for i in range(j, n + 1):
            for t in range(j - 1, i):
                before = best[j - 1][t]
                part = (prefix[i] - prefix[t] + extra, i - t)
                key = (max(before[0], part[0]), max(before[1], part[1]))
                if key < best[j][i]:
                    best[j][i], starts[j][i] = key, t
    return prefix, best, starts


def _later_starts(starts: list[list[int]], *, parts: int, end: int) -> list[int]:
    """Where runs 2..`parts` start in the best split of the first `end` blocks into `parts` runs."""
    out = []
    for j in range(parts, 1, -1):
        end = starts[j][end]
        out.append(end)
    return sorted(out)


def stage_flops(costs: list[float], head: float, parts: list[int], num_stages: int) -> list[float]:
    """Per token, each stage's forward + backward FLOPs under the split `parts` (the stage of every block)."""
    out = [0.0] * num_stages
    for cost, stage in zip(costs, parts):
        out[stage] += cost
    out[-1] += head
    return out



Rows = tuple[int, int]  # a stage's rows of the vocabulary, [start, end)


def head_split(costs: list[float], *, head: float, num_parts: int, vocab: int) -> tuple[list[int], list[Rows | None]]:
    """strategy.split_head: the stage of every block and each stage's rows of the head (None: none), so that the
    costliest stage costs least, the head's cost dividing with its rows (head / vocab each). The blocks stay whole
    and in order; the stage of the last block (it also runs the final norm) and every stage after it take rows,
    at least one each, the later ones nothing else. Where the costliest stage is least with the whole head on the
    last stage, no stage splits it (every entry None: the default split)."""
    n = len(costs)
    # the stages before the last block's: the best splits of the blocks before it (no head on any of them)
    prefix, best, starts = _best_splits(costs, num_parts=num_parts - 1)
    choice: tuple[tuple[float, int], int, int, float] | None = None  # (key, last block's stage k, its start, level)
    for k in range(min(num_parts, n)):
        rows_only = num_parts - 1 - k
        if rows_only > vocab - 1:
            continue
        for t in range(k, n):
            before = best[k][t]
            own = prefix[n] - prefix[t]
            level = max(own, (head + own) / (rows_only + 1)) if rows_only else own + head
            key = (max(before[0], level), max(before[1], n - t))
            if choice is None or key < choice[0]:
                choice = (key, k, t, level)
    if choice is None:
        raise ValueError(f"{num_parts} stages for {n} blocks and {vocab} rows of the head")
    _, k, t, level = choice
    cuts = [*_later_starts(starts, parts=k, end=t), t] if k else []  # where stages 1..k start
    parts = [sum(1 for cut in cuts if index >= cut) for index in range(n)]
    rows: list[Rows | None] = [None] * num_parts
    if k == num_parts - 1:
        return parts, rows
    own = prefix[n] - prefix[t]
    shares = [max(0.0, level - own)] + [level] * (num_parts - 1 - k)
    total = sum(shares) or 1.0
    bounds, running = [0], 0.0
    for share in shares[:-1]:
        running += share
        bounds.append(round(running / total * vocab))
    bounds.append(vocab)
    for index in range(1, len(bounds)):  # at least one row each, in order
        bounds[index] = max(bounds[index], bounds[index - 1] + 1)
    for index in range(len(bounds) - 2, 0, -1):
        bounds[index] = min(bounds[index], bounds[index + 1] - 1)
    for offset, stage in enumerate(range(k, num_parts)):
        rows[stage] = (bounds[offset], bounds[offset + 1])
    return parts, rows


def stage_costs(costs: list[float], head: float, parts: list[int], rows: list[Rows | None]) -> list[float]:
    """Per token, each stage's forward + backward FLOPs: its blocks, and the head (the last stage's, or under
    strategy.split_head each stage's rows of it: the last stage's rows end at the vocabulary's size)."""
    out = stage_flops(costs, 0.0, parts, len(rows))
    if all(r is None for r in rows):
        out[-1] += head
        return out
    vocab = max(r[1] for r in rows if r is not None)
    for stage, bounds in enumerate(rows):
        if bounds is not None:
            out[stage] += head * (bounds[1] - bounds[0]) / vocab
    return out
