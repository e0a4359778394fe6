"""The strategy registry: every strategy's own checks run before any rank starts, by name only here."""

import dataclasses
import re

import pytest

from toolkit.config.files import recipe_from_dict
from toolkit.config.strategy_options import option_names
from toolkit.errors import RecipeError
from toolkit.strategies import arm_aliases, make_strategy, strategy_info, strategy_names, validate_strategy

BASE = {"model": {"path": "/m"}, "data": {"train": "t.jsonl"}}


def recipe(**strategy):
    return recipe_from_dict({**BASE, "strategy": strategy})


@pytest.mark.parametrize("strategy, world_size, words", [
    ({"name": "megatron"}, 1, "strategy.name: unknown value 'megatron'; choose one of single, dp, ddp, fsdp, zero"),
    ({"name": "ddp", "stage": 3}, 2, "strategy.stage applies to zero only, but strategy.name is ddp"),
    ({"name": "single", "replicate_degree": 2}, 1, "strategy.replicate_degree applies to fsdp/hf_native only"),
    ({"name": "zero", "stage": 2, "offload_param": True}, 2, "needs strategy.stage=3"),
    ({"name": "zero", "stage": 5}, 2, "strategy.stage must be 0, 1, 2 or 3, got 5"),
    ({"name": "zero", "stage": 0, "offload_optimizer": True}, 2, "offload_optimizer needs strategy.stage >= 1"),
    ({"name": "fsdp", "replicate_degree": 3}, 4, "replicate_degree 3 does not divide world size 4"),
    ({"name": "single"}, 2, "strategy single runs in one process, but 2 were asked for"),
    ({"name": "dp"}, 2, "strategy dp runs in one process"),
])
def test_strategy_checks_name_the_key(strategy, world_size, words):
    with pytest.raises(RecipeError, match=words.replace("(", r"\(").replace(".", r"\.")):
        validate_strategy(recipe(**strategy), world_size=world_size)


def test_valid_strategies_pass_and_plan_the_batch():
    assert validate_strategy(recipe(name="fsdp", replicate_degree=2), world_size=4).world_size == 4
    assert validate_strategy(recipe(name="zero", stage=3, offload_param=True), world_size=2).micro_batch_size == 8


def test_every_strategy_describes_itself_and_builds():
    aliases = arm_aliases()
    for name in strategy_names():
        info = strategy_info(name)
        assert info.name == name and info.summary
        assert make_strategy(recipe(name=name)).info == info
        # every arm a strategy offers names that strategy
        assert all(f"strategy.name={name}" in overrides for overrides in info.arms.values())
        assert set(info.arms) <= set(aliases)


def test_a_rank_makes_its_strategy_once(tmp_path, tiny_llama_dir, monkeypatch):
    # one strategy object per rank: the checks, the data layout, the memory prediction and the run itself all
    # ask the one the run trains with (four were made per rank before)
    import torch

    from conftest import write_recipe
    from toolkit.config.files import load_recipe
    from toolkit.process.dist import DistEnv
    from toolkit.strategies import single
    from toolkit.train.loop import train

    made = []
    build = single.build
    monkeypatch.setattr(single, "build", lambda recipe: made.append(recipe.strategy.name) or build(recipe))
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=tmp_path / "run",
                                      train={"max_steps": 1}))
    result = train(recipe, DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu")))
    assert made == ["single"] and len(result.losses) == 1


def test_every_strategy_module_exposes_what_the_registry_reads():
    # the registry reads each module's INFO, RULES, build and degrees by name: a module that lost one fails here,
    # not in the first run that asks for it
    from toolkit.strategies import _module
    from toolkit.strategies.base import StrategyInfo

    for name in strategy_names():
        module = _module(name)
        assert isinstance(module.INFO, StrategyInfo) and module.INFO.name == name, name
        assert callable(module.build) and callable(module.degrees), name
        assert dataclasses.is_dataclass(module.OPTIONS) and module.INFO.options == option_names(module.OPTIONS), name
        assert all(callable(getattr(module.RULES, member)) for member in (
            "info", "validate", "data_layout", "predict_state_bytes", "predict_load_bytes", "predict_step_bytes",
            "predict_gathered_bytes", "predict_activation_bytes")), name


def test_every_strategy_key_belongs_to_a_strategy_options_dataclass():
    # each strategy declares the keys it reads as a dataclass of its own; the recipe's one strategy section holds
    # each key's type and default. A key no strategy declares could be set and never read: nothing would refuse it
    from toolkit.config.strategy_options import StrategyConfig
    from toolkit.strategies import _module

    declared = {option for name in strategy_names() for option in option_names(_module(name).OPTIONS)}
    keys = {f.name for f in dataclasses.fields(StrategyConfig)} - {"name"}
    assert declared == keys


def test_an_options_dataclass_refuses_a_key_of_another_type_or_a_default_of_its_own():
    # the options dataclasses are views of the recipe's section: a field typed apart from it, or with a second
    # default, would let a strategy read something the recipe never holds
    from toolkit.config.strategy_options import strategy_options

    with pytest.raises(AssertionError, match=re.escape("tp_degree: int, but the recipe's is int | None")):
        @strategy_options
        class Retyped:
            tp_degree: int
    with pytest.raises(AssertionError, match="the default lives in StrategyConfig only"):
        @strategy_options
        class Defaulted:
            cpu_offload: bool = True
    with pytest.raises(AssertionError, match="not a strategy.<option> key"):
        @strategy_options
        class Unknown:
            no_such_key: bool


def test_a_strategy_reads_its_options_from_the_recipe():
    from toolkit.config.strategy_options import options_of
    from toolkit.strategies.fsdp import FsdpOptions

    options = options_of(FsdpOptions, recipe(name="fsdp", cpu_offload=True))
    assert options.cpu_offload is True and options.reshard_after_forward is True and options.tp_degree is None
