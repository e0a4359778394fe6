"""`toolkit compare --strategies`: the arm list is split at the commas between arms, not at those inside an
override's YAML value (a list, a mapping, a quoted string). Nothing here trains."""

import pytest

from conftest import write_recipe
from toolkit.cli import build_parser, main
from toolkit.compare.cli import experiment_of
from toolkit.compare.experiment import arm_overrides
from toolkit.config.arm_specs import split_arms
from toolkit.config.files import load_recipe


@pytest.mark.parametrize("text, arms", [
    ("single,ddp", ["single", "ddp"]),
    ("fsdp@strategy.blocks=[A,B],ddp", ["fsdp@strategy.blocks=[A,B]", "ddp"]),
    ("fsdp@strategy.blocks=[A, B], ddp", ["fsdp@strategy.blocks=[A, B]", "ddp"]),
    ("single@optim.betas=[0.9,0.95]@seed=1,zero3", ["single@optim.betas=[0.9,0.95]@seed=1", "zero3"]),
    ("single@data.text_column='a,b',ddp", ["single@data.text_column='a,b'", "ddp"]),
    ('single@data.text_column="a,b",ddp', ['single@data.text_column="a,b"', "ddp"]),
    ("single@data.text_column=it's,ddp", ["single@data.text_column=it's", "ddp"]),  # an apostrophe: no quote
    ("single@x={a: [1,2], b: 3},ddp", ["single@x={a: [1,2], b: 3}", "ddp"]),
])
def test_commas_inside_an_overrides_value_stay_in_its_arm(text, arms):
    """`fsdp@strategy.blocks=[A,B],ddp` was three arms: `fsdp@strategy.blocks=[A`, `B]` and `ddp`."""
    assert split_arms(text) == arms


@pytest.fixture
def recipe(tmp_path, tiny_llama_dir):
    return write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=tmp_path / "unused")


def test_an_at_sign_inside_an_overrides_value_stays_in_it():
    assert arm_overrides("single@data.text_column='a@b'@seed=1") == \
        ("strategy.name=single", "data.text_column='a@b'", "seed=1")


def test_an_arm_with_a_list_override_runs_with_the_whole_list(recipe, tmp_path):
    arms = "single,fsdp@strategy.blocks=[LlamaDecoderLayer,LlamaMLP]"
    experiment = experiment_of(build_parser().parse_args(["compare", str(recipe), "--strategies", arms,
                                                          "--output", str(tmp_path / "exp")]))
    # the two arms, then the fp32 reference's rounding run (toolkit/compare/verdict.py)
    assert [arm.name for arm in experiment.arms] == [*arms.split(",", 1), "calibration-rounding"]
    fsdp = load_recipe(experiment.recipe, [*experiment.common, *experiment.arms[1].overrides])
    assert fsdp.strategy.blocks == ("LlamaDecoderLayer", "LlamaMLP")


@pytest.mark.parametrize("arms, unclosed", [("fsdp@strategy.blocks=[A,B,ddp", "'['"),
                                            ("single@data.text_column='a,ddp", "\"'\""),
                                            ("single@x={a: 1,ddp", "'{'")])
def test_an_unclosed_bracket_or_quote_is_one_line(arms, unclosed, recipe, tmp_path, capsys):
    out = tmp_path / "exp"
    code = main(["compare", str(recipe), "--strategies", arms, "--output", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert f"--strategies {arms!r}: {unclosed} is not closed; close it" in err[0], err
    assert not out.exists()


@pytest.mark.parametrize("tail, line", [
    (["step 1/4 ...", "toolkit: non-finite loss (nan) at step 2; the run stopped before any checkpoint could hold it",
      "toolkit: launch failed: rank 0 exit code 4; rank 1 exit code 4 (see the rank output above)"],
     "toolkit: non-finite loss (nan) at step 2; the run stopped before any checkpoint could hold it"),
    (["toolkit: error: data.train: x.jsonl does not exist"], "toolkit: error: data.train: x.jsonl does not exist"),
    (["Traceback (most recent call last):", "RuntimeError: boom",
      "toolkit: launch failed: rank 1 exit code 1 (see the rank output above)"], "RuntimeError: boom"),
    (["toolkit: launch failed: rank 1 exit code -9 (see the rank output above)"],
     "toolkit: launch failed: rank 1 exit code -9"),
    # a rank killed outright says nothing: the other's line is its symptom, the launcher's summary names the cause
    (["toolkit: rank 0: stopped, another rank left the run (Connection closed by peer)",
      "toolkit: launch failed: rank 0 exit code 1; rank 1 killed by SIGKILL (see the rank output above)"],
     "rank 1 killed by SIGKILL; then toolkit: rank 0: stopped, another rank left the run (Connection closed by peer)"),
])
def test_an_arms_failure_reason_is_its_ranks_own_line(tail, line):
    """A report holds no "rank output above": the ranks' line says why, not the launcher's exit codes."""
    from toolkit.compare.runner import failure_line

    assert failure_line(tail) == line


def test_an_arms_metrics_with_a_non_finite_step_read_back_as_nan(tmp_path):
    """metrics.jsonl writes null (strict JSON) and names what it was; compare's tables and verdict get NaN back."""
    import math

    from toolkit.compare.runner import read_metrics
    from toolkit.observe.metrics import JsonlWriter

    writer = JsonlWriter(tmp_path / "metrics.jsonl")
    writer.write({"step": 1, "loss": float("nan"), "grad_norm": float("inf"), "lr": 0.1, "tokens": 8,
                  "step_time_s": 1.0, "tokens_per_s": 8.0, "samples_per_s": 1.0})
    writer.close()
    [record], problem = read_metrics(tmp_path)
    assert problem is None and math.isnan(record["loss"]) and record["grad_norm"] == math.inf
