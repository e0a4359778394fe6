"""Verdict arithmetic and experiment building, on synthetic trajectories (no runs needed)."""

import pytest

from conftest import write_recipe
from toolkit.compare import verdict
from toolkit.compare.cli import calibration_arms
from toolkit.compare.experiment import build_experiment, load_matrix
from toolkit.errors import RecipeError


def steps(losses, norms=None):
    norms = norms or [1.0] * len(losses)
    return [{"step": i + 1, "loss": l, "grad_norm": g} for i, (l, g) in enumerate(zip(losses, norms))]


def test_first_step_outside_fp32_tolerance():
    ref = steps([2.0, 1.9, 1.8])
    assert verdict.first_step_outside(steps([2.0, 1.9 * (1 + 5e-6), 1.8]), ref, loss_tol=1e-5, norm_tol=1e-5) is None
    assert verdict.first_step_outside(steps([2.0, 1.9, 1.8 * (1 + 3e-5)]), ref, loss_tol=1e-5, norm_tol=1e-5) == 3
    assert verdict.first_step_outside(steps([2.0, 1.9], [1.0, 1.1]), ref[:2], loss_tol=1e-5, norm_tol=1e-5) == 2
    assert verdict.first_step_outside(steps([2.0]), ref, loss_tol=1e-5, norm_tol=1e-5) == 2  # arm stopped early


def test_noise_envelope_grows_with_calibration_and_has_a_floor():
    a = steps([2.0, 1.9, 1.8, 1.7])
    b = steps([2.0, 1.9, 1.8 * (1 + 0.01), 1.7])
    bound = verdict.noise_envelope(a, b, "bf16")
    assert bound[0] == bound[1] == 2 ** -8  # identical so far: the dtype's unit roundoff is the floor
    assert bound[2] == pytest.approx(4 * 0.01 / 1.01, rel=1e-6) and bound[3] == bound[2]  # never shrinks


def test_grad_norm_tolerance_scales_with_sqrt_params():
    assert verdict.grad_norm_rtol(1) == pytest.approx(1e-5 + 4 * 2 ** -24)
    assert verdict.grad_norm_rtol(4_000_000) == pytest.approx(1e-5 + 4 * 2000 * 2 ** -24)


def test_setting_differences_ignore_strategy_plumbing():
    ref = {"recipe": {"optim": {"lr": 0.001}, "strategy": {"name": "single"}, "output_dir": "a",
                      "batch": {"micro_batch_size": 8}},
           "audit": {"master_weights": "fp32", "grad_reduction": "none: one process"}}
    arm = {"recipe": {"optim": {"lr": 0.002}, "strategy": {"name": "zero"}, "output_dir": "b",
                      "batch": {"micro_batch_size": 4}},
           "audit": {"master_weights": "fp32 (ZeRO-3, cpu)", "grad_reduction": "reduce-scatter mean (bf16)"}}
    assert verdict.setting_differences(arm, ref) == ["optim.lr: 0.002 vs 0.001"]
    arm["audit"]["master_weights"] = "bf16 (sharded, = load dtype)"
    assert "audit master_weights: bf16 (sharded, = load dtype) vs fp32" in verdict.setting_differences(arm, ref)


def test_experiment_keeps_one_global_batch_across_world_sizes(tmp_path, tiny_llama_dir):
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=tmp_path / "o",
                          batch={"micro_batch_size": 4, "grad_accum_steps": 1})
    experiment = build_experiment(str(recipe), strategies=["single", "ddp", "zero3@optim.lr=0.01"],
                                  precisions=[None], accums=[None], nproc=2, steps=3,
                                  overrides=[f"output_dir={tmp_path / 'exp'}"])
    assert [(a.name, a.nproc) for a in experiment.arms] == [("single", 1), ("ddp", 2), ("zero3@optim.lr=0.01", 2)]
    assert all("batch.global_batch_size=8" in a.overrides for a in experiment.arms)
    assert "optim.lr=0.01" in experiment.arms[2].overrides and experiment.out_dir == tmp_path / "exp"
    with pytest.raises(RecipeError, match="unknown arm 'megatron'"):
        build_experiment(str(recipe), strategies=["megatron"], precisions=[None], accums=[None], nproc=2,
                         steps=3, overrides=[])


def test_matrix_file_and_calibration_arms(tmp_path, tiny_llama_dir):
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=tmp_path / "o")
    matrix = tmp_path / "m.yaml"
    matrix.write_text(f"recipe: {recipe}\nstrategies: [ddp, fsdp]\nprecisions: [fp32, bf16]\n"
                      "grad_accum_steps: [1, 2]\nnproc: 2\nsteps: 4\nset: [batch.global_batch_size=16]\n")
    experiment = load_matrix(str(matrix), nproc=None, steps=None, overrides=[f"output_dir={tmp_path / 'exp'}"])
    names = [a.name for a in experiment.arms]
    assert names[:2] == ["ddp-fp32-accum1", "ddp-fp32-accum2"] and len(names) == 8
    assert "batch.micro_batch_size=4" in experiment.arms[1].overrides  # 16 = 2 ranks × 4 × accum 2
    calib = calibration_arms(experiment)
    assert [a.name for a in calib] == ["calibration-bf16-a", "calibration-bf16-b"]
    assert "batch.micro_batch_size=8" in calib[0].overrides and "batch.micro_batch_size=4" in calib[1].overrides
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"recipe: {recipe}\nstrategies: [ddp]\nprecision: [bf16]\n")
    with pytest.raises(RecipeError, match="unknown key 'precision'"):
        load_matrix(str(bad), nproc=None, steps=None, overrides=[])
