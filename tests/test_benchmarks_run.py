"""Every benchmark runs for one tiny step on CPU and prints its table: each starts the toolkit as its user does
(`toolkit train`/`launch` in a subprocess; compare_overhead's worker as a rank of the recipe), so a change to
the toolkit that breaks a benchmark fails here, not on the day someone measures (compare_overhead's worker had
unpacked 8 of prepare()'s 10 values, unnoticed while its test ran --help only). Their `toolkit` processes are
forked from the tests' server as every other test's are (tests/forking), apart from the start-up benchmark's,
whose table is the time a plain process takes to start."""

import subprocess
import sys

import pytest

from conftest import EVAL, REPO, forked_env, toolkit_env

TINY_LLAMA = ["--layers", "1", "--hidden", "64", "--intermediate", "128", "--heads", "4"]
RUNS = {
    "peer_trainer": (["--steps", "2", "--rounds", "1"], "toolkit samples/s"),
    "compare_overhead": (["--strategies", "ddp", "--steps", "3"], "overhead %"),
    "checkpoint_cost": (["--strategies", "ddp", "--steps", "2", "--every", "1"], "async/sync"),
    "memory_scaling": (["--arms", "ddp", "--layers", "1", "--steps", "1", "--from-config"], "peak RSS MiB/rank"),
    "long_context": (["--arms", "single,cp2-ulysses", "--start", "64", "--max", "64", "--steps", "1"],
                     "longest sequence"),
    "expert_parallel": (["--arms", "ep2", "--steps", "1"], "load spread"),
    # the final evaluation over 64 rows, not the recipe's 256: its path is the same, four times fewer forwards
    "communication": (["--arms", "ddp,ddp-bf16c", "--steps", "2", "--set", f"data.eval={EVAL}"], "bytes/step"),
    "pipeline_efficiency": (["--arms", "single,pp-zbv", "--steps", "2", "--from-files"], "setup peak above"),
    "scale_prediction": (["--rows", "4", "--cli-check"], "published"),
    "startup": (["--runs", "1"], "median s"),
    "zero3_host_time": (["--cases", "llama", "--steps", "2"], "host ms/tensor"),
    "gpu_throughput": (["--arms", "single", "--steps", "2", "--seq", "32", "--micro-batch", "1", "--hardware", "h200",
                        *TINY_LLAMA], "predicted ms"),
}


@pytest.mark.parametrize("name", sorted(RUNS))
def test_benchmark_prints_its_table(name):
    args, column = RUNS[name]
    result = subprocess.run([sys.executable, f"benchmarks/{name}.py", *args], cwd=REPO,
                            env=toolkit_env() if name == "startup" else forked_env(),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    table = result.stdout.splitlines()
    header = next(i for i, line in enumerate(table) if column in line)
    rows = [line for line in table[header + 1:] if line.strip() and not set(line) <= set("|- ")]
    assert rows and "failed" not in result.stdout, result.stdout
    if name == "gpu_throughput":  # toolkit plan's step time beside the measured one: a number, not n/a
        cells = dict(zip(table[header].split("|"), rows[0].split("|")))
        assert float(cells[" predicted ms "]) > 0, result.stdout


def test_scale_prediction_leaves_out_a_pipeline_over_hsdp_replicas_as_the_toolkit_refuses_it(monkeypatch):
    """A published pp × dp_replicate × dp_shard row would otherwise be planned as one FSDP group over both (the
    hybrid strategy's stage replicas are one FSDP or one DDP group): left out with the reason, as the toolkit's
    layout check refuses those degrees together."""
    import importlib.util

    from toolkit.config.files import load_recipe
    from toolkit.config.parallel import resolve
    from toolkit.errors import RecipeError

    spec = importlib.util.spec_from_file_location("scale_prediction", REPO / "benchmarks" / "scale_prediction.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "scale_prediction", module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    layout = {"dp_shard": 2, "dp_replicate": 2, "tp": 1, "pp": 2, "cp": 1, "ep": 1, "engine": "fsdp2"}
    row = {"layout": layout, "published": {"tokens_per_s_per_gpu": 1000}, "hardware": "h100-sxm",
           "precision": "bf16", "model": {"num_experts": None, "vocab_size": 32000}}
    assert "pp × dp_replicate × dp_shard" in module.skip_reason(row)
    assert module.skip_reason({**row, "layout": {**layout, "dp_replicate": 1}}) is None
    # a row without its vocabulary (NeMo's GPT-3 175B) is left out with that reason, not refused by a traceback
    assert module.skip_reason({**row, "layout": {**layout, "dp_replicate": 1}, "model": {"vocab_size": None}}) \
        == "the model's vocabulary size not stated"
    # a published pipeline is planned with the blocks per stage its run had (torchtitan's generate_split_points:
    # 126 layers over 8 stages as 15, 16 × 6, 15; Megatron-Core's even split), not the toolkit's FLOP balance
    def sizes(layers: int, stages: int, engine: str) -> list[int]:
        [split] = module.published_split({"model": {"num_layers": layers}, "layout": {"engine": engine}}, stages)
        starts = [0, *map(int, split.split("=")[1].strip("[]").split(",")), layers]
        return [b - a for a, b in zip(starts, starts[1:])]
    assert sizes(126, 8, "fsdp2") == [15, 16, 16, 16, 16, 16, 16, 15]
    assert sizes(126, 16, "fsdp2") == [7] + [8] * 14 + [7]
    assert sizes(36, 4, "megatron") == [9, 9, 9, 9]
    with pytest.raises(RecipeError, match="pp × dp_replicate × dp_shard"):
        resolve(load_recipe(REPO / "recipes" / "llama-tiny.yaml",
                            ["parallel.pp=2", "parallel.dp_shard=2", "parallel.dp_replicate=2"]), world_size=8)
