"""strategy.loss_parallel (model/tp_plan.py vocab_plan): the embedding and the output layer split over the
vocabulary on the tensor-parallel ranks, the loss reduced across them inside cross_entropy (torch's loss_parallel).
The same fp32 training as one process under tp and under fsdp × tp with sequence parallelism (4 ranks), its
collectives as the plan counts them, each rank storing its share of the tied embedding, a rank's activations traced
with its share of the vocabulary; refused in one line where it does not apply."""

import json

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves

import test_tensor_parallel
from conftest import assert_matches_single, exported_weights
from test_comm_prediction import assert_predicted
from test_tp_memory import CONFIG, HOW, recipe_of
from toolkit.cli import main
from toolkit.config.files import load_recipe
from toolkit.config.parallel import resolve
from toolkit.memory import activations
from toolkit.memory.activations import traced_activations
from toolkit.plan.predict import planned_model, predict
from toolkit.strategies import strategy_rules

LOSS_PARALLEL = ("strategy.loss_parallel=true",)
ARMS = {  # the llama4 runs' tied Llama, its vocabulary (the MiniLM tokenizer's 30,522 tokens) split in two
    "tp-lossp": (2, (*test_tensor_parallel.ARMS["tp"][1], *LOSS_PARALLEL)),
    # HSDP × tp with both: 2 replica groups of 2 tp ranks, the replica checks (tp groups, replica groups) every step
    "hsdp-tp2-sp-lossp": (4, (*test_tensor_parallel.ARMS["hsdp-tp2"][1], "strategy.sequence_parallel=true",
                              *LOSS_PARALLEL, "train.consistency_check_every=1")),
    "fsdp-tp2-sp-lossp": (4, (*test_tensor_parallel.ARMS["fsdp-tp2"][1], "strategy.sequence_parallel=true",
                              *LOSS_PARALLEL)),
}


# an untied Llama (conftest's llama_runs): its input embedding stays whole on every rank, the head alone is split
UNTIED = (2, ("strategy.name=tp", *LOSS_PARALLEL))


def all_reduce_calls(run_dir) -> tuple[int, int]:
    """(the plan's all-reduce calls on rank 0, the counter's) for the run's counted step."""
    info = json.loads((run_dir / "run.json").read_text())
    world, comm = info["world_size"], info["comm_per_step"]
    recipe = resolve(load_recipe(run_dir / "recipe.yaml"), world_size=world)
    shapes = [tuple(s) for s in comm["micro_batch_shapes_per_rank"][0]]
    planned = strategy_rules(recipe).predict_collectives(planned_model(recipe), recipe, world_size=world, rank=0,
                                                         shapes=shapes)
    return sum(c.calls for c in planned if c.op == "all_reduce"), comm["calls_by_op"]["all_reduce"]


@pytest.mark.parametrize("arm", [*ARMS, "tp-lossp-untied"])
def test_loss_parallel_matches_single_and_its_collectives_equal_the_counter(llama4_runs, llama_runs, arm):
    if arm == "tp-lossp-untied":
        run, single = llama_runs.get(arm, nproc=UNTIED[0], overrides=UNTIED[1]), llama_runs.get("single-m8")
    else:
        run, single = llama4_runs.get(arm, nproc=ARMS[arm][0], overrides=ARMS[arm][1]), llama4_runs.get("single")
    assert_matches_single(run, single)
    # the loss's three [tokens] all-reduces run inside cross_entropy's DTensor op: the counter sees them there
    assert_predicted(run)
    # and the calls: the gradient norm's groups (fsdp × tp + sequence parallelism: FSDP's 1-D shards and the norms'
    # 2-D ones apart) move few bytes in calls of their own
    planned, counted = all_reduce_calls(run)
    assert planned == counted


def test_loss_parallel_adds_five_all_reduces_per_micro_batch(llama4_runs):
    ranks, overrides = ARMS["tp-lossp"]
    split = json.loads((llama4_runs.get("tp-lossp", nproc=ranks, overrides=overrides) / "run.json").read_text())
    ranks, overrides = test_tensor_parallel.ARMS["tp"]
    plain = json.loads((llama4_runs.get("tp", nproc=ranks, overrides=overrides) / "run.json").read_text())
    assert_loss_parallel_adds_five_fp32_all_reduces(split["comm_per_step"], plain["comm_per_step"])


def assert_loss_parallel_adds_five_fp32_all_reduces(comm: dict, before: dict) -> None:
    """`comm` (tp-lossp's comm_per_step) over `before` (plain tp's, the same batches)."""
    assert comm["micro_batch_shapes_per_rank"] == before["micro_batch_shapes_per_rank"]
    tokens = sum(rows * length for rows, length in comm["micro_batch_shapes_per_rank"][0])
    # per micro-batch (4 a step): the embedding's partial outputs and the head's input gradient (hidden 32 fp32 per
    # token each), the loss's max, sum of exponentials and target logit (one fp32 per token each) ...
    assert comm["calls_by_op"]["all_reduce"] - before["calls_by_op"]["all_reduce"] == 5 * 4
    # ... and the gradient norm's vector of the split weights' partial norms holds one more: the tied embedding's
    assert comm["bytes_by_op"]["all_reduce"] - before["bytes_by_op"]["all_reduce"] == \
        2 * tokens * 32 * 4 + 3 * tokens * 4 + 4


def test_under_autocast_the_loss_parallel_collectives_move_in_fp32_and_equal_the_counter(llama4_runs):
    """tp keeps fp32 weights and computes under bf16 autocast: the row-wise embedding's partial outputs (a lookup in
    the fp32 weight), the head's input gradient (the final norm's fp32 output is the DTensor autocast casts inside
    the layer) and the loss's max, sum of exponentials and target logit (log-softmax runs in fp32 under autocast)
    all-reduce in fp32, as without autocast: the same bytes over plain tp's under autocast as in fp32. The plan's
    collectives equal the counter's."""
    autocast = ("precision=bf16", "train.max_steps=2")
    ranks, overrides = ARMS["tp-lossp"]
    run_dir = llama4_runs.get("tp-lossp-autocast", nproc=ranks, overrides=(*overrides, *autocast))
    assert_predicted(run_dir)
    comm = json.loads((run_dir / "run.json").read_text())["comm_per_step"]
    ranks, overrides = test_tensor_parallel.ARMS["tp"]
    plain = json.loads((llama4_runs.get("tp-autocast", nproc=ranks, overrides=(*overrides, *autocast))
                        / "run.json").read_text())["comm_per_step"]
    assert_loss_parallel_adds_five_fp32_all_reduces(comm, plain)


class TiedShaped(activations.LiveBytes):
    """LiveBytes of the tensors a rank's local ops make in the shape of a tied weight or of its share of the
    vocabulary's rows (the gradients of the head, of the embedding and their sum); not views (the weight's
    transposes in backward, FSDP's gradient shards in its reduce-scatter buffer)."""

    def __init__(self, vocab: int, hidden: int, degree: int, existing: list[torch.Tensor]):
        super().__init__(existing)
        self.shapes = {(vocab, hidden), (vocab // degree, hidden)}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor runs the rank's local ops under this mode
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):
            # FakeTensors: DTensor's sharding propagation running the op again on the global shapes, no memory;
            # an output on an input's storage is a view of it (below autograd, _is_view() does not tell)
            if isinstance(tensor, torch.Tensor) and not isinstance(tensor, FakeTensor) and \
                    tensor.untyped_storage()._cdata not in inputs and tuple(tensor.shape) in self.shapes:
                self._count(tensor.untyped_storage())
        return out


@pytest.mark.parametrize("dp, tp, vocabulary, accumulates", [
    (1, 2, False, False), (1, 2, True, False), (1, 4, True, False), (2, 2, False, False), (2, 2, True, False),
    (2, 4, True, False), (1, 2, False, True), (1, 4, True, True), (2, 2, False, True), (2, 2, True, True)])
def test_a_tied_weights_gradients_beyond_its_state_are_the_strategy_s_copies_and_one_whole(dp, tp, vocabulary,
                                                                                           accumulates):
    """At the end of backward a tied weight's gradients beyond its state: the head's, the embedding's and their
    sum (autograd adds them out of place), less the sum where it is the state (tp: 2 more; fsdp x tp, whose state
    is FSDP's shard: 3). With the vocabulary split each is the rank's rows, and DTensor first computes the
    row-wise embedding's gradient over every row, then copies its rows out: one whole more (1 + 2/tp, 1 + 3/tp).
    A micro-batch after the first under tp holds the sum as a tensor of its own, added into the gradient: 3
    copies; fsdp x tp's, as the loop runs it (no reduce-scatter before the last micro-batch: FSDP adds each
    micro-batch's gradient into its unsharded one in place), the same 3 as without accumulation. Measured on
    the tied model parallelized as the tp and fsdp strategies do (dims.parallelize: tp_plan, then fully_shard
    over dp_shard) on DTensors over torch's fake process group (real local tensors), against the plan's term
    (StrategyInfo.tied_gradients) and its peak."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from test_tp_trace_reference import recipe_of as traced_recipe
    from toolkit.data.losses import vocab_parallel
    from toolkit.model.blocks import transformer_blocks
    from toolkit.plan.predict import tied_gradient_bytes, tied_gradients_beyond_states, vocabulary_share
    from toolkit.process.dist import DistEnv
    from toolkit.strategies.dims.parallelize import FsdpWrap, parallelize

    vocab, hidden, world = 4096, 64, dp * tp
    fsdp = ("strategy.name=fsdp", f"strategy.tp_degree={tp}") if dp > 1 else ()
    recipe = traced_recipe(tied=True, vocabulary=vocabulary, sequence=False, vocab=vocab, length=8, micro=1,
                           overrides=(*fsdp, f"batch.grad_accum_steps={2 if accumulates else 1}"))
    assert vocabulary_share(recipe, world_size=world) == (tp if vocabulary else 1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        model = planned_model(recipe).to_empty(device="cpu")
        model.tie_weights()  # to_empty gives the head a weight of its own; the strategies' models are tied
        assert model.lm_head.weight is model.model.embed_tokens.weight
        mesh = (init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp_shard", "tp")) if fsdp else
                init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",)))
        parallelize(model, mesh=mesh, env=DistEnv(rank=0, local_rank=0, world_size=world, device=torch.device("cpu")),
                    units=transformer_blocks(model), data_parallel=FsdpWrap(precision="fp32") if fsdp else None,
                    loss_parallel=vocabulary)
        ids = torch.randint(0, vocab, (1, 8), generator=torch.Generator().manual_seed(0))
        with vocab_parallel(vocabulary):
            if accumulates:  # the step's first micro-batch: the gradient exists before the one measured
                if fsdp:  # the fsdp strategy's accumulate(sync=False), then sync on the last micro-batch
                    model.set_requires_gradient_sync(False)
                model(input_ids=ids, labels=ids).loss.backward()
                if fsdp:
                    model.set_requires_gradient_sync(True)
            loss = model(input_ids=ids, labels=ids).loss
            before = [getattr(p.grad, "_local_tensor", p.grad) for p in model.parameters() if p.grad is not None]
            mode = TiedShaped(vocab, hidden, tp, before)
            with mode:
                loss.backward()
        gradient = model.lm_head.weight.grad
        state = getattr(gradient, "_local_tensor", gradient).nbytes
    finally:
        dist.destroy_process_group()
    whole = tied_gradient_bytes(planned_model(recipe), torch.float32)
    assert whole == vocab * hidden * 4 and state == whole // (tp if vocabulary else 1) // dp
    # predict()'s rule: tp's 2 become 3 under accumulation; fsdp's sum is a tensor of its own already
    copies = strategy_rules(recipe).info(recipe).tied_gradients + (accumulates and not fsdp)
    beyond = tied_gradients_beyond_states(whole, copies, vocabulary_share=vocabulary_share(recipe, world_size=world))
    # tp's state is autograd's sum, one of the tensors counted, on a step's first micro-batch
    held = mode.peak - (0 if fsdp or accumulates else state)
    assert copies == (3 if fsdp or accumulates else 2)
    assert held == beyond == whole * (1 + copies / tp if vocabulary else copies)
    if not fsdp:  # and the plan's peak carries it: with 8 tokens the end of backward (every state and these) is
        planned = predict(recipe, world_size=world, runtime_bytes=0, device_type="cuda")  # the peak
        assert planned.peak_bytes == planned.per_rank[0].total_bytes + beyond


def test_each_tp_rank_stores_half_the_tied_embedding(llama4_runs):
    ranks, overrides = ARMS["tp-lossp"]
    run_dir = llama4_runs.get("tp-lossp", nproc=ranks, overrides=overrides)
    run = json.loads((run_dir / "run.json").read_text())
    assert "head and its tied embedding split over the vocabulary (loss_parallel)" in run["layout"]
    weights = exported_weights(run_dir)
    weights.pop("lm_head.weight", None)  # tied: the embedding's
    split = (*test_tensor_parallel.SPLIT, "embed_tokens")
    expected = sum(w.numel() // 2 if w.dim() == 2 and name.split(".")[-2] in split else w.numel()
                   for name, w in weights.items()) * 4
    for detail in run["model_state_bytes"]:
        assert detail["params_bytes"] == expected
        assert detail["grads_bytes"] == expected and detail["optim_bytes"] == 2 * expected


@pytest.mark.parametrize("degree", [2, 4])
def test_a_loss_parallel_rank_traces_less_than_a_tp_rank_and_the_plan_charges_it(tmp_path, monkeypatch, degree):
    """A rank's share of the vocabulary's logits is traced below a plain TP rank's whole ones (the trace itself is
    checked byte for byte against torch's loss_parallel on DTensors in tests/test_tp_trace_reference.py), and the
    plan charges that trace to every rank."""
    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path))
    recipe = recipe_of(CONFIG, *LOSS_PARALLEL)
    rank = traced_activations(planned_model(recipe), recipe, **HOW, tp_degree=degree)
    plain = recipe_of(CONFIG)
    whole = traced_activations(planned_model(plain), plain, **HOW, tp_degree=degree)
    # the logits (256 tokens x 1000 of vocabulary, fp32) and the loss's copies of them dominate this model
    logits = 256 * 1000 * 4
    assert whole - rank > logits * (1 - 1 / degree)
    plan = predict(recipe_of(CONFIG, "strategy.name=tp", *LOSS_PARALLEL), world_size=degree, runtime_bytes=0,
                   device_type="cuda")
    assert plan.activation_bytes == [rank] * degree


def test_loss_parallel_lowers_the_measured_peak(llama4_runs):
    """The logits of 30,522 tokens dominate this tiny model's activations: half of them per rank shows."""
    ranks, overrides = test_tensor_parallel.ARMS["tp"]
    plain = json.loads((llama4_runs.get("tp", nproc=ranks, overrides=overrides) / "run.json").read_text())
    ranks, overrides = ARMS["tp-lossp"]
    split = json.loads((llama4_runs.get("tp-lossp", nproc=ranks, overrides=overrides) / "run.json").read_text())
    for before, after in zip(plain["peak_memory"], split["peak_memory"]):
        assert after["peak_mem_bytes"] < before["peak_mem_bytes"]


@pytest.mark.parametrize("runs, nproc, overrides, says", [
    ("minilm_runs", 2, ("strategy.name=tp", *LOSS_PARALLEL), "a sequence-classification model's head is small"),
    ("llama4_runs", 2, ("strategy.name=tp", "train.tiled_loss=true", *LOSS_PARALLEL), "set one of them to false"),
    ("recipes/llama-tiny.yaml", 2, ("strategy.name=tp", "batch.grad_accum_steps=4",
                                    f"model.config={json.dumps({**CONFIG, 'vocab_size': 30523})}", *LOSS_PARALLEL),
     "the output layer's vocabulary (30523 tokens) is not divisible by the tensor-parallel degree 2"),
    ("llama4_runs", 2, ("strategy.name=fsdp", *LOSS_PARALLEL), "strategy.loss_parallel needs tensor parallelism"),
    ("llama4_runs", 4, ("strategy.name=fsdp", "strategy.tp_degree=2", "strategy.cp_degree=2", *LOSS_PARALLEL),
     "not with strategy.sequence_parallel or strategy.loss_parallel yet"),
])
def test_loss_parallel_where_it_does_not_apply_is_one_line(request, runs, nproc, overrides, says, tmp_path, capsys):
    recipe = request.getfixturevalue(runs).recipe if runs.endswith("_runs") else runs
    capsys.readouterr()  # what building the fixture's model printed
    out = tmp_path / "out"
    sets = [arg for override in (*overrides, f"output_dir={out}") for arg in ("--set", override)]
    code = main(["validate", str(recipe), "--nproc", str(nproc), *sets])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and says in err[0], err
    assert not out.exists()
