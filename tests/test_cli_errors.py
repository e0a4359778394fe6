"""Each user mistake: exit code 2, one line naming the problem and the fix, no output dir left behind."""

import pytest

from conftest import EVAL, REPO, run_cli, write_recipe
from toolkit import precision as precision_mod
from toolkit.cli import main


def _bad_recipe(tmp_path, tiny_llama_dir, **sections):
    out = tmp_path / "out"
    return write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=out, **sections), out


def _assert_one_line_exit_2(code, capsys, words, out):
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("toolkit: error:") and words in err[0], err
    assert not out.exists()


CASES = {
    "unknown key": ({"optim": {"learning_rate": 0.1}}, (), "unknown recipe key 'optim.learning_rate'"),
    "wrong type": ({"batch": {"micro_batch_size": "eight"}}, (), "expected an integer"),
    "unknown strategy": ({}, ("strategy.name=megatron",), "strategy.name: unknown value 'megatron'"),
    "batch mismatch": ({"batch": {"micro_batch_size": 8, "grad_accum_steps": 1, "global_batch_size": 12}}, (),
                       "1 ranks × micro 8 × accum 1 = 8, but global_batch_size is 12"),
    "missing model": ({"model": {"path": "/nonexistent/model", "task": "causal-lm"}}, (),
                      "/nonexistent/model"),
    "missing column": ({"data": {"text_column": "review"}}, (), "has no column 'review'"),
    "cls without label column": ({"model": {"task": "sequence-classification"}},
                                 ("data.label_column=stars", f"data.train={EVAL}"), "has no column 'stars'"),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("command", ["train", "validate"])
def test_bad_input_exits_2_with_one_line(case, command, tmp_path, tiny_llama_dir, capsys):
    sections, overrides, words = CASES[case]
    if "model" in sections:
        sections = {"model": {**sections["model"], "path": sections["model"].get("path", str(tiny_llama_dir))}}
    recipe, out = _bad_recipe(tmp_path, tiny_llama_dir, **sections)
    args = [command, str(recipe)] + [a for o in overrides for a in ("--set", o)]
    _assert_one_line_exit_2(main(args), capsys, words, out)


def test_fp16_refused_where_the_device_cannot(tmp_path, tiny_llama_dir, capsys, monkeypatch):
    class NoHalf:
        def __init__(self, *args, **kwargs):
            raise RuntimeError("float16 autocast is not supported here")

    monkeypatch.setattr(precision_mod.torch, "autocast", NoHalf)
    recipe, out = _bad_recipe(tmp_path, tiny_llama_dir, precision="fp16")
    _assert_one_line_exit_2(main(["train", str(recipe)]), capsys, "precision fp16 is not supported on cpu", out)


def test_launch_rejects_batch_mismatch_before_starting_ranks(tmp_path, tiny_llama_dir):
    recipe, out = _bad_recipe(tmp_path, tiny_llama_dir, strategy={"name": "ddp"},
                              batch={"micro_batch_size": 4, "grad_accum_steps": 1, "global_batch_size": 4})
    result = run_cli("launch", "--nproc", "2", str(recipe))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines == ["toolkit: error: batch: 2 ranks × micro 4 × accum 1 = 8, but global_batch_size is 4; "
                     "set batch.grad_accum_steps=null to derive it, or make global_batch_size 8"]
    assert not out.exists()


def test_single_strategy_refuses_two_ranks(tmp_path, tiny_llama_dir):
    recipe, out = _bad_recipe(tmp_path, tiny_llama_dir)
    result = run_cli("launch", "--nproc", "2", str(recipe))
    assert result.returncode == 2 and "strategy single runs in one process" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not out.exists()


def test_help_lists_shipped_recipes():
    result = run_cli("--help", cwd=REPO)
    assert result.returncode == 0 and "recipes/minilm-sst.yaml" in result.stdout


def test_strategies_lists_every_strategy_with_its_options():
    from toolkit.strategies import arm_aliases, strategy_info, strategy_names

    result = run_cli("strategies", cwd=REPO)
    assert result.returncode == 0
    names = [line.split()[0] for line in result.stdout.splitlines() if line and not line.startswith(" ")]
    assert names[:len(strategy_names())] == list(strategy_names())
    assert all(f"strategy.{option}" in result.stdout for name in strategy_names()
               for option in strategy_info(name).options)
    assert all(f"  {arm} " in result.stdout for arm in arm_aliases())


def test_zero_refuses_a_precision_its_accelerator_lacks(tmp_path, tiny_llama_dir, capsys, monkeypatch):
    import deepspeed.accelerator

    class NoHalfAccelerator:  # DeepSpeed's CPU accelerator answers the same; a GPU one would not
        def is_fp16_supported(self):
            return False

        def is_bf16_supported(self):
            return True

        def device_name(self):
            return "cpu"

    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", lambda: NoHalfAccelerator())
    recipe, out = _bad_recipe(tmp_path, tiny_llama_dir, strategy={"name": "zero"}, precision="fp16")
    _assert_one_line_exit_2(main(["validate", str(recipe)]), capsys,
                            "precision fp16 is not supported by DeepSpeed's cpu accelerator; use precision: bf16", out)
