"""`parallel:` degrees choose the layout on their own: each tested combination runs as the preset that runs it,
untested ones and contradictions are one line, and every run records the degrees it ran at."""

import json

import pytest

from conftest import assert_same_run, run_cli
from toolkit.config.files import recipe_from_dict
from toolkit.config.parallel import degrees_of, resolve
from toolkit.errors import RecipeError
from toolkit.strategies import strategy_degrees, validate_strategy

M4 = ("batch.micro_batch_size=4",)


def recipe(parallel=None, model="/m", **strategy):
    return recipe_from_dict({"model": {"path": str(model), "task": "causal-lm"}, "data": {"train": "t.jsonl"}, "strategy": strategy,
                             **({"parallel": parallel} if parallel else {}),
                             "batch": {"global_batch_size": 8, "micro_batch_size": 1}})


@pytest.mark.parametrize("parallel, world_size, name, options", [
    ({"dp_replicate": 2}, 2, "ddp", {}),
    ({"dp_shard": 2}, 2, "fsdp", {}),
    ({"dp_shard": 4}, 4, "fsdp", {}),
    ({"dp_replicate": 2}, 4, "fsdp", {"replicate_degree": 2}),  # dp_shard takes the other 2: HSDP
    ({"dp_replicate": 2, "dp_shard": 2}, 4, "fsdp", {"replicate_degree": 2}),
    ({"tp": 2}, 2, "tp", {}),
    ({"dp_shard": 2, "tp": 2}, 4, "fsdp", {"tp_degree": 2}),
    ({"tp": 2}, 4, "fsdp", {"tp_degree": 2}),
    ({"pp": 2}, 2, "pipeline", {}),
    ({"pp": 2, "dp_replicate": 2}, 4, "hybrid", {"pipeline_degree": 2, "data_parallel": "ddp"}),
    ({"pp": 2, "dp_shard": 2}, 4, "hybrid", {"pipeline_degree": 2, "data_parallel": "fsdp"}),
    ({"pp": 2}, 4, "hybrid", {"pipeline_degree": 2, "data_parallel": "fsdp"}),
    ({"tp": 1}, 1, "single", {}),
    ({"cp": 2}, 2, "fsdp", {"cp_degree": 2}),
    ({"dp_shard": 2, "cp": 2}, 4, "fsdp", {"cp_degree": 2}),
    ({"cp": 2}, 4, "fsdp", {"cp_degree": 2}),  # dp_shard takes the other 2
    ({"cp": 2, "tp": 2}, 4, "fsdp", {"cp_degree": 2, "tp_degree": 2}),
    ({"pp": 2, "tp": 2}, 4, "pipeline", {"tp_degree": 2}),  # each stage tensor-parallel
    # tensor-parallel stages sharded over their replicas: dp_shard given, or the ranks the others leave
    ({"pp": 2, "dp_shard": 2, "tp": 2}, 8, "hybrid", {"pipeline_degree": 2, "data_parallel": "fsdp", "tp_degree": 2}),
    ({"pp": 2, "tp": 2}, 8, "hybrid", {"pipeline_degree": 2, "data_parallel": "fsdp", "tp_degree": 2}),
])
def test_degrees_resolve_to_the_preset_that_runs_them(parallel, world_size, name, options, tiny_llama_dir):
    resolved = resolve(recipe(parallel, model=tiny_llama_dir), world_size=world_size)
    assert resolved.strategy.name == name
    assert {key: getattr(resolved.strategy, key) for key in options} == options
    # the preset's own degrees are the ones asked for (the run prints and records these)
    assert strategy_degrees(resolved, world_size=world_size) == degrees_of(resolved, world_size=world_size)
    assert resolve(resolved, world_size=world_size) == resolved  # a resolved recipe (a run's recipe.yaml) stays
    validate_strategy(resolved, world_size=world_size)


@pytest.mark.parametrize("name, options, world_size", [
    ("single", {}, 1), ("ddp", {}, 2), ("fsdp", {}, 2), ("fsdp", {"replicate_degree": 2}, 4),
    ("fsdp", {"tp_degree": 2}, 4), ("tp", {}, 2), ("pipeline", {}, 2), ("fsdp", {"cp_degree": 2}, 4),
    ("pipeline", {"tp_degree": 2}, 4),
    ("hybrid", {"pipeline_degree": 2, "data_parallel": "ddp"}, 4),
    ("hybrid", {"pipeline_degree": 2, "data_parallel": "fsdp"}, 4),
    ("hybrid", {"pipeline_degree": 2, "data_parallel": "fsdp", "tp_degree": 2}, 8),
])
def test_every_preset_is_its_degrees(name, options, world_size):
    # the preset's degrees, given as `parallel:` alone, run the same preset with the same options
    preset = recipe(name=name, **options)
    degrees = strategy_degrees(preset, world_size=world_size)
    given = {key: value for key, value in degrees.as_dict().items() if value > 1}
    resolved = resolve(recipe(given or {"tp": 1}), world_size=world_size)
    assert resolved.strategy == preset.strategy


@pytest.mark.parametrize("parallel, strategy, world_size, words", [
    ({"cp": 2, "pp": 2}, {}, 4, "parallel: pp × cp together is not tested yet"),
    # DDP replicas of tensor-parallel stages: torch's DDP refuses DTensor parameters
    ({"pp": 2, "dp_replicate": 2, "tp": 2}, {}, 8, "parallel: pp × dp_replicate × tp: DDP cannot hold the stages' "
     "tensor-parallel (DTensor) weights; give the replicas as parallel.dp_shard"),
    ({"cp": 2, "pp": 2, "tp": 2}, {}, 8, "parallel: pp × cp × tp together is not tested yet"),
    ({"dp_shard": 3}, {}, 4, "parallel: dp_shard 3 ranks, but the run has 4; make the product 4"),
    ({"dp_shard": 3, "tp": 2}, {}, 4, "parallel: dp_shard 3 × tp 2 = 6 ranks, but the run has 4; make the product 4"),
    ({"tp": 3}, {}, 4, "parallel: tp 3 does not divide the 4 ranks"),
    # one process (`toolkit train` with no launcher): the fix is a launch on that many ranks
    ({"pp": 2, "tp": 2}, {}, 1, "parallel: pp 2 × tp 2 = 4 needs 4 ranks, and this run has 1; launch it on 4 "
     "(toolkit launch --nproc 4)"),
    ({"dp_shard": 2}, {"name": "ddp"}, 2, "strategy.name ddp and parallel (dp_shard 2, which runs as fsdp) disagree"),
    ({"dp_replicate": 2}, {"name": "fsdp", "replicate_degree": 4}, 4,
     "strategy.replicate_degree=4 disagrees with parallel (dp_replicate 2 × dp_shard 2), which sets 2"),
])
def test_what_the_degrees_cannot_run_is_refused_in_one_line(parallel, strategy, world_size, words):
    with pytest.raises(RecipeError) as refused:
        resolve(recipe(parallel, **strategy), world_size=world_size)
    assert str(refused.value).startswith(words) and "\n" not in str(refused.value)


def test_an_untested_pair_exits_2_with_one_line(tmp_path, tiny_llama_dir):
    from conftest import write_recipe

    path = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=tmp_path / "out")
    done = run_cli("validate", str(path), "--nproc", "4", "--set", "parallel.cp=2", "--set", "parallel.pp=2")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "toolkit: error: parallel: pp × cp together is not tested yet (tested: dp_replicate × dp_shard; "
        "dp_shard × tp; dp_replicate × tp; dp_replicate × dp_shard × tp; dp_shard × cp; cp × tp; dp_replicate × cp; "
        "dp_replicate × dp_shard × cp; pp × tp; pp × dp_replicate; pp × dp_shard; pp × dp_shard × tp); drop one of "
        "them"]
    assert not (tmp_path / "out").exists()
    done = run_cli("validate", str(path), "--nproc", "2", "--set", "parallel.dp_shard=2")
    assert done.returncode == 0 and "# parallel: fsdp (dp_shard 2)" in done.stdout.splitlines()
    # degrees that do not fit the world given: toolkit plan of the recipe as written says it as validate does, in
    # one line, exit 2 (it was a row "fsdp cannot run: ...", exit 1; before that "single cannot run", the recipe's
    # strategy.name, which the degrees replace)
    line = ("toolkit: error: parallel: cp 2 does not divide the 3 ranks; the rest would be dp_shard; give degrees "
            "whose product divides 3")
    for command in ("plan", "validate"):
        done = run_cli(command, str(path), "--nproc", "3", "--set", "parallel.cp=2")
        assert done.returncode == 2 and done.stderr.strip().splitlines() == [line], (command, done.stderr)


@pytest.mark.parametrize("parallel, preset", [
    ("parallel.dp_shard=2", ("fsdp", ("strategy.name=fsdp", *M4))),
    ("parallel.dp_replicate=2", ("ddp-m4", ("strategy.name=ddp", *M4))),
])
def test_degrees_alone_run_exactly_as_their_preset(llama_runs, parallel, preset):
    name, overrides = preset
    run = llama_runs.get(parallel, nproc=2, overrides=(parallel, *M4))
    assert_same_run(run, llama_runs.get(name, nproc=2, overrides=overrides), rtol=0.0)
    info = json.loads((run / "run.json").read_text())
    key, value = parallel.removeprefix("parallel.").split("=")
    assert info["strategy"] == name.split("-")[0]
    assert {k: v for k, v in info["parallel"].items() if v > 1} == {key: int(value)}
