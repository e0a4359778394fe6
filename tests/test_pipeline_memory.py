"""toolkit plan's pipeline activations: the micro-batches each rank keeps in flight, against the order torch's
own schedules give, and a stage's trace against the whole model's."""

import pytest
import torch
from torch.distributed.pipelining import schedules

from toolkit.config.files import load_recipe
from toolkit.memory.activations import Traced, traced_activations, traced_stage
from toolkit.plan.predict import planned_model, predict
from toolkit.strategies.pipeline.memory import in_flight_peak, schedule_actions


def most_in_flight(actions):
    count = most = 0
    for kind, _ in actions:
        count += 1 if kind == "F" else -1
        most = max(most, count)
    return most


def torch_order(schedule_class, *, stages: int, micro_batches: int) -> dict[int, list]:
    """torch's schedule table (its _get_pipeline_order IR), without the stages its constructor needs."""
    plan = object.__new__(schedule_class)
    plan._num_stages, plan._n_microbatches = stages, micro_batches
    return {rank: [("F" if a.computation_type.name == "FORWARD" else "B", a.stage_index)
                   for a in actions if a is not None and a.computation_type.name in ("FORWARD", "FULL_BACKWARD")]
            for rank, actions in plan._get_pipeline_order().items()}


@pytest.mark.parametrize("name, schedule_class", [("gpipe", schedules.ScheduleGPipe),
                                                  ("1f1b", schedules.Schedule1F1B)])
@pytest.mark.parametrize("stages, micro_batches", [(2, 2), (2, 5), (3, 4), (4, 8)])
def test_micro_batches_in_flight_are_those_of_torchs_schedule(name, schedule_class, stages, micro_batches):
    order = torch_order(schedule_class, stages=stages, micro_batches=micro_batches)
    for rank in range(stages):
        ours = schedule_actions(name, rank=rank, pp=stages, stages_per_rank=1, micro_batches=micro_batches)
        assert sorted(ours) == sorted(order[rank])  # every micro-batch forward and backward, once each
        assert most_in_flight(ours) == most_in_flight(order[rank])
    # the reason to choose 1F1B: the first stage holds min(m, stages) micro-batches, not all m
    expected = micro_batches if name == "gpipe" else min(micro_batches, stages)
    assert most_in_flight(schedule_actions(name, rank=0, pp=stages, stages_per_rank=1,
                                           micro_batches=micro_batches)) == expected


def test_interleaved_runs_every_virtual_stage_forward_before_backward():
    for rank in range(2):
        actions = schedule_actions("interleaved-1f1b", rank=rank, pp=2, stages_per_rank=2, micro_batches=4)
        for stage in (rank, rank + 2):
            mine = [kind for kind, s in actions if s == stage]
            assert mine.count("F") == mine.count("B") == 4
            assert all(mine[:i + 1].count("F") >= mine[:i + 1].count("B") for i in range(len(mine)))
        assert 2 <= most_in_flight(actions) < 8  # some overlap, fewer than every chunk at once


def test_the_peak_counts_every_micro_batch_in_flight_beside_the_one_going_backward():
    traces = {0: Traced(peak=100, held=30), 2: Traced(peak=50, held=10)}
    gpipe = schedule_actions("gpipe", rank=0, pp=2, stages_per_rank=1, micro_batches=4)
    assert in_flight_peak(gpipe, traces) == 3 * 30 + 100
    one_f_one_b = schedule_actions("1f1b", rank=0, pp=2, stages_per_rank=1, micro_batches=4)
    assert in_flight_peak(one_f_one_b, traces) == 1 * 30 + 100
    # two virtual stages: stage 2's backward peaks beside stage 0's micro-batch in flight
    traces[0] = Traced(peak=40, held=30)
    assert in_flight_peak([("F", 0), ("F", 2), ("B", 2), ("B", 0)], traces) == 30 + 50


def tiny_recipe(*overrides):
    model = ('model.config={"model_type": "llama", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128, '
             '"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, '
             '"max_position_embeddings": 256, "tie_word_embeddings": true}')
    return load_recipe("recipes/llama-tiny.yaml", [model, "data.max_length=64", "data.packing=true",
                                                  "batch.micro_batch_size=2", "batch.global_batch_size=null",
                                                  "batch.grad_accum_steps=1", *overrides])


def test_a_stage_of_every_block_holds_the_whole_models_activations_and_its_logits(tmp_path, monkeypatch):
    """One stage that is first and last is the whole model, except that the pipeline keeps the stage's output
    (the logits, fp32 here) until its backward, where the loop lets them go after the loss."""
    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path))
    recipe = tiny_recipe()
    model = planned_model(recipe)
    how = {"params_dtype": torch.float32, "autocast_dtype": None, "checkpointing": False}
    whole = traced_activations(model, recipe, **how)
    stage = traced_stage(model, recipe, blocks=4, first=True, last=True, **how)
    logits = 2 * 64 * 1000 * 4
    assert stage.peak == whole + logits
    assert logits < stage.held < stage.peak
    # a middle stage: its blocks' activations, not the head's; its input and output gradient are buffers
    middle = traced_stage(model, recipe, blocks=2, first=False, last=False, **how)
    assert 0 < middle.held < middle.peak < stage.peak


def test_gpipe_plans_more_activation_memory_than_1f1b_and_only_where_it_runs_more_in_flight(tmp_path, monkeypatch):
    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path))

    def activations(schedule):
        recipe = tiny_recipe("strategy.name=pipeline", f"strategy.schedule={schedule}", "batch.grad_accum_steps=4")
        return predict(recipe, world_size=2, runtime_bytes=0, device_type="cuda").activation_bytes

    gpipe, one_f_one_b = activations("gpipe"), activations("1f1b")
    # 2 stages, 4 micro-batches: gpipe keeps 4 in flight on both; 1f1b 2 on the first, 1 on the last
    assert gpipe[0] > one_f_one_b[0] and gpipe[1] > one_f_one_b[1]
    whole = predict(tiny_recipe("batch.grad_accum_steps=4"), world_size=1, runtime_bytes=0,
                    device_type="cuda").activation_bytes[0]
    assert one_f_one_b[1] < whole < gpipe[1]


# bf16 weights in fp32 precision: MixedPrecisionPolicy casts nothing, the gathered parameters and the gradients are
# the weights' bf16 (the plan said fp32 for both)
@pytest.mark.parametrize("precision, load_dtype, per_param", [("fp32", "fp32", 4 + 4), ("bf16", "fp32", 2 + 4),
                                                              ("fp32", "bf16", 2 + 2)])
def test_a_pipelines_fsdp_replicas_each_plan_their_own_stages_gathered(tmp_path, monkeypatch, precision, load_dtype,
                                                                       per_param):
    """Under pipeline x fsdp, torch's schedule keeps each unit gathered with its whole gradient from its first
    backward to the step's reduction: a rank holds its own stages whole (compute dtype) beside their gradients
    (fp32 under bf16, as FSDP2 reduces). Counted here from the plain model, stage by stage as strategy.split cuts
    it: the first stage's ranks hold the embedding and block 0, the last stage's ranks blocks 1-3, the norm and
    the untied head; each rank its own, not the larger stage's."""
    from toolkit.config.parallel import resolve
    from toolkit.strategies import strategy_rules

    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path))
    recipe = resolve(tiny_recipe("strategy.name=hybrid", "strategy.pipeline_degree=2", "strategy.data_parallel=fsdp",
                                 "strategy.split=[1]", f"precision={precision}", "batch.grad_accum_steps=2",
                                 f"model.load_dtype={load_dtype}",
                                 'model.config.tie_word_embeddings=false'), world_size=4)
    model = planned_model(recipe)
    inner = model.model

    def numel(*modules):
        return sum(p.numel() for m in modules for p in m.parameters())

    first = numel(inner.embed_tokens, inner.layers[0])
    last = numel(*inner.layers[1:], inner.norm, model.lm_head)
    assert first != last
    gathered = strategy_rules(recipe).predict_gathered_bytes(model, recipe, world_size=4)
    assert gathered == [first * per_param] * 2 + [last * per_param] * 2


def test_tensor_parallel_stages_sharded_over_replicas_plan_their_tp_slices_gathered(tmp_path, monkeypatch):
    """pp × dp_shard × tp: a rank gathers its tp slices of the stage, not the stage whole. The split layers (the
    attention and MLP projections) are halved over 2 tp ranks; embeddings, norms and head stay whole. Before, every
    rank was planned the whole stage: the 405B row of benchmarks/scale_prediction.py 285 GiB gathered for 36."""
    from toolkit.config.parallel import resolve
    from toolkit.strategies import strategy_rules

    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path))
    recipe = resolve(tiny_recipe("parallel.pp=2", "parallel.dp_shard=2", "parallel.tp=2", "strategy.split=[1]",
                                 "batch.grad_accum_steps=2", "model.config.tie_word_embeddings=false"), world_size=8)
    model = planned_model(recipe)
    inner = model.model

    def numel(*modules):
        return sum(p.numel() for m in modules for p in m.parameters())

    def halved(*blocks):  # every projection of attention and MLP split in two, the norms whole
        split = sum(numel(m) for b in blocks for m in (b.self_attn, b.mlp))
        return numel(*blocks) - split // 2

    first = numel(inner.embed_tokens) + halved(inner.layers[0])
    last = halved(*inner.layers[1:]) + numel(inner.norm, model.lm_head)
    gathered = strategy_rules(recipe).predict_gathered_bytes(model, recipe, world_size=8)
    assert gathered == [first * 8] * 4 + [last * 8] * 4  # fp32: gathered parameter and whole gradient, 4 + 4


def test_packed_data_plans_the_receive_buffers_of_its_one_length(tmp_path, monkeypatch):
    """A stage keeps receive buffers per padded length it has built (batches.KEPT_SHAPES of them). Packed data has
    one length, max_length (every block full): the plan adds no buffers of a second. Planned as if a second, 8
    tokens shorter, could be built, a middle stage of 4 micro-batches adds its input's and its output gradient's,
    micro 2 × 56 tokens × hidden 64 in fp32 each, an end stage one of the two."""
    from toolkit.strategies.pipeline import memory
    from toolkit.strategies.pipeline.batches import PAD_MULTIPLE, longest_kept

    assert longest_kept(64, packing=True) == [64]
    assert longest_kept(64, packing=False) == [64, 64 - PAD_MULTIPLE]
    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path))
    recipe = tiny_recipe("strategy.name=pipeline", "batch.grad_accum_steps=4")
    assert recipe.data.packing

    def activations():
        return predict(recipe, world_size=4, runtime_bytes=0, device_type="cuda").activation_bytes

    packed = activations()
    monkeypatch.setattr(memory, "longest_kept", lambda length, packing: [length, length - 8])
    two_lengths = activations()
    assert [t - p for t, p in zip(two_lengths, packed)] == [4 * 2 * 56 * 64 * 4 * sides for sides in (1, 2, 2, 1)]
