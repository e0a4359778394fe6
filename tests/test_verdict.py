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


def _first_step(arm, ref):
    found = verdict.first_difference(arm, ref, loss_tol=1e-5, norm_tol=1e-5)
    return found["step"] if found else None


def test_first_step_outside_fp32_tolerance():
    ref = steps([2.0, 1.9, 1.8])
    assert _first_step(steps([2.0, 1.9 * (1 + 5e-6), 1.8]), ref) is None
    assert _first_step(steps([2.0, 1.9, 1.8 * (1 + 3e-5)]), ref) == 3
    assert _first_step(steps([2.0, 1.9], [1.0, 1.1]), ref[:2]) == 2
    assert _first_step(steps([2.0]), ref) == 2  # arm stopped early


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
    notes: list[str] = []
    experiment = load_matrix(str(matrix), nproc=None, steps=None, overrides=[f"output_dir={tmp_path / 'exp'}"],
                             note=notes.append)
    assert notes == []  # an absolute recipe: path is found where it says
    names = [a.name for a in experiment.arms]
    assert names[:2] == ["ddp-fp32-accum1", "ddp-fp32-accum2"] and len(names) == 8
    assert "batch.micro_batch_size=4" in experiment.arms[1].overrides  # 16 = 2 ranks × 4 × accum 2
    calib = calibration_arms(experiment)
    # the reference (ddp-fp32-accum1) is fp32: its rounding reference, on one process with the experiment's global
    # batch in micro-batches of the reference's 8 (accumulation derived: 2), and bf16's two calibration runs
    assert [a.name for a in calib] == ["calibration-rounding", "calibration-bf16-a", "calibration-bf16-b"]
    rounding = calib[0]
    assert rounding.nproc == 1 and {"strategy.name=single", "batch.global_batch_size=16", "batch.micro_batch_size=8",
                                    "train.init_perturbation=1e-07"} <= set(rounding.overrides)
    assert "batch.micro_batch_size=8" in calib[1].overrides and "batch.micro_batch_size=4" in calib[2].overrides
    assert all("train.report_to=[]" in arm.overrides for arm in calib)  # no tracker run beside the arms
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"recipe: {recipe}\nstrategies: [ddp]\nprecision: [bf16]\n")
    with pytest.raises(RecipeError, match="unknown key 'precision'"):
        load_matrix(str(bad), nproc=None, steps=None, overrides=[], note=notes.append)


def _export(path, tensors):
    from safetensors.torch import save_file

    (path / "model").mkdir(parents=True)
    save_file(tensors, str(path / "model" / "model.safetensors"))
    return path


def _weights_case(tmp_path, *, arm_changes):
    import torch

    torch.manual_seed(0)
    ref = {"q.bias": torch.randn(16), "k.bias": torch.randn(16), "w": torch.randn(4, 4)}
    arm = {k: v.clone() for k, v in ref.items()}
    for key, (index, delta) in arm_changes.items():
        arm[key].view(-1)[index] += delta
    ref_run = {"gradient_scale": {"num_steps": 5, "max_abs_over_norm": {
        "q.bias": 1.3e-4, "k.bias": 3e-10, "w": 0.2}}}  # k.bias: gradient at rounding level in every step
    metrics = steps([2.0, 1.9, 1.8])
    ref_arm = {"dir": _export(tmp_path / "ref", ref), "metrics": metrics, "recipe": {}, "audit": {},
               "num_params": 48, "run": ref_run}
    other = {"dir": _export(tmp_path / "arm", arm), "metrics": metrics, "recipe": {}, "audit": {}, "num_params": 48}
    return verdict.judge(other, ref_arm, envelope=None), ref


def test_noise_driven_tensor_is_listed_not_judged(tmp_path):
    # k.bias moved by 100× the tolerance, as Adam does to a tensor whose gradient is rounding noise
    result, _ = _weights_case(tmp_path, arm_changes={"k.bias": (3, 1e-3)})
    assert result["verdict"] == "equivalent"
    assert result["noise_note"].startswith("noise-driven (gradient ≈ 0 by construction")
    assert "1 tensor(s), |Δ| up to 0.001 (k.bias): k.bias" in result["noise_note"]
    assert "q.bias" not in result["noise_note"]


def test_gradient_carrying_tensor_outside_tolerance_diverges_naming_it(tmp_path):
    # q.bias's gradient is small but real (1.3e-4 of the global norm): 10× the tolerance there is a difference
    result, ref = _weights_case(tmp_path, arm_changes={"q.bias": (5, 10 * (1e-5 + 1e-5 * 3.0))})
    assert result["verdict"] == "diverged in final weights"
    line = result["differences"][0]
    assert line.startswith("final weights: q.bias: 1 of 16 elements outside |Δ| ≤ 1e-05 + 1e-05·|w|")
    assert "largest |Δ| 0.0004" in line


def test_without_a_gradient_scale_every_tensor_is_judged():
    assert verdict.noise_driven_tensors({}) is None
    assert verdict.noise_driven_tensors({"gradient_scale": {"num_steps": 3, "max_abs_over_norm": {
        "a": 2 ** -24, "b": 2 ** -23}}}) == {"a"}


def test_diverged_step_names_what_differs():
    ref = steps([2.0, 1.9, 1.8])
    found = verdict.first_difference(steps([2.0, 1.9 * (1 + 1e-3), 1.8]), ref, loss_tol=1e-5, norm_tol=1e-5)
    assert found["step"] == 2 and found["what"].startswith("step 2: loss 1.9019 vs 1.9 (relative 0.001 > 1e-05)")


def test_a_norm_only_one_side_has_or_that_is_not_finite_differs():
    """ZeRO stage 0 in fp32 once reported no norm (nan): its relative difference, nan, passed every tolerance."""
    ref = steps([2.0, 1.9, 1.8])
    arm = [dict(step) for step in ref]
    arm[1]["grad_norm"] = float("nan")
    assert verdict.first_difference(arm, ref, loss_tol=1e-5, norm_tol=1e-5)["what"].startswith(
        "step 2: grad norm nan vs ")
    arm[1]["grad_norm"] = float("inf")
    assert verdict.first_difference(arm, ref, loss_tol=1e-5, norm_tol=1e-5)["step"] == 2
    both = [dict(step, grad_norm=float("inf") if step["step"] == 2 else step["grad_norm"]) for step in ref]
    assert verdict.first_difference(both, both, loss_tol=1e-5, norm_tol=1e-5) is None  # the same overflow


def test_mfu_above_one_is_reported_as_an_unreliable_peak_not_a_number():
    from toolkit.compare import measure

    run = {"flops": {"flops_per_token": 1_000_000}, "world_size": 2, "precision": "bf16", "device_type": "cpu",
           "cpu_matmul_peak": {"flops_per_s": 1e9, "dtype": "bf16", "threads": 1, "shape": [1024, 128, 344]}}
    fine = measure.mfu(run, tokens_per_s=1000)  # 1e9 achieved of 2e9 peak
    assert fine["mfu"] == pytest.approx(0.5) and "1024×128×344" in fine["peak_source"]
    above = measure.mfu(run, tokens_per_s=3000)  # 3e9 achieved of 2e9 peak: the peak cannot be a peak
    assert above["mfu"] is None and "unreliable" in above["peak_source"] and "3.0 GFLOP/s" in above["peak_source"]


def _cpu_run(*, peak, threads=1, dtype="fp32", world_size=2):
    return {"flops": {"flops_per_token": 1_000_000}, "world_size": world_size, "precision": dtype,
            "device_type": "cpu", "cpu_matmul_peak": {"flops_per_s": peak, "dtype": dtype, "threads": threads,
                                                      "shape": [256, 32, 64]}}


def test_cpu_arms_of_one_kind_divide_by_the_best_peak_any_of_them_measured():
    """Each arm divided by the peak it measured at its own start (1.8× apart on a loaded machine): tp at 265
    tokens/s showed 0.91 % MFU, fsdp-tp2 at 271 tokens/s (same world, same FLOPs/token) 0.53 %."""
    from toolkit.compare import measure

    runs = {"tp": _cpu_run(peak=1e9), "fsdp-tp2": _cpu_run(peak=1.8e9),
            "single": _cpu_run(peak=3e9, threads=2, world_size=1),  # 2 threads per rank: a peak of another kind
            "tp-bf16": _cpu_run(peak=0.5e9, dtype="bf16"),  # bf16 matmuls: another kind
            "gpu": {"flops": {"flops_per_token": 1_000_000}, "world_size": 1, "precision": "bf16",
                    "device_type": "cuda", "device": "NVIDIA H100 80GB HBM3"}}
    shared = measure.shared_cpu_peaks(runs)
    assert set(shared) == {"tp", "fsdp-tp2", "single", "tp-bf16"}
    assert shared["tp"] is shared["fsdp-tp2"] and (shared["tp"]["arm"], shared["tp"]["num_arms"]) == ("fsdp-tp2", 2)
    assert (shared["single"]["flops_per_s"], shared["tp-bf16"]["flops_per_s"]) == (3e9, 0.5e9)
    tp, fsdp_tp = (measure.mfu(runs[name], tokens, shared_peak=shared[name])
                   for name, tokens in (("tp", 265), ("fsdp-tp2", 271)))
    assert tp["peak_flops_per_s"] == fsdp_tp["peak_flops_per_s"] == 2 * 1.8e9
    assert tp["mfu"] == pytest.approx(265e6 / 3.6e9) and fsdp_tp["mfu"] == pytest.approx(271e6 / 3.6e9)
    assert tp["peak_used"] == fsdp_tp["peak_used"] and \
        "the highest per-rank peak of the 2 arms that measured so, fsdp-tp2's 1.80 GFLOP/s" in tp["peak_used"]
    alone = measure.mfu(runs["single"], 100, shared_peak=shared["single"])["peak_used"]
    assert "2 thread(s)/rank" in alone and "highest" not in alone  # one arm of its kind: its own peak, as before
    assert measure.mfu(runs["gpu"], 1000, shared_peak=shared.get("gpu"))["peak_used"] == "H100 datasheet bf16 dense"


def test_a_shared_cpu_peak_counts_the_arms_shown_apart_from_the_rounding_reference_s_run():
    """The report shows the arms; compare's own rounding reference (a run named calibration-…) measures a peak too
    and may hold the best. Counted among the arms, a 2-arm report said "the highest per-rank peak of the 3 arms"."""
    from toolkit.compare import measure
    from toolkit.compare.experiment import ROUNDING_ARM

    runs = {"single": _cpu_run(peak=1e9), "ddp": _cpu_run(peak=1.2e9), ROUNDING_ARM: _cpu_run(peak=1.5e9)}
    shared = measure.shared_cpu_peaks(runs)
    assert (shared["ddp"]["num_arms"], shared["ddp"]["num_checks"]) == (2, 1)
    assert shared["ddp"]["arm"] == ROUNDING_ARM
    line = measure.mfu(runs["ddp"], 100, shared_peak=shared["ddp"])["peak_used"]
    assert "the highest per-rank peak of the 2 arms and the rounding reference's run that measured so" in line
    alone = measure.shared_cpu_peaks({"single": _cpu_run(peak=1e9), ROUNDING_ARM: _cpu_run(peak=1.5e9)})
    line = measure.mfu(runs["single"], 100, shared_peak=alone["single"])["peak_used"]
    assert "the highest per-rank peak of the 1 arm and the rounding reference's run that measured so" in line


def test_the_report_names_each_peak_used_once_in_one_line():
    from toolkit.compare.report_render import flops_note

    flops = {"formula": "6*N", "matmul_params": 1, "attention_flops_per_token": 0, "flops_per_token": 6, "seq_len": 1}
    arms = [{"arm": "tp", "flops": flops, "peak_used": "P", "peak_source": "P"},
            {"arm": "fsdp-tp2", "peak_used": "P", "peak_source": "P"}]
    assert flops_note({"arms": arms}).endswith("(peak × world); peak: P.")
    arms.append({"arm": "single", "peak_used": "Q", "peak_source": "Q; unreliable: above"})
    assert flops_note({"arms": arms}).endswith("(peak × world); peaks: tp, fsdp-tp2: P; single: Q. single: Q; "
                                               "unreliable: above.")


def _timed(num_steps, *, comm_step=3, step_time_s=0.1):
    return [{"step": k, "step_time_s": step_time_s, "tokens_per_s": 100.0, "samples_per_s": 1.0,
             **({"comm_bytes": 1} if k == min(comm_step, num_steps) else {})} for k in range(1, num_steps + 1)]


def test_throughput_says_how_many_steady_steps_its_medians_are_over():
    """--steps 3 timed one step (step 1 warms up, step 3 counts collectives), and the table did not say so."""
    from toolkit.compare import measure

    assert measure.throughput(_timed(3))["num_timed_steps"] == 1
    assert measure.throughput(_timed(2))["num_timed_steps"] == 0  # none steady: the medians are over both steps
    assert measure.steps_for_timed(measure.MIN_TIMED_STEPS) == 7
    assert measure.throughput(_timed(7))["num_timed_steps"] == measure.MIN_TIMED_STEPS == 5
    assert measure.throughput(_timed(6))["num_timed_steps"] == 4


@pytest.mark.parametrize("window", [None, (2, 4), (3, 3), (1, 6), (6, 9)])
def test_the_steps_hint_counts_profiled_steps_out_as_throughput_does(window):
    """The report's "run --steps N" times MIN_TIMED_STEPS steady steps also when train.profile_steps left some
    out (it assumed only the warm-up and step 3 were): checked against throughput's own choice of steps, on
    metrics marked where the loop marks them (the profiled window; the counting step, moved out of it)."""
    from toolkit.observe.comm import count_step
    from toolkit.compare import measure

    def metrics(num_steps):
        counted = count_step(done=0, total_steps=num_steps, profiled=window)
        first, last = window or (0, -1)
        return [{"step": k, "step_time_s": 0.1, "tokens_per_s": 100.0, "samples_per_s": 1.0,
                 **({"profiled": True} if first <= k <= last else {}), **({"comm_bytes": 1} if k == counted else {})}
                for k in range(1, num_steps + 1)]

    wanted = measure.MIN_TIMED_STEPS
    steps = measure.steps_for_timed(wanted, window)
    assert measure.throughput(metrics(steps))["num_timed_steps"] == wanted
    assert measure.throughput(metrics(steps - 1))["num_timed_steps"] < wanted
    row = {"recipe": {"train": {"profile_steps": list(window) if window else None}}}
    assert measure.profile_window(row) == window


def _row(arm, *, step_ms, band_ms, timed, state_mib=100, world_size=2, verdict_="equivalent", plain=False):
    return {"arm": arm, "status": "completed", "verdict": verdict_, "world_size": world_size, "precision": "fp32",
            "plain_data_parallel": plain,
            "tokens_per_s": 8000 / step_ms, "speedup_vs_reference": 75 / step_ms, "step_time_s": step_ms / 1e3,
            "step_time_p10_s": band_ms[0] / 1e3, "step_time_p90_s": band_ms[1] / 1e3, "num_timed_steps": timed,
            "model_state_bytes_per_rank": [state_mib * 2 ** 20], "peak_mem_bytes_per_rank": [2 ** 30],
            "losses": [1.0] * 3, "final_loss": 1.0, "final_eval_loss": None}


@pytest.mark.parametrize("timed, mp_band, fastest, doubts", [
    (1, (38, 38), "fastest equivalent arm: not told apart: mp has the highest median (211 tokens/s, 1.97× the "
                  "reference), but its difference to ddp is not measured enough (mp timed over 1 steady step(s), ddp "
                  "over 1; fewer than 5 each: run --steps 7 or more)",
     (" (not measured enough)", " (not measured enough)")),
    (5, (36, 72), "fastest equivalent arm: not told apart: mp has the highest median (211 tokens/s, 1.97× the "
                  "reference), but its difference to ddp is within noise (step time p10–p90 mp 36–72 ms and ddp "
                  "70–74 ms overlap: more --steps measure the difference better)",
     (" (within noise)", " (within noise)")),
    (5, (36, 40), "fastest equivalent arm: **mp** (211 tokens/s, 1.97× the reference)", (" (within noise)", "")),
])
def test_the_recommendation_names_a_fastest_arm_only_when_measured_and_apart(timed, mp_band, fastest, doubts):
    """--steps 3 named `mp` fastest at 1.97× single, and dp at 1.05× single (identical code), from one step each."""
    from toolkit.compare.report_render import recommendations, table_rows

    results = {"reference": "single", "arms": [
        _row("single", step_ms=75, band_ms=(73, 77), timed=timed, world_size=1, state_mib=50, verdict_="reference"),
        _row("ddp", step_ms=71.4, band_ms=(70, 74), timed=timed, plain=True),
        _row("mp", step_ms=38, band_ms=mp_band, timed=timed, state_mib=60)]}
    lines = recommendations(results)
    assert lines[0] == fastest
    assert lines[2:] == ["each arm below is set against **ddp**: plain data parallelism (a full replica on each of its 2 "
                         "rank(s), the batch split over them), what the other strategies trade memory and speed against",
                         f"single: -50 % model-state memory per rank vs ddp, 0.95× its tokens/s{doubts[0]}",
                         f"mp: -40 % model-state memory per rank vs ddp, 1.88× its tokens/s{doubts[1]}"]
    head, rows = table_rows(results)
    assert [row[head.index("timed steps")] for row in rows] == [str(timed)] * 3


def test_an_arm_that_fell_back_is_said_and_never_recommended_as_fastest():
    """dp on a machine without 2+ GPUs runs as single: its speed is single's, measured again."""
    from toolkit.compare.report_render import _explanations, recommendations

    fell_back = "strategy dp needs 2+ CUDA devices; this machine has 0, so it runs as one process, like single"
    results = {"reference": "single", "arms": [
        _row("single", step_ms=75, band_ms=(73, 77), timed=5, world_size=1, verdict_="reference"),
        {**_row("dp", step_ms=30, band_ms=(29, 31), timed=5, world_size=1), "fallback": fell_back},
        _row("ddp", step_ms=50, band_ms=(49, 51), timed=5, plain=True)]}
    assert f"**dp** did not run as its strategy on this machine: {fell_back}" in _explanations(results)
    assert recommendations(results)[0].startswith("fastest equivalent arm: **ddp**")


def _arms_without_ddp(**ddp):
    """`single,tp,mp` at 2 ranks (tp holds most model-state memory per rank of the multi-rank arms), with a ddp arm
    when `ddp` gives its row's settings."""
    arms = [_row("single", step_ms=75, band_ms=(73, 77), timed=5, world_size=1, state_mib=50, verdict_="reference"),
            _row("tp", step_ms=150, band_ms=(149, 151), timed=5, state_mib=120),
            _row("mp", step_ms=37, band_ms=(36, 38), timed=5, world_size=1, state_mib=50)]
    if ddp:
        arms.append(_row("ddp", step_ms=50, band_ms=(49, 51), timed=5, plain=True, **ddp))
    return {"reference": "single", "plain_data_parallel": ["ddp"], "arms": arms}


@pytest.mark.parametrize("ddp, baseline, mp_line", [
    # `single,tp,mp`: every arm was set against tp, the one multi-rank arm, and nothing said why
    ({}, "**single**: the reference arm, as no arm ran plain data parallelism (ddp)",
     "mp: +0 % model-state memory per rank vs single, 2.03× its tokens/s"),
    # ddp, although tp holds more model-state memory per rank: plain data parallelism, not the fullest arm
    ({"state_mib": 100}, "**ddp**: plain data parallelism (a full replica on each of its 2 rank(s), the batch split "
                         "over them), what the other strategies trade memory and speed against",
     "mp: -50 % model-state memory per rank vs ddp, 1.35× its tokens/s"),
    ({"verdict_": "diverged at step 2"}, "**single**: the reference arm, as plain data parallelism (ddp) is not "
                                         "recommended", "mp: +0 % model-state memory per rank vs single, 2.03× its "
                                                        "tokens/s"),
])
def test_the_recommendation_sets_arms_against_plain_data_parallelism_else_the_reference(ddp, baseline, mp_line):
    from toolkit.compare.report_render import recommendations

    lines = recommendations(_arms_without_ddp(**ddp))
    assert lines[2] == f"each arm below is set against {baseline}"
    assert mp_line in lines and not any(" vs tp," in line for line in lines)


def test_an_arm_without_a_steady_step_has_its_speed_and_set_up_traffic_marked():
    """--steps 1: tokens/s, MFU and "bubble 0.71 (theory 0.33)" were the first step's, shown as steady numbers, and
    pp-gpipe's collectives counted on step 1 (its stages' shape exchange) as its traffic per step."""
    from toolkit.compare.report_render import _comm_lines, _pipeline_lines, table_notes, table_rows

    pipeline = {"stages_per_rank": [[0], [1]], "bubble_measured_per_rank": [0.9, 0.52], "bubble_measured": 0.71,
                "bubble_theory": 0.33, "peak_mem_bytes_per_rank": [], "p2p_send_bytes_per_step": 2 ** 20}

    def comm(step, includes_setup):
        return {"step": step, "total_bytes": 2 ** 20, "bytes_by_op": {"send": 2 ** 20}, "calls_by_op": {"send": 5},
                "includes_setup": includes_setup}

    def arms(timed, step, includes_setup):
        return {"reference": "single", "arms": [
            _row("single", step_ms=75, band_ms=(75, 75), timed=timed, world_size=1, verdict_="reference"),
            {**_row("pp-gpipe", step_ms=150, band_ms=(150, 150), timed=timed), "mfu": 0.0077,
             "comm": comm(step, includes_setup), "pipeline": pipeline}]}

    head, rows = table_rows(arms(0, 1, True))
    cells = dict(zip(head, rows[1]))
    assert [cells[c] for c in ("tokens/s", "× ref", "step ms (p10–p90)", "MFU", "bubble", "comm MiB/step")] == \
        ["53 (no steady step)", "0.50 (no steady step)", "150 (150–150) (no steady step)", "0.77% (no steady step)",
         "0.71 (theory 0.33) (no steady step)", "1.00 (incl. set-up)"]
    notes = table_notes(arms(0, 1, True))
    assert any(n.startswith("(no steady step): single, pp-gpipe ran no step past the warm-up") and
               n.endswith("(run --steps 3 to time one steady step)") for n in notes), notes
    assert any(n.startswith("(incl. set-up): pp-gpipe counted collectives on step 1, before the first step without "
                            "set-up traffic") for n in notes), notes
    assert _comm_lines(arms(0, 1, True)) == ["pp-gpipe (step 1, incl. set-up, rank 0): send 1.00 MiB in 5 call(s)"]
    assert _pipeline_lines(arms(0, 1, True))[0].startswith("pp-gpipe (no steady step): rank 0 stage 0: idle 0.90")
    # timed over a steady step, collectives counted on step 3: nothing marked
    head, rows = table_rows(arms(1, 3, False))
    assert not any("(no steady step)" in cell or "(incl. set-up)" in cell for row in rows for cell in row), rows
    assert not any(n.startswith(("(no steady step)", "(incl. set-up)")) for n in table_notes(arms(1, 3, False)))
    assert _comm_lines(arms(1, 3, False)) == ["pp-gpipe (step 3, rank 0): send 1.00 MiB in 5 call(s)"]


def _routed(losses, routes):
    return [{**s, "expert_tokens": r} for s, r in zip(steps(losses), routes)]


SAME = [[50, 50, 50, 50]]  # one MoE layer, 4 experts, 200 (token, expert) pairs a step


@pytest.mark.parametrize("arm_losses, arm_routes, words", [
    # one pair moved at step 2 (0.5 % of 200), the loss leaves the bound at step 3: rounding decided a tie
    ([2.0, 1.9, 1.8 * (1 + 1e-4)], [SAME, [[51, 49, 50, 50]], [[60, 40, 50, 50]]],
     "equivalent until a route flip at step 2"),
    # the flip and the divergence at one step: nothing shows the trajectories agreed past the flip
    ([2.0, 1.9 * (1 + 1e-4), 1.8], [SAME, [[51, 49, 50, 50]], SAME], "diverged at step 2"),
    # 10 pairs moved at once (5 %): more than a near-tie explains, a misrouting, not a rounding
    ([2.0, 1.9, 1.8 * (1 + 1e-4)], [SAME, [[60, 40, 50, 50]], SAME], "diverged at step 3"),
    # no flip: the ordinary verdict
    ([2.0, 1.9, 1.8 * (1 + 1e-4)], [SAME, SAME, SAME], "diverged at step 3"),
])
def test_a_route_flip_before_the_divergence_is_named_as_such(tmp_path, arm_losses, arm_routes, words):
    import torch

    weights = {"w": torch.ones(4, 4)}
    ref = {"dir": _export(tmp_path / "ref", weights), "metrics": _routed([2.0, 1.9, 1.8], [SAME] * 3),
           "recipe": {}, "audit": {}, "num_params": 16, "run": {}}
    arm = {"dir": _export(tmp_path / "arm", weights), "metrics": _routed(arm_losses, arm_routes), "recipe": {},
           "audit": {}, "num_params": 16}
    result = verdict.judge(arm, ref, envelope=None)
    assert result["verdict"] == words
    if words.startswith("equivalent until"):
        assert result["differences"][0].startswith("step 2: 1 of 200 (token, expert) pairs went to another expert")
        from toolkit.compare.recommend import equivalent

        assert equivalent(result["verdict"])


def _judged(tmp_path, arm_losses, ref_losses, *, arm_strategy, ref_strategy=None, arm_optim=None, precision=None,
            arm_audit=None):
    """judge() on synthetic trajectories and identical final weights (a lever's verdict reads the losses)."""
    import torch
    from safetensors.torch import save_file

    runs = {}
    for name, losses_, strategy, optim, audit in (
            ("arm", arm_losses, arm_strategy, arm_optim or {"lr": 0.001}, arm_audit or {}),
            ("ref", ref_losses, ref_strategy or {"name": "ddp"}, {"lr": 0.001}, {})):
        (tmp_path / name / "model").mkdir(parents=True, exist_ok=True)
        save_file({"w": torch.ones(3)}, str(tmp_path / name / "model" / "model.safetensors"))
        recipe = {"strategy": strategy, "optim": optim, **({"precision": precision} if precision else {})}
        runs[name] = {"name": name, "dir": tmp_path / name, "metrics": steps(losses_), "num_params": 3,
                      "recipe": recipe, "audit": audit, "run": None}
    return verdict.judge(runs["arm"], runs["ref"], envelope=None)


REF = [10.0 - 0.1 * i for i in range(20)]  # drops 1.8: the mean of its first 2 steps, 9.95, minus its last 2's, 8.15


def test_a_lever_within_its_budget_differs_by_design(tmp_path):
    """Budget: 2 % of the reference's loss drop, 0.02 × 1.8 = 0.036; the arm ends 0.03 above the reference."""
    arm = [x + 0.03 * i / 19 for i, x in enumerate(REF)]
    judged = _judged(tmp_path, arm, REF, arm_strategy={"name": "ddp", "gradient_compression": "bf16"})
    assert judged["verdict"] == "differs by design (gradient_compression=bf16)", judged
    assert judged["distance"]["budget"] == pytest.approx(0.02 * 1.8)
    assert judged["distance"]["final_difference"] == pytest.approx((0.03 * 18 / 19 + 0.03) / 2)


def test_zero_under_bf16_is_judged_as_the_bf16_reduction_deepspeed_defaults_to(tmp_path):
    """zero without strategy.reduce_dtype keeps and reduces its gradients in bf16 under precision bf16 (DeepSpeed's
    default): the lever reduce_dtype=bf16 by another name, judged by its loss budget, its audit rows (gradients,
    reduction in bf16) part of it. Before: "diverged" whatever the cost, as a fault would be."""
    arm = [x + 0.03 * i / 19 for i, x in enumerate(REF)]
    audit = {"gradients": "bf16", "grad_reduction": "reduce-scatter mean (bf16)"}
    judged = _judged(tmp_path, arm, REF, arm_strategy={"name": "zero", "stage": 2}, precision="bf16",
                     arm_audit=audit)
    assert judged["verdict"] == "differs by design (reduce_dtype=bf16 (DeepSpeed's default under bf16))", judged
    # an explicit fp32 reduction is no lever; under fp32 zero reduces in fp32 by itself
    for strategy, precision in (({"name": "zero", "stage": 2, "reduce_dtype": "fp32"}, "bf16"),
                                ({"name": "zero", "stage": 2}, "fp32")):
        assert verdict.levers({"strategy": strategy, "precision": precision},
                              {"strategy": {"name": "ddp"}, "precision": precision}) is None
    # and a zero reference under bf16 holds the same reduction as a zero arm: no lever between them
    zero_bf16 = {"strategy": {"name": "zero", "stage": 3}, "precision": "bf16"}
    assert verdict.levers(zero_bf16, {"strategy": {"name": "zero", "stage": 2}, "precision": "bf16"}) is None


def test_a_lever_beyond_its_budget_diverged_naming_the_lever(tmp_path):
    arm = [x + 0.1 * i / 19 for i, x in enumerate(REF)]
    judged = _judged(tmp_path, arm, REF, arm_strategy={"name": "ddp", "gradient_compression": "powersgd",
                                                       "powersgd_rank": 2, "powersgd_start_step": 4})
    assert judged["verdict"] == "diverged at step 2", judged
    assert judged["differences"][0].startswith("gradient_compression=powersgd (r=2, from step 5) moves the loss by "
                                               "more than its budget")


def test_a_lever_budget_is_capped_by_a_final_loss_near_zero(tmp_path):
    """A loss from 0.7 to 0.01: 2 % of the drop (0.0136) would exceed what is left of the loss; the budget is 2 % of
    the final loss, so an arm ending 15 % above it diverged."""
    ref = [0.7 * 0.8 ** i + 0.01 for i in range(40)]
    arm = [x * (1.15 if i >= 20 else 1.0) for i, x in enumerate(ref)]
    judged = _judged(tmp_path, arm, ref, arm_strategy={"name": "ddp", "gradient_compression": "powersgd",
                                                       "powersgd_rank": 4, "powersgd_start_step": 10})
    last = sum(ref[-4:]) / 4
    assert judged["distance"]["budget"] == pytest.approx(0.02 * last)
    assert judged["verdict"].startswith("diverged"), judged


def test_a_fault_beside_a_lever_is_not_by_design(tmp_path):
    """A planted weight decay within the lever's loss budget is still a fault: only the lever's keys may differ."""
    arm = [x + 0.03 * i / 19 for i, x in enumerate(REF)]
    judged = _judged(tmp_path, arm, REF, arm_strategy={"name": "ddp", "gradient_compression": "bf16"},
                     arm_optim={"lr": 0.001, "weight_decay": 0.5})
    assert judged["verdict"] == "diverged at step 2", judged
    assert "optim.weight_decay: 0.5 vs None" in judged["differences"]
    assert any("besides the lever gradient_compression=bf16" in d for d in judged["differences"])


def test_a_lever_arm_that_logged_fewer_steps_or_a_nan_eval_loss_diverged(tmp_path):
    arm = [x + 0.03 * i / 19 for i, x in enumerate(REF)]
    bf16c = {"name": "ddp", "gradient_compression": "bf16"}
    assert _judged(tmp_path, arm[:12], REF, arm_strategy=bf16c)["verdict"] == "diverged at step 13"
    nan_eval = steps(arm)
    nan_eval[-1]["eval_loss"] = float("nan")
    ref = steps(REF)
    ref[-1]["eval_loss"] = 1.0
    judged = verdict._judge_lever({"metrics": nan_eval}, {"metrics": ref}, on="gradient_compression=bf16",
                                  first={"step": 2, "what": "step 2: loss"}, settings=[], rounding=None)
    assert judged["verdict"] == "diverged at step 2"


def test_without_a_lever_any_difference_diverged(tmp_path):
    arm = [x + 0.03 * i / 19 for i, x in enumerate(REF)]
    assert _judged(tmp_path, arm, REF, arm_strategy={"name": "fsdp"})["verdict"] == "diverged at step 2"
    # the lever at its no-op setting is no lever
    assert _judged(tmp_path, arm, REF, arm_strategy={"name": "fsdp", "reduce_dtype": "fp32"})["verdict"] == \
        "diverged at step 2"
