"""Recipe schema: unknown keys, wrong types and inconsistent batch arithmetic are errors that name the fix."""

import re

import pytest

from toolkit.config.files import apply_override, recipe_from_dict
from toolkit.config.recipe import BatchConfig, plan_batch
from toolkit.errors import RecipeError

BASE = {"model": {"path": "/m"}, "data": {"train": "t.jsonl"}}


def make(**extra):
    raw = {k: dict(v) for k, v in BASE.items()}
    for key, value in extra.items():
        raw[key] = {**raw.get(key, {}), **value} if isinstance(value, dict) else value
    return recipe_from_dict(raw)


def test_defaults_resolve():
    recipe = make()
    assert recipe.strategy.name == "single" and recipe.precision == "fp32"


@pytest.mark.parametrize("raw, words", [
    ({"optim": {"learning_rate": 1}}, "unknown recipe key 'optim.learning_rate'"),
    ({"bogus": 1}, "unknown recipe key 'bogus'"),
    # a near miss names the key it was likely meant to be
    ({"train": {"max_step": 5}}, "unknown recipe key 'train.max_step'; did you mean 'train.max_steps'? known keys"),
    ({"optimizer": {"lr": 1}}, "unknown recipe key 'optimizer'; did you mean 'optim'?"),
    ({"optim": {"lr": "fast"}}, "optim.lr: expected a number"),
    ({"batch": {"micro_batch_size": 2.5}}, "batch.micro_batch_size: expected an integer"),
    ({"precision": "fp8"}, "precision: unknown value 'fp8'"),
    # values the schema took that training could not: nan fails every bound, so each range refuses it
    ({"optim": {"lr": float("nan")}}, "optim.lr: got nan; it must be a finite number > 0"),
    ({"optim": {"betas": [2.0, 0.5]}}, "optim.betas: got [2.0, 0.5]; it must be two numbers in [0, 1)"),
    ({"optim": {"eps": -1.0}}, "optim.eps: got -1.0"),
    ({"optim": {"max_grad_norm": -1.0}}, "optim.max_grad_norm: got -1.0"),
    ({"model": {"path": "/m", "dropout": 2.0}}, "model.dropout: got 2.0; it must be in [0, 1)"),
    ({"model": {"path": "/m", "num_labels": 2**31}}, "model.num_labels: got 2147483648"),
    ({"train": {"max_steps": None, "epochs": float("nan")}}, "train.epochs: got nan"),
    ({"train": {"eval_every": 0}}, "train.eval_every must be > 0, got 0"),
    ({"checkpoint": {"every_minutes": 0}}, "checkpoint.every_minutes must be > 0, got 0"),
    ({"checkpoint": {"every_minutes": float("nan")}}, "checkpoint.every_minutes must be > 0, got nan"),
    ({"data": {"train": "t.jsonl", "max_length": 2**31}}, "data.max_length: got 2147483648"),
    ({"seed": 2**63}, "seed: got 9223372036854775808; it must be in 0..2**32-1"),
    ({"optim": {1: 0, "lr": 1.0}}, "unknown recipe key 'optim.1'"),  # YAML keys need not be strings
])
def test_bad_recipes_raise_with_the_key(raw, words):
    with pytest.raises(RecipeError, match=re.escape(words)):
        make(**raw)


def test_batch_arithmetic_checked_against_world_size():
    batch = BatchConfig(micro_batch_size=4, grad_accum_steps=2, global_batch_size=16)
    assert plan_batch(batch, world_size=2).global_batch_size == 16
    with pytest.raises(RecipeError, match=r"3 ranks × micro 4 × accum 2 = 24, but global_batch_size is 16"):
        plan_batch(batch, world_size=3)


def test_accumulation_derived_from_global_batch():
    batch = BatchConfig(micro_batch_size=2, grad_accum_steps=None, global_batch_size=16)
    assert plan_batch(batch, world_size=2).grad_accum_steps == 4
    with pytest.raises(RecipeError, match="not a multiple"):
        plan_batch(batch, world_size=3)


def test_a_recipe_giving_the_global_batch_alone_derives_its_accumulation():
    # a first recipe's usual shape: micro and global batch, no grad_accum_steps (it had defaulted to 1: refused)
    recipe = make(batch={"micro_batch_size": 4, "global_batch_size": 32})
    assert plan_batch(recipe.batch, world_size=2).grad_accum_steps == 4
    assert plan_batch(recipe.batch, world_size=1).grad_accum_steps == 8
    # neither given: one micro-batch a step, as before
    assert plan_batch(make(batch={"micro_batch_size": 4}).batch, world_size=2).global_batch_size == 8


def test_override_parses_yaml_values():
    raw = {"optim": {"lr": 1.0}}
    apply_override(raw, "optim.lr=1e-4")
    apply_override(raw, "train.eval_every=null")
    apply_override(raw, "strategy.blocks=[LlamaDecoderLayer]")
    # 1e-4 is text to YAML 1.1; the typed recipe reads it as the number, as it does in a file
    assert raw == {"optim": {"lr": "1e-4"}, "train": {"eval_every": None}, "strategy": {"blocks": ["LlamaDecoderLayer"]}}
    assert make(optim=raw["optim"]).optim.lr == 1e-4
    with pytest.raises(RecipeError, match="expected key.path=value"):
        apply_override(raw, "optim.lr")
    with pytest.raises(RecipeError, match=r"--set 'data.chat_template=\{% if': the value is not valid YAML"):
        apply_override(raw, "data.chat_template={% if")
