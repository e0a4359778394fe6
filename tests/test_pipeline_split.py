"""The default pipeline split by FLOPs: exact against every split enumerated, and on the tied Llama not the split
a parameter count gives (its tied embedding counted where a lookup is nearly free)."""

import itertools
import random
from pathlib import Path

import pytest
import torch

from toolkit.config.files import load_recipe
from toolkit.model.blocks import layer_stack
from toolkit.model.placement import part_of_blocks
from toolkit.strategies.pipeline.layout import grid_of, stage_of_blocks
from toolkit.strategies.pipeline.split import block_costs, cost_balanced_starts, stage_flops


def brute_force(costs, *, last_extra, num_parts):
    """Every way to cut the blocks into num_parts runs: the least (costliest part, fullest part)."""
    n, best = len(costs), None
    for starts in itertools.combinations(range(1, n), num_parts - 1):
        bounds = [0, *starts, n]
        parts = [(sum(costs[a:b]), b - a) for a, b in zip(bounds, bounds[1:])]
        parts[-1] = (parts[-1][0] + last_extra, parts[-1][1])
        key = (max(c for c, _ in parts), max(k for _, k in parts))
        best = key if best is None or key < best else best
    return best


def key_of(costs, starts, *, last_extra):
    bounds = [0, *starts, len(costs)]
    parts = [[sum(costs[a:b]), b - a] for a, b in zip(bounds, bounds[1:])]
    parts[-1][0] += last_extra
    return max(c for c, _ in parts), max(k for _, k in parts)


@pytest.mark.parametrize("seed", range(20))
def test_the_split_is_the_best_of_every_split(seed):
    rng = random.Random(seed)
    n = rng.randint(2, 9)
    costs = [float(rng.choice([1, 2, 3, 5, 8])) for _ in range(n)]
    num_parts = rng.randint(2, n)
    last_extra = float(rng.choice([0, 1, 4, 20]))
    starts = cost_balanced_starts(costs, last_extra=last_extra, num_parts=num_parts)
    assert len(starts) == num_parts - 1 and starts == sorted(set(starts)) and 0 < starts[0] and starts[-1] < n
    assert key_of(costs, starts, last_extra=last_extra) == \
        brute_force(costs, last_extra=last_extra, num_parts=num_parts)


def tied_llama(**strategy):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=30522, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=True)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    overrides = [f"strategy.{k}={v}" for k, v in strategy.items()]
    recipe = load_recipe(Path(__file__).parents[1] / "recipes" / "llama-tiny.yaml", ["strategy.name=pipeline", *overrides])
    return model, recipe


def test_the_tied_llama_is_split_by_flops_not_parameters():
    model, recipe = tied_llama()
    grid = grid_of(recipe, 2)
    parts, stages = stage_of_blocks(model, recipe, grid)
    blocks = layer_stack(model)
    by_params = part_of_blocks(model, blocks=blocks, num_parts=2, split=None)
    # the head (6 × 32 × 30522 FLOPs a token) outweighs all four blocks: the last stage keeps one block
    assert parts == [0, 0, 0, 1] and by_params == [0, 0, 1, 1]
    costs, head = block_costs(model, blocks, recipe, tp=1, loss_parallel=False)
    assert head == 6 * 32 * 30522
    # each block: 6 × its matrices (q 32×32, k and v 32×16, o 32×32, three 32×64 MLP) + 12 × hidden × 64 tokens
    assert costs == [6.0 * (2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 64) + 12 * 32 * 64] * 4
    ours = max(stage_flops(costs, head, parts, stages))
    theirs = max(stage_flops(costs, head, by_params, stages))
    assert ours < theirs


def test_a_users_split_still_wins():
    model, recipe = tied_llama(split="[2]")
    assert stage_of_blocks(model, recipe, grid_of(recipe, 2))[0] == [0, 0, 1, 1]


def test_the_plan_line_gives_each_stages_flops_per_step():
    from toolkit.strategies.pipeline.rules import stage_lines

    model, recipe = tied_llama()
    costs, head = block_costs(model, layer_stack(model), recipe, tp=1, loss_parallel=False)
    lines = stage_lines(model, recipe, world_size=2)
    batch_tokens = recipe.batch.global_batch_size * recipe.data.max_length  # one pipeline runs the whole batch
    first, last = 3 * costs[0] * batch_tokens / 1e9, (costs[0] + head) * batch_tokens / 1e9
    share = round(100 * first / (first + last))
    assert lines == ["stages (split by FLOPs; forward + backward FLOPs per step):",
                     f"  stage 0: blocks 0-2, {first:.2f} GFLOP ({share} %)",
                     f"  stage 1: blocks 3 + head, {last:.2f} GFLOP ({100 - share} %)"]


def test_tensor_parallel_stages_are_split_by_a_tp_ranks_flops():
    """On tp stages a rank computes 1/tp of each block but, without loss_parallel, the whole head: the head weighs
    tp times more against the blocks, and the balanced split gives the last stage fewer blocks than one rank's
    pipeline would. Under loss_parallel the head is split too, and the split is one process's again."""
    from transformers import LlamaConfig, LlamaForCausalLM

    _, recipe = tied_llama()
    block = 6.0 * (2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 64) + 12 * 32 * recipe.data.max_length
    vocab = round(2 * block / (6 * 32))  # the head costs about two blocks
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)

    def split(*overrides):
        recipe = load_recipe(Path(__file__).parents[1] / "recipes" / "llama-tiny.yaml",
                             ["strategy.name=pipeline", *overrides])
        return stage_of_blocks(model, recipe, grid_of(recipe, 4 if overrides else 2))[0]

    def best(costs, head):
        starts = cost_balanced_starts(costs, last_extra=head, num_parts=2)
        assert key_of(costs, starts, last_extra=head) == brute_force(costs, last_extra=head, num_parts=2)
        return [0] * starts[0] + [1] * (8 - starts[0])

    head = 6.0 * 32 * vocab
    assert split() == best([block] * 8, head) == [0] * 5 + [1] * 3
    assert split("strategy.tp_degree=2") == best([block / 2] * 8, head) == [0] * 6 + [1] * 2
    assert split("strategy.tp_degree=2", "strategy.loss_parallel=true") == split()
