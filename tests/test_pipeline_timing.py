"""strategy.split_by time: the split weights the blocks' FLOPs by how much longer a block takes per FLOP than the
head (toolkit/strategies/pipeline/timing.py), measured on the ranks at start or pinned by strategy.block_time_ratio."""

import json
import time
from pathlib import Path

import pytest
import torch

from test_model_parallel import ARMS
from test_pipeline_split import brute_force, key_of, tied_llama
from toolkit.config.files import load_recipe
from toolkit.model.blocks import layer_stack
from toolkit.strategies.pipeline.layout import grid_of, head_rows_of, stage_of_blocks
from toolkit.process.dist import DistEnv
from toolkit.strategies.pipeline.split import block_costs

ONE = DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
TWO = DistEnv(rank=0, local_rank=0, world_size=2, device=torch.device("cpu"))  # measured_ratio replaced there


def test_a_pinned_ratio_gives_the_first_stage_fewer_rows_and_balances_the_weighted_stages():
    """llama-tiny's shape under split_head: the first stage holds the 4 blocks and rows, the second rows alone.
    With blocks twice as slow per FLOP as the head, the rows move to the second stage until 2 × the blocks' FLOPs
    plus the first stage's rows cost what the second stage's rows cost, to a row."""
    model, flops_recipe = tied_llama(split_head="true")
    _, recipe = tied_llama(split_head="true", split_by="time", block_time_ratio=2.0)
    grid = grid_of(recipe, 2)
    costs, head = block_costs(model, layer_stack(model), recipe, tp=1, loss_parallel=False)  # FLOPs, unweighted
    cut = head_rows_of(model, recipe, grid)[0][1]
    assert head_rows_of(model, recipe, grid) == [(0, cut), (cut, 30522)]
    assert stage_of_blocks(model, recipe, grid)[0] == [0, 0, 0, 0]
    assert abs(2.0 * sum(costs) + head * cut / 30522 - head * (30522 - cut) / 30522) <= head / 30522
    flops_cut = head_rows_of(model, flops_recipe, grid)[0][1]
    assert cut < flops_cut  # the blocks weigh more: the first stage keeps fewer rows than FLOPs alone give it


@pytest.mark.parametrize("ratio", [0.5, 3.0, 100.0])
def test_a_pinned_ratio_splits_the_blocks_as_the_best_split_of_the_weighted_costs(ratio):
    """Without split_head: the best of every split (enumerated) of the blocks' FLOPs × the ratio, the head's
    FLOPs on the last stage; at 100 the blocks outweigh the head and the stages hold 2 blocks each, where the FLOP
    split leaves the head's stage one block (tests/test_plan.py: blocks 0-2, then 3 + head)."""
    model, recipe = tied_llama(split_by="time", block_time_ratio=ratio)
    costs, head = block_costs(model, layer_stack(model), recipe, tp=1, loss_parallel=False)
    weighted = [cost * ratio for cost in costs]
    parts, _ = stage_of_blocks(model, recipe, grid_of(recipe, 2))
    starts = [index for index in range(1, len(parts)) if parts[index] != parts[index - 1]]
    assert key_of(weighted, starts, last_extra=head) == brute_force(weighted, last_extra=head, num_parts=2)
    if ratio == 100.0:
        assert parts == [0, 0, 1, 1]
        assert stage_of_blocks(model, tied_llama()[1], grid_of(recipe, 2))[0] == [0, 0, 0, 1]


def _small_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=4000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=True)
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def test_the_measured_ratio_follows_a_blocks_time(monkeypatch):
    """The same model measured twice, the second time with each block's forward 200 ms longer (a sleep, no FLOP):
    the blocks' seconds per FLOP grow by far more than the head's, so the ratio must grow with them. A ratio that
    did not time the block (a constant, FLOPs alone) stays where it was. The sleep is long against the block's own
    few milliseconds: under the suite's load a 20 ms sleep read only 2.3x (5.04 then 11.46), against a 3x bound.
    The plain ratio is the least of three probes: a burst of the suite's load on the block's few-millisecond
    timings once read it at 95.77 (~5 unloaded), which the slowed probe need not triple. A ratio that did not time
    the block reads the same in all four probes, so the least of three cannot let it pass. The probes run on one
    thread: on two, beside other busy processes on the same two cores, torch's threads wait on each other at every
    op (the suite once read a plain 10.23 and a slowed 15.63; with two busy processes beside it a 4 ms probe took
    up to 352 ms on two threads, at most 9 ms on one)."""
    from transformers.models.llama import modeling_llama

    from toolkit.strategies.pipeline.timing import measured_ratio

    recipe = load_recipe(Path(__file__).parents[1] / "recipes" / "llama-tiny.yaml", ["data.max_length=32"])
    kept = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        plain = min(measured_ratio(_small_llama(), recipe, env=ONE, micro_batch=2, length=32, rows=2000)
                    for _ in range(3))
        assert 0 < plain < 100
        forward = modeling_llama.LlamaDecoderLayer.forward

        def slower(*args, **kwargs):
            time.sleep(0.2)
            return forward(*args, **kwargs)

        monkeypatch.setattr(modeling_llama.LlamaDecoderLayer, "forward", slower)
        assert measured_ratio(_small_llama(), recipe, env=ONE, micro_batch=2, length=32, rows=2000) > 3 * plain
    finally:
        torch.set_num_threads(kept)


def test_the_plan_says_a_measured_split_may_move():
    from toolkit.strategies.pipeline.rules import stage_lines

    model, recipe = tied_llama(split_head="true", split_by="time")
    assert stage_lines(model, recipe, world_size=2)[0].startswith(
        "stages (split by FLOPs here; split_by time measures a block's time per FLOP at setup and may move it")
    model, recipe = tied_llama(split_head="true", split_by="time", block_time_ratio=1.25)
    assert stage_lines(model, recipe, world_size=2)[0].startswith(
        "stages (split by time: a block's FLOPs weighted 1.25x the head's, the head's rows too;")


def test_a_run_split_by_time_records_the_ratio_it_measured_and_splits_by_it(llama4_runs):
    """The 2-rank run of the tied Llama under split_by time (tests/test_model_parallel.py checks it equals single,
    tests/test_plan.py that the plan of its recipe.yaml predicts its memory exactly): the ratio both ranks
    measured is in its recipe.yaml, and its stages hold the rows that ratio gives."""
    from toolkit.model.build import meta_model

    ranks, overrides = ARMS["pp-1f1b-head-time"]
    out = llama4_runs.get("pp-1f1b-head-time", nproc=ranks, overrides=overrides)
    recipe = load_recipe(out / "recipe.yaml")
    ratio = recipe.strategy.block_time_ratio
    assert ratio is not None and ratio > 0
    layout = json.loads((out / "run.json").read_text())["layout"]
    rows = head_rows_of(meta_model(recipe.model), recipe, grid_of(recipe, ranks))
    assert f"rank 0: stage 0: blocks 0-3 + head rows 0-{rows[0][1] - 1}; " in layout
    assert f"split by time: a block's FLOPs weighted {ratio:g}x the head's; " in layout


def test_split_by_time_is_refused_unpinned_for_a_model_without_a_causal_lms_head():
    import dataclasses

    from toolkit.errors import RecipeError
    from toolkit.strategies.pipeline.layout import check_split_by

    _, recipe = tied_llama(split_by="time")
    classifier = dataclasses.replace(recipe, model=dataclasses.replace(recipe.model, task="sequence-classification"),
                                     data=dataclasses.replace(recipe.data, label_column="label"))
    with pytest.raises(RecipeError, match="strategy.split_by=time times a block against rows of a causal LM's "
                                          "output layer, and model.task is sequence-classification"):
        check_split_by(classifier, grid_of(classifier, 2))
    pinned = dataclasses.replace(classifier, strategy=dataclasses.replace(classifier.strategy, block_time_ratio=1.5))
    check_split_by(pinned, grid_of(pinned, 2))  # a pinned ratio weighs its blocks without a probe


def test_a_resumed_run_takes_the_ratio_its_checkpoints_run_split_by(tmp_path, monkeypatch):
    """A run resuming from a checkpoint whose recipe.yaml holds a block_time_ratio splits by it, measuring
    nothing (a second measurement could cut other stages than the checkpoint's run had); a checkpoint without one
    (written under split_by flops) leaves the measurement to run."""
    import yaml

    from toolkit.config.files import dump_recipe
    from toolkit.strategies.pipeline import timing

    _, recipe = tied_llama(split_head="true", split_by="time")
    checkpoint = tmp_path / "step-00000004"
    checkpoint.mkdir()
    saved = yaml.safe_load(dump_recipe(recipe))
    saved["strategy"]["block_time_ratio"] = 1.7
    (checkpoint / "recipe.yaml").write_text(yaml.safe_dump(saved))
    measured = []
    monkeypatch.setattr(timing, "measured_ratio", lambda *args, **kwargs: measured.append(1) or 2.5)
    resumed = timing.pin_block_time(recipe, env=TWO, resumed=checkpoint)
    assert resumed.strategy.block_time_ratio == 1.7 and not measured
    saved["strategy"]["block_time_ratio"] = None
    (checkpoint / "recipe.yaml").write_text(yaml.safe_dump(saved))
    fresh = timing.pin_block_time(recipe, env=TWO, resumed=checkpoint)
    assert fresh.strategy.block_time_ratio == 2.5 and measured == [1]
