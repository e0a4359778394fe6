"""train.tiled_loss (toolkit/data/losses.py tiled_loss_sum, strategies/base.py logits_of): the causal LM loss from
the last hidden states in tiles, each tile's logits made again in backward, against the full logits' loss computed
in plain PyTorch; whole runs against the untiled single process; what it cannot run, refused in one line."""

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_matches_single, metrics, run_cli, write_recipe

from toolkit.config.files import recipe_from_dict
from toolkit.data.losses import IGNORE_INDEX, tiled_loss_sum
from toolkit.errors import RecipeError
from toolkit.strategies import validate_strategy


@pytest.mark.parametrize("tile", [1, 5, 7, 1000])  # one token, uneven tiles, one tile for all
def test_tiled_loss_and_gradients_equal_the_full_logits(tile):
    torch.manual_seed(0)
    hidden = torch.randn(3, 6, 16, dtype=torch.float64, requires_grad=True)
    head = torch.nn.Linear(16, 50, bias=False).double()
    labels = torch.randint(0, 50, (3, 6))
    labels[1, 4:] = IGNORE_INDEX  # padding
    # plain PyTorch: the whole [B, T, vocab] logits, the next token's label at each place but the last
    full = F.cross_entropy(head(hidden)[:, :-1].reshape(-1, 50).float(), labels[:, 1:].reshape(-1), reduction="sum",
                           ignore_index=IGNORE_INDEX)
    full_grads = torch.autograd.grad(full, [hidden, head.weight])
    tiled = tiled_loss_sum(hidden, head, labels, tile=tile)
    tiled_grads = torch.autograd.grad(tiled, [hidden, head.weight])
    assert tiled.item() == pytest.approx(full.item(), rel=1e-6)
    for got, want in zip(tiled_grads, full_grads):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_a_tile_holds_at_most_two_to_the_25_logits():
    from toolkit.data.losses import tile_tokens

    assert tile_tokens(30522) == 1099 and tile_tokens(2 ** 26) == 1


# the tiny Llama's batches of 8 at max_length 32, in tiles of 2^25 // 30522 = 1,099 tokens: one tile per micro-batch;
# tile_tokens' size is a memory setting, the unit test above covers several tiles
@pytest.mark.parametrize("name, nproc, overrides", [
    ("single-tiled", 1, ("train.tiled_loss=true",)),
    ("ddp-tiled", 2, ("strategy.name=ddp", "batch.micro_batch_size=4", "train.tiled_loss=true")),
    ("fsdp-tiled", 2, ("strategy.name=fsdp", "batch.micro_batch_size=4", "train.tiled_loss=true",
                       "train.activation_checkpointing=true")),
    # ZeRO-2 holds the head's weight whole; ZeRO-3 gathers it in the head's forward and again before its
    # backward (DeepSpeed's hooks on the module and on its output), where the tiles are recomputed
    ("zero2-tiled", 2, ("strategy.name=zero", "strategy.stage=2", "batch.micro_batch_size=4",
                        "train.tiled_loss=true")),
    ("zero3-tiled", 2, ("strategy.name=zero", "strategy.stage=3", "batch.micro_batch_size=2",
                        "batch.grad_accum_steps=2", "train.tiled_loss=true"))])
def test_tiled_loss_runs_train_as_the_full_loss_does(llama_runs, name, nproc, overrides):
    run, reference = llama_runs.get(name, nproc=nproc, overrides=overrides), llama_runs.get("single-m8")
    assert_matches_single(run, reference)
    # the final evaluation's loss, tiled too
    assert metrics(run)[-1]["eval_loss"] == pytest.approx(metrics(reference)[-1]["eval_loss"], rel=1e-6)


def test_tiled_loss_under_context_parallel_trains_as_the_full_loss_does(llama_runs):
    """Each cp rank's loss in tiles of its own tokens (their labels shifted over the whole sequence before the
    split), the output layer inside FSDP's root unit as without cp: as the single process trains, and its
    final evaluation (tiled too) within context parallel's own bound (test_context_parallel)."""
    from test_context_parallel import CP2

    run, reference = llama_runs.get("cp2-tiled", nproc=2, overrides=(*CP2, "train.tiled_loss=true")), \
        llama_runs.get("single-m8")
    assert_matches_single(run, reference)
    assert metrics(run)[-1]["eval_loss"] == pytest.approx(metrics(reference)[-1]["eval_loss"], rel=1e-5)
    untiled = llama_runs.get("cp2", nproc=2, overrides=CP2)  # test_context_parallel's
    assert [m["loss"] for m in metrics(run)] == pytest.approx([m["loss"] for m in metrics(untiled)], rel=1e-6)


def test_a_context_parallel_ranks_tiled_loss_goes_through_the_tiles(monkeypatch):
    """What the whole run above cannot tell apart from a loss computed whole: a cp rank's forward under
    train.tiled_loss hands its output layer to tiled_loss_sum (here in tiles of 3 of its 8 tokens), whose sum and
    gradients equal the full logits' loss over the rank's shifted labels, computed in plain PyTorch."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from toolkit.data.losses import forward_loss_sum
    from toolkit.strategies import base
    from toolkit.strategies.dims import context

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    calls = []

    def in_tiles(hidden, head, labels, **kwargs):
        calls.append(labels.clone())
        return tiled_loss_sum(hidden, head, labels, **{**kwargs, "tile": 3})

    monkeypatch.setattr(base, "tiled_loss_sum", in_tiles)
    ids = torch.randint(0, 40, (2, 4))
    labels = torch.randint(0, 40, (2, 4))
    labels[1, 3] = IGNORE_INDEX
    share = context.RankBatch(input_ids=ids, position_ids=torch.arange(4, 8).expand(2, 4), shifted_labels=labels,
                              token_mask=torch.ones(2, 4), sequence=None)  # type: ignore[arg-type]

    class Rank:  # what _local_loss asks of a strategy
        def __init__(self):
            self.model = model

        def forward_context(self):
            return torch.autocast("cpu", enabled=False)

    def loss_sum(output, batch):
        return forward_loss_sum(output, batch, "causal-lm")

    tiled = context._local_loss(Rank(), share, loss_sum, tiled=True)
    assert len(calls) == 1 and torch.equal(calls[0], labels)
    tiled_grads = torch.autograd.grad(tiled, list(model.parameters()))
    logits = model(input_ids=ids, position_ids=share.position_ids).logits
    full = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum", ignore_index=IGNORE_INDEX)
    assert tiled.item() == pytest.approx(full.item(), rel=1e-6)
    for got, want in zip(tiled_grads, torch.autograd.grad(full, list(model.parameters()))):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arm", ["tp-sp", "fsdp-tp2"])
def test_tiled_loss_under_tensor_parallel_trains_as_the_full_loss_does(llama4_runs, arm):
    """The tensor-parallel plans split the blocks' layers, not the output layer: each rank holds it whole (the tied
    Llama's embedding, replicated over tp; under fsdp × tp, gathered with FSDP's root unit) and tiles its loss as
    one process does; under sequence parallelism the layer's input is gathered over the sequence before the tiles.
    As the single process trains, and as the untiled arm (test_tensor_parallel's) to 1e-6."""
    from test_tensor_parallel import ARMS as TP_ARMS

    ranks, overrides = TP_ARMS[arm]
    run = llama4_runs.get(f"{arm}-tiled", nproc=ranks, overrides=(*overrides, "train.tiled_loss=true"))
    assert_matches_single(run, llama4_runs.get("single"))
    untiled = llama4_runs.get(arm, nproc=ranks, overrides=overrides)
    assert [m["loss"] for m in metrics(run)] == pytest.approx([m["loss"] for m in metrics(untiled)], rel=1e-6)


def recipe(**sections):
    return recipe_from_dict({"model": {"path": "/m", "task": "causal-lm"}, "data": {"train": "t.jsonl"},
                             "batch": {"global_batch_size": 8, "micro_batch_size": 1},
                             "train": {"tiled_loss": True}, **sections})


@pytest.mark.parametrize("sections, world_size, words", [
    ({"strategy": {"name": "dp"}}, 2, "train.tiled_loss is not available with strategy dp yet"),
    ({"strategy": {"name": "hybrid", "pipeline_degree": 2}}, 2,
     "train.tiled_loss is not available with strategy hybrid yet"),
])
def test_where_tiled_loss_is_not_checked_it_is_refused(sections, world_size, words):
    with pytest.raises(RecipeError) as refused:
        validate_strategy(recipe(**sections), world_size=world_size)
    assert str(refused.value).startswith(words) and "\n" not in str(refused.value)
    # the strategies it names are the ones that tile (tp among them: its tiled loss is checked in this file)
    assert str(refused.value).endswith("; use single, ddp, fsdp, zero or tp, or set train.tiled_loss: false")


def test_tiled_loss_on_a_classifier_exits_2(tmp_path, tiny_bert_dir):
    path = write_recipe(tmp_path / "r.yaml", model_dir=tiny_bert_dir, task="sequence-classification",
                        output_dir=tmp_path / "out")
    done = run_cli("validate", str(path), "--set", "train.tiled_loss=true")
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "toolkit: error: train.tiled_loss tiles a causal LM's per-token loss; model.task is sequence-classification; "
        "set train.tiled_loss: false"], done.stderr


def test_the_plan_counts_the_logits_tiling_keeps_from_existing_whole():
    """Under train.tiled_loss a micro-batch's [T, vocab] logits are made a tile at a time and made again in backward:
    what the full loss holds at once (the fp32 logits, log-softmax and their gradients) never exists whole. The plan
    traced the full loss all the same (fsdp at max_length 128: 1,381 MiB planned, 1,127 measured; 1,428 untiled).
    Its activations now fall by at least two T × vocab fp32 tensors (counted here from the config), as a run's do
    (measured: 301 MiB, 2.5 of them)."""
    sets = ["--strategies", "fsdp", "--set", "data.max_length=128", "--set", "data.packing=true"]
    planned = {}
    for tiled in ("false", "true"):
        done = run_cli("plan", "recipes/llama-tiny.yaml", *sets, "--set", f"train.tiled_loss={tiled}")
        assert done.returncode == 0, done.stderr[-2000:]
        row = next(line for line in done.stdout.splitlines() if line.startswith("fsdp "))
        planned[tiled] = int(row.split()[-4]) * 2 ** 20  # activations MiB, then (with checkpointing), peak, fits
    logits = 8 * 128 * 30522 * 4  # micro-batch 8 × 128 tokens × llama-tiny's vocabulary, fp32
    assert planned["false"] - planned["true"] >= 2 * logits - 2 ** 20, planned
