"""A tensor-parallel rank's activation trace (toolkit/memory/activations.py over tp_rank.local_model: a plain copy
with its share of heads, MLP columns, tokens under sequence parallelism and vocabulary under loss_parallel) against
the plan itself: the model parallelized by tp_plan.parallelize on DTensors over a fake process group (torch's
"fake" backend: collectives that move nothing), traced on fake tensors with torch's own redistributions, sequence
parallel styles and loss_parallel handlers. The two must keep the same bytes alive, byte for byte, at the peak and
between forward and backward."""

import json

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.testing._internal.distributed.fake_pg import FakeStore

from toolkit.config.files import load_recipe
from toolkit.data.losses import vocab_parallel
from toolkit.memory import activations
from toolkit.memory import tp_rank
from toolkit.memory.activations import traced_activations
from toolkit.model import tp_plan
from toolkit.plan.predict import planned_model, predict

CONFIG = {"model_type": "llama", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 8,
          "max_position_embeddings": 256, "tie_word_embeddings": False}


def recipe_of(*, tied=False, length=128, micro=2, sequence=True, vocabulary=False, vocab=1000, layers=2,
              family="llama", overrides=()):
    config = {**CONFIG, "tie_word_embeddings": tied, "vocab_size": vocab, "num_hidden_layers": layers,
              "model_type": family}
    return load_recipe("recipes/llama-tiny.yaml", [
        f"model.config={json.dumps(config)}", f"data.max_length={length}", "data.packing=true",
        f"batch.micro_batch_size={micro}", "batch.global_batch_size=null", "batch.grad_accum_steps=1",
        "strategy.name=tp", f"strategy.sequence_parallel={str(sequence).lower()}",
        f"strategy.loss_parallel={str(vocabulary).lower()}", *overrides])


class _Propagating:
    """Counts the calls inside DTensor's sharding propagation: it runs each op once more on tensors of the global
    shape to learn the output's (fake ones here, meta ones on a device), which hold no memory of a rank's."""

    depth = 0

    def __enter__(self):
        kept = ShardingPropagator._propagate_tensor_meta_non_cached

        def propagate(propagator, schema):
            _Propagating.depth += 1
            try:
                return kept(propagator, schema)
            finally:
                _Propagating.depth -= 1

        self.kept = kept
        ShardingPropagator._propagate_tensor_meta_non_cached = propagate  # type: ignore[method-assign]

    def __exit__(self, *exc):
        ShardingPropagator._propagate_tensor_meta_non_cached = self.kept  # type: ignore[method-assign]


def _local(tensor):
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


class RankBytes(activations.LiveBytes):
    """LiveBytes of one rank's local tensors: ops on DTensors are left to DTensor (NotImplemented, as torch's
    CommDebugMode does), which then runs the rank's local ops with this mode on; a DTensor parameter's and
    gradient's storage is its local tensor's; a collective's wait is its input (on fake tensors it is a copy)."""

    def __init__(self, existing):
        super().__init__([_local(t) for t in existing])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        if _Propagating.depth:
            return func(*args, **(kwargs or {}))
        if func is torch.ops._c10d_functional.wait_tensor.default:  # a real one returns its input; a fake one a copy
            return args[0]
        return super().__torch_dispatch__(func, types, args, kwargs)

    def release(self, tensor):
        super().release(_local(tensor))


def traced_on_dtensors(recipe, degree, how):
    """The recipe's model (two blocks) parallelized on a fake process group of `degree` ranks and traced as rank 0."""
    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=degree)
    try:
        model = planned_model(recipe)
        tp_plan.parallelize(model, init_device_mesh("cpu", (degree,)),
                            sequence_parallel=recipe.strategy.sequence_parallel,
                            loss_parallel=recipe.strategy.loss_parallel)
        kept = activations.LiveBytes
        activations.LiveBytes = RankBytes  # type: ignore[misc]
        try:
            with _Propagating(), vocab_parallel(recipe.strategy.loss_parallel):
                return activations._traced(model, recipe, **how)
        finally:
            activations.LiveBytes = kept  # type: ignore[misc]
    finally:
        dist.destroy_process_group()


FP32 = {"params_dtype": torch.float32, "autocast_dtype": None}
BF16 = {"params_dtype": torch.float32, "autocast_dtype": torch.bfloat16}
CASES = {  # (degree, recipe_of's arguments, dtypes, activation checkpointing)
    "tp2": (2, dict(sequence=False), FP32, False),
    "tp2-ac": (2, dict(sequence=False), FP32, True),
    "sp2": (2, {}, FP32, False),
    "sp2-ac": (2, {}, FP32, True),
    "sp4-selective-bf16": (4, {}, BF16, "selective"),
    "sp4-micro1": (4, dict(micro=1), FP32, False),  # the first block's cut of one sample: its own tensor
    "sp4-uneven": (4, dict(length=126), FP32, False),  # 126 tokens over 4 ranks: 32 on rank 0
    # a vocabulary of 32: the peak inside the blocks (the collectives' own tensors), not at the loss
    "sp2-blocks": (2, dict(vocab=32), FP32, False),
    "sp2-blocks-ac": (2, dict(vocab=32), FP32, True),
    "sp4-blocks-micro1-ac": (4, dict(vocab=32, micro=1), FP32, True),
    "sp4-blocks-uneven": (4, dict(vocab=32, length=126), FP32, False),
    "sp4-blocks-uneven-ac-bf16": (4, dict(vocab=32, length=126), BF16, True),
    "tp2-blocks": (2, dict(vocab=32, sequence=False), FP32, False),
    "lossp2-untied": (2, dict(sequence=False, vocabulary=True), FP32, False),
    "lossp2-tied-ac-bf16": (2, dict(sequence=False, vocabulary=True, tied=True), BF16, True),
    "sp2-lossp-tied": (2, dict(vocabulary=True, tied=True), FP32, False),
    "sp4-lossp-micro1-ac-bf16": (4, dict(vocabulary=True, tied=True, micro=1), BF16, True),
    # OLMo's LayerNorms hold no weights, its final norm's included: a whole model is not a stage before the last
    "olmo-sp2-lossp": (2, dict(family="olmo", vocabulary=True), FP32, False),
}


@pytest.mark.parametrize("case", CASES)
def test_a_tp_rank_is_traced_as_the_plan_on_dtensors_keeps_it(tmp_path, monkeypatch, case):
    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path))
    degree, shape, dtypes, checkpointing = CASES[case]
    recipe = recipe_of(**shape)
    how = {**dtypes, "checkpointing": checkpointing}
    reference = traced_on_dtensors(recipe, degree, how)
    # the plan's trace: the same model cut to one block and to two, extrapolated to its two blocks
    assert traced_activations(planned_model(recipe), recipe, **how, tp_degree=degree) == reference.peak
    local = tp_rank.local_model(planned_model(recipe), degree, loss_parallel=recipe.strategy.loss_parallel,
                                sequence_parallel=recipe.strategy.sequence_parallel)
    # the bytes: the ops are not compared (a DTensor's op dispatches its local ops and its redistributions too)
    assert _bytes(activations._traced(local, recipe, **how)) == _bytes(reference)


def test_sequence_parallelism_keeps_a_block_input_of_1_over_n_under_full_checkpointing(tmp_path, monkeypatch):
    """Under full activation checkpointing a block keeps only its input until backward: the whole sequence
    ([micro, tokens, hidden] in the weights' dtype) without sequence parallelism, 1/N of it with. Each block
    beyond the first adds that much less, a plain product of the shapes."""
    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path))
    how = {**FP32, "checkpointing": True}

    def traced(layers, sequence):
        recipe = recipe_of(layers=layers, sequence=sequence)
        return traced_activations(planned_model(recipe), recipe, **how, tp_degree=4)

    block_input = 2 * 128 * 64 * 4
    plain_per_block = traced(6, False) - traced(5, False)
    sharded_per_block = traced(6, True) - traced(5, True)
    assert plain_per_block - sharded_per_block == block_input - block_input // 4
    # and the plan charges it to every rank
    recipe = recipe_of(layers=6, overrides=("train.activation_checkpointing=true",))
    plan = predict(recipe, world_size=4, runtime_bytes=0, device_type="cuda")
    assert plan.activation_bytes == [traced(6, True)] * 4


def stage_on_dtensors(recipe, degree, how, *, first, last):
    """A pipeline stage of the recipe's model (its two blocks) as a run builds it: cut first (model/stages.py), then
    parallelized over a fake process group of `degree` ranks, traced as rank 0."""
    from toolkit.model import stages

    made = stages.Stage

    def parallel_stage(model, **kwargs):
        if model.config.tie_word_embeddings:  # as a run cuts its stages: the trace's to_empty untied them
            model.tie_weights()
        stage = made(model, **kwargs)
        tp_plan.parallelize(stage, mesh, sequence_parallel=recipe.strategy.sequence_parallel,
                            loss_parallel=recipe.strategy.loss_parallel)
        if recipe.strategy.loss_parallel:  # as the pipeline strategy sets its stages up
            tp_plan.keep_gradients_split(stage)
        return stage

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=degree)
    kept = activations.LiveBytes
    try:
        mesh = init_device_mesh("cpu", (degree,))  # outside the trace's fake tensor mode
        stages.Stage = parallel_stage  # type: ignore[misc]
        activations.LiveBytes = RankBytes  # type: ignore[misc]
        with _Propagating(), vocab_parallel(recipe.strategy.loss_parallel):
            return activations._traced(planned_model(recipe), recipe, **how, stage=(first, last, None, True))
    finally:
        stages.Stage = made  # type: ignore[misc]
        activations.LiveBytes = kept  # type: ignore[misc]
        dist.destroy_process_group()


STAGE_CASES = {  # (degree, recipe_of's arguments, dtypes, activation checkpointing, (first, last))
    "sp2-middle": (2, {}, FP32, False, (False, False)),
    "sp2-first": (2, {}, FP32, False, (True, False)),
    "sp2-last": (2, {}, FP32, False, (False, True)),
    "sp4-middle-uneven": (4, dict(length=126), FP32, False, (False, False)),
    "sp2-middle-ac-bf16": (2, {}, BF16, True, (False, False)),
    "sp4-first-micro1-selective-bf16": (4, dict(micro=1), BF16, "selective", (True, False)),
    "tp2-middle": (2, dict(sequence=False), FP32, False, (False, False)),
    # loss_parallel: the last stage's head and loss over 1/N of the vocabulary, the first stage's tied embedding
    # split with it (its gradient computed whole, then cut: tp_plan.keep_gradients_split)
    "lossp2-last": (2, dict(sequence=False, vocabulary=True), FP32, False, (False, True)),
    "lossp2-first-tied": (2, dict(sequence=False, vocabulary=True, tied=True), FP32, False, (True, False)),
    "sp2-lossp-last-tied-ac-bf16": (2, dict(vocabulary=True, tied=True), BF16, True, (False, True)),
    "sp4-lossp-first-tied-micro1": (4, dict(vocabulary=True, tied=True, micro=1), FP32, False, (True, False)),
    "lossp2-first-tied-vocab16k": (2, dict(sequence=False, vocabulary=True, tied=True, vocab=16000, micro=1), FP32,
                                   False, (True, False)),
    # OLMo: LayerNorms without weights (the final norm too): the stage's own place, not a norm's weights, tells a
    # stage before the last (it sends its output share) from the last (its final norm on the share, the head's
    # input gathered)
    "olmo-sp2-first": (2, dict(family="olmo"), FP32, False, (True, False)),
    "olmo-sp2-lossp-last": (2, dict(family="olmo", vocabulary=True), FP32, False, (False, True)),
}


@pytest.mark.parametrize("case", STAGE_CASES)
def test_a_tensor_parallel_pipeline_stage_is_traced_as_the_plan_on_dtensors_keeps_it(tmp_path, monkeypatch, case):
    """pp × tp (× sequence parallelism): a stage's tp rank. Under sequence parallelism a stage before the last
    sends its last block's output share as it is, and a stage after the first receives that share (no gather or
    cut between stages)."""
    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path))
    degree, shape, dtypes, checkpointing, (first, last) = STAGE_CASES[case]
    recipe = recipe_of(**shape)
    how = {**dtypes, "checkpointing": checkpointing}
    reference = stage_on_dtensors(recipe, degree, how, first=first, last=last)
    traced = activations.traced_stage(planned_model(recipe), recipe, blocks=2, first=first, last=last,
                                      tp_degree=degree, sequence_parallel=recipe.strategy.sequence_parallel,
                                      loss_parallel=recipe.strategy.loss_parallel, **how)
    assert _bytes(traced) == _bytes(reference)


def _bytes(traced: activations.Traced) -> tuple[int, int]:
    """A trace's bytes (its peak, what it holds between forward and backward), not its op count."""
    return traced.peak, traced.held


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_tied_first_stage_sharded_by_fsdp_accumulates_its_embedding_gradient_cut(precision):
    """pp × dp_shard × tp under loss_parallel: FSDP2 swaps its unsharded parameter onto the embedding for the
    forward, and with gradient sync off (a step's micro-batches before the last) the gradient accumulates there
    (in reduce_dtype under bf16: FSDP's accumulated copy) until the reduce-scatter. It must be held cut to the tp
    rank's rows as the plan holds it, not whole ([V, hidden] on every tp rank): a hook on the sharded parameter
    alone never fires. Two micro-batches, as a step of two runs them; fake process group of 2 replicas × 2 tp."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from toolkit.model.stages import Stage
    from toolkit.process.dist import DistEnv
    from toolkit.strategies.dims.parallelize import FsdpWrap, parallelize

    config = LlamaConfig(**{**CONFIG, "tie_word_embeddings": True})
    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
        stage = Stage(LlamaForCausalLM(config), layer_ids=[0], first=True, last=False)
        parallelize(stage, mesh=mesh, env=DistEnv(rank=0, local_rank=0, world_size=4, device=torch.device("cpu")),
                    units=list(stage.blocks()), data_parallel=FsdpWrap(precision=precision), loss_parallel=True)
        tp_plan.keep_gradients_split(stage)
        stage.set_requires_gradient_sync(False)
        ids, mask = torch.randint(0, CONFIG["vocab_size"], (2, 16)), torch.ones(2, 16, dtype=torch.long)
        for _ in range(2):
            stage(ids, attention_mask=mask).sum().backward()
        embedding = next(p for p in stage._get_fsdp_state()._fsdp_param_group.fsdp_params
                         if p._module_info.module is stage.whole.get_input_embeddings())
        held = embedding.unsharded_accumulated_grad if precision == "bf16" else embedding._unsharded_param.grad
        assert isinstance(held, DTensor) and held.placements == embedding._unsharded_param.placements
        assert held.to_local().shape == (CONFIG["vocab_size"] // 2, CONFIG["hidden_size"])
    finally:
        dist.destroy_process_group()
