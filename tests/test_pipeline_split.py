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
from toolkit.strategies.pipeline.layout import grid_of, head_rows_of, stage_of_blocks
from toolkit.strategies.pipeline.split import block_costs, cost_balanced_starts, head_split, stage_costs, stage_flops


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


def brute_force_head(costs, *, head, num_parts, vocab):
    """Every placement of the blocks (runs, in order, on the first k + 1 stages) and every cut of the head's rows
    over stages k.. (at least one row each): the least costliest stage, a row costing head / vocab."""
    n, best = len(costs), None
    for k in range(min(num_parts, n)):
        for starts in itertools.combinations(range(1, n), k):
            bounds = [0, *starts, n]
            loads = [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])] + [0.0] * (num_parts - 1 - k)
            for cuts in itertools.combinations(range(1, vocab), num_parts - 1 - k):
                rows = [0, *cuts, vocab]
                held = [loads[i] + (head * (rows[i - k + 1] - rows[i - k]) / vocab if i >= k else 0)
                        for i in range(num_parts)]
                best = max(held) if best is None else min(best, max(held))
    return best


@pytest.mark.parametrize("seed", range(12))
def test_the_head_split_is_within_a_row_of_the_best_of_every_split(seed):
    """split_head: the blocks whole and in order, the head cut at any row; enumerated on small vocabularies. The
    split rounds each cut to a row, so its costliest stage is within a row's cost per stage of the best."""
    rng = random.Random(seed)
    n = rng.randint(1, 5)
    costs = [float(rng.choice([1, 2, 3, 5])) for _ in range(n)]
    num_parts = rng.randint(2, 4)
    vocab = rng.randint(num_parts, 12)
    head = float(rng.choice([1, 6, 20, 40]))
    parts, rows = head_split(costs, head=head, num_parts=num_parts, vocab=vocab)
    assert parts == sorted(parts) and parts[0] == 0 and len(set(parts)) == max(parts) + 1  # runs, in order
    if all(r is None for r in rows):  # no stage splits it: the whole head on the last stage, the default split
        assert max(parts) == num_parts - 1
        loads = stage_flops(costs, head, parts, num_parts)
    else:
        last = max(parts)  # the last block's stage and every later one hold rows, in order, covering the head
        held = [r for r in rows if r is not None]
        assert [s for s, r in enumerate(rows) if r is not None] == list(range(last, num_parts))
        assert held[0][0] == 0 and held[-1][1] == vocab and all(a[1] == b[0] for a, b in zip(held, held[1:]))
        assert all(r[1] > r[0] for r in held)
        loads = stage_costs(costs, head, parts, rows)
    assert max(loads) <= brute_force_head(costs, head=head, num_parts=num_parts, vocab=vocab) + \
        num_parts * head / vocab + 1e-9


def test_the_tied_llamas_head_is_split_over_both_stages():
    """llama-tiny's shape of problem: the head (6 × 32 × 30522 a token) outweighs the four blocks, so without the
    head's rows the stage that holds it is the pipeline; with them the first stage holds every block and some rows,
    and both stages cost the same FLOPs to a row."""
    model, recipe = tied_llama(split_head="true")
    grid = grid_of(recipe, 2)
    parts, _ = stage_of_blocks(model, recipe, grid)
    rows = head_rows_of(model, recipe, grid)
    costs, head = block_costs(model, layer_stack(model), recipe, tp=1, loss_parallel=False)
    assert parts == [0, 0, 0, 0]
    cut = rows[0][1]
    assert rows == [(0, cut), (cut, 30522)]
    # sum(costs) + head × cut / vocab == head × (vocab − cut) / vocab, to a row
    assert abs(sum(costs) + head * cut / 30522 - head * (30522 - cut) / 30522) <= head / 30522
    loads = stage_costs(costs, head, parts, rows)
    assert max(loads) < max(stage_flops(costs, head, stage_of_blocks(*tied_llama(), grid)[0], 2))


def test_a_stage_of_the_heads_rows_keeps_one_fp32_tensor_of_its_logits(tmp_path, monkeypatch):
    """The plan's trace of a stage of rows alone: the row stats keep their rows' exponentials (fp32) for backward
    and nothing else of the logits' size, so 500 more rows of 128 tokens hold 500 × 128 × 4 bytes more."""
    from toolkit.memory.activations import traced_stage
    from toolkit.plan.predict import planned_model

    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path))
    recipe = _split_head_recipe(layers=4)
    how = {"params_dtype": torch.float32, "autocast_dtype": None, "checkpointing": False}
    meta = planned_model(recipe)
    half, whole = (traced_stage(meta, recipe, blocks=0, first=False, last=True, head_rows=rows, **how)
                   for rows in ((500, 1000), (0, 1000)))
    assert whole.held - half.held == 500 * 2 * 64 * 4


def test_the_tied_lookup_and_rows_accumulate_the_gradient_torchs_autograd_gives():
    """split_head's tied first stage (stages._TiedLookup): the lookup and rows of the head as one node writing a
    buffer kept across micro-batches. Three micro-batches accumulated into the weight's .grad, a padding index among
    the ids (torch leaves its row without gradient), equal to plain autograd over F.embedding and a slice; the
    buffer's rows written by the previous micro-batch's tokens must not leak into the next."""
    from toolkit.model.stages import _TiedLookup

    torch.manual_seed(0)
    vocab, hidden, start, end, padding = 50, 8, 10, 30, 3
    weight = torch.randn(vocab, hidden, requires_grad=True)
    reference = weight.detach().clone().requires_grad_(True)
    buffers: dict = {}
    for micro in range(3):
        ids = torch.randint(0, vocab, (2, 5))
        ids[0, micro] = padding
        x = torch.randn(2, 5, hidden)
        looked, rows = _TiedLookup.apply(weight, ids, start, end, padding, buffers)
        loss = ((looked * x).sum(-1, keepdim=True) * (looked @ rows.T)).sum()
        loss.backward()
        plain_looked = torch.nn.functional.embedding(ids, reference, padding_idx=padding)
        plain = ((plain_looked * x).sum(-1, keepdim=True) * (plain_looked @ reference[start:end].T)).sum()
        plain.backward()
        torch.testing.assert_close(weight.grad, reference.grad, rtol=1e-6, atol=1e-6)
    assert len(buffers) == 1  # one buffer, reused by every micro-batch


def test_the_plan_traces_a_tied_first_stage_of_rows_whose_embedding_has_a_padding_index(tmp_path, monkeypatch):
    """The plan traces _TiedLookup's backward on fake tensors: a padding index among the ids must not give it a
    shape that hangs on the data (a filter of the padding tokens made the trace fail)."""
    from toolkit.memory.activations import traced_stage
    from toolkit.plan.predict import planned_model

    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path))
    recipe = _split_head_recipe(layers=2, extra='"pad_token_id": 0, ')
    meta = planned_model(recipe)
    assert meta.get_input_embeddings().padding_idx == 0
    traced = traced_stage(meta, recipe, blocks=2, first=True, last=False, head_rows=(0, 500),
                          params_dtype=torch.float32, autocast_dtype=None, checkpointing=False)
    assert traced.held > 0


def _split_head_recipe(*, layers: int, extra: str = ""):
    """llama-tiny's recipe with a tied Llama of 1,000 tokens' vocabulary, packed 64-token blocks, split_head."""
    model = ('model.config={"model_type": "llama", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128, '
             f'"num_hidden_layers": {layers}, "num_attention_heads": 4, "num_key_value_heads": 2, {extra}'
             '"max_position_embeddings": 256, "tie_word_embeddings": true}')
    return load_recipe(Path(__file__).parents[1] / "recipes" / "llama-tiny.yaml",
                       [model, "data.max_length=64", "data.packing=true", "batch.micro_batch_size=2",
                        "batch.global_batch_size=null", "batch.grad_accum_steps=1", "strategy.name=pipeline",
                        "strategy.split_head=true"])
