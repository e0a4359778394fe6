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


def recipe(**sections):
    return recipe_from_dict({"model": {"path": "/m", "task": "causal-lm"}, "data": {"train": "t.jsonl"},
                             "batch": {"global_batch_size": 8, "micro_batch_size": 1},
                             "train": {"tiled_loss": True}, **sections})


@pytest.mark.parametrize("sections, world_size, words", [
    ({"strategy": {"name": "tp"}}, 2, "train.tiled_loss is not available with strategy tp yet"),
    ({"strategy": {"name": "dp"}}, 2, "train.tiled_loss is not available with strategy dp yet"),
    ({"strategy": {"name": "fsdp", "tp_degree": 2}}, 4, "train.tiled_loss is not available with strategy.tp_degree"),
])
def test_where_tiled_loss_is_not_checked_it_is_refused(sections, world_size, words):
    with pytest.raises(RecipeError) as refused:
        validate_strategy(recipe(**sections), world_size=world_size)
    assert str(refused.value).startswith(words) and "\n" not in str(refused.value)


def test_tiled_loss_on_a_classifier_exits_2(tmp_path, tiny_bert_dir):
    path = write_recipe(tmp_path / "r.yaml", model_dir=tiny_bert_dir, task="sequence-classification",
                        output_dir=tmp_path / "out")
    done = run_cli("validate", str(path), "--set", "train.tiled_loss=true")
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "toolkit: error: train.tiled_loss tiles a causal LM's per-token loss; model.task is sequence-classification; "
        "set train.tiled_loss: false"], done.stderr
