"""Collect every arm's numbers, judge them against the reference arm, write results.json, report.md,
a self-contained report.html (plots inlined) and the PNG plots (the tables and text: report_render.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from toolkit.atomic import write_text_whole, write_whole
from toolkit.checkpoint.store import read_run_info
from toolkit.compare import measure, verdict
from toolkit.compare import predictions as predicted
from toolkit.compare.experiment import CALIBRATION_PREFIX, ROUNDING_ARM, Experiment, dropout_note
from toolkit.compare.report_render import render_html, render_markdown
from toolkit.compare.runner import (arm_damage, arm_dir, arm_status, read_arm_recipe, read_json_file,
                                    read_metrics)
from toolkit.errors import os_error_text
from toolkit.observe.comm import COMM_COUNT_STEP
from toolkit.strategies import strategy_info, strategy_names



def load_arm(experiment: Experiment, arm) -> dict:
    path = arm_dir(experiment, arm)
    data = {"name": arm.name, "dir": path, "nproc": arm.nproc, "status": arm_status(path)}
    if data["status"] == "damaged":  # the run completed; its numbers are lost
        data["error"] = f"{arm_damage(path)}; `toolkit compare` with this --output runs the arm again"
    if data["status"] != "completed":
        failed = path / "failed.json"
        data.setdefault("error", str(read_json_file(failed).get("error", f"{failed} holds no error line"))
                        if failed.is_file() else "not completed yet; `toolkit compare` with this --output runs it")
        return data
    run = read_run_info(path) or {}  # completed: its run.json was read just now
    # its wall time, written by the runner (absent in folders of older versions; damaged: not shown)
    wall_s = read_json_file(path / "arm.json").get("wall_s")
    data.update(wall_s=wall_s if isinstance(wall_s, (int, float)) and not isinstance(wall_s, bool) else None)
    data.update(run=run, metrics=read_metrics(path)[0],
                recipe=read_arm_recipe(path), audit=run.get("precision_audit"),
                precision=run["precision"], num_params=run["num_params"])
    return data


def build_results(experiment: Experiment) -> dict:
    arms = [load_arm(experiment, arm) for arm in experiment.arms]
    shown = [a for a in arms if not a["name"].startswith(CALIBRATION_PREFIX)]
    calibration = {a["name"]: a for a in arms if a["name"].startswith(CALIBRATION_PREFIX)}
    reference = shown[0]
    # one CPU peak per kind of arm, the best any arm of the experiment measured (calibration runs included)
    peaks = measure.shared_cpu_peaks({a["name"]: a["run"] for a in arms if a["status"] == "completed"})
    rounding, rounding_note = _rounding(calibration.get(ROUNDING_ARM), reference)
    rows = []
    for arm in shown:
        row = {"arm": arm["name"], "status": arm["status"], "world_size": arm["nproc"]}
        if arm["status"] != "completed":
            # damaged: it ran, its numbers are lost; pending: not run, or stopped before its end (Ctrl-C, running now)
            failed = {"damaged": "damaged", "pending": "not run"}.get(arm["status"], "failed")
            rows.append({**row, "error": arm["error"], "verdict": failed})
            continue
        run, metrics = arm["run"], arm["metrics"]
        speed = measure.throughput(metrics)
        row.update(precision=run["precision"], strategy=run["strategy"], **speed, **measure.memory(run),
                   **measure.mfu(run, speed["tokens_per_s"], shared_peak=peaks.get(arm["name"])),
                   final_loss=metrics[-1]["loss"], final_eval_loss=_last_eval(metrics, "eval_loss"),
                   final_eval_metric=_last_metric(metrics),
                   comm=_comm(run), flops=run["flops"], audit=arm["audit"], batch=run["batch"],
                   losses=[m["loss"] for m in metrics], grad_norms=[m["grad_norm"] for m in metrics],
                   # local SGD: the replicas' distance between syncs (step, relative norm), where measured
                   drift=[(m["step"], m["replica_drift"]["relative_norm"]) for m in metrics
                          if "replica_drift" in m],
                   sync_drift=[(m["step"], m["replica_drift_before_sync"]) for m in metrics
                               if "replica_drift_before_sync" in m],
                   recipe=arm["recipe"], pipeline=_pipeline(run), experts=run.get("experts"),
                   fallback=run.get("fallback"), run=run, **predicted.peak_at_longest(run, arm["recipe"]),
                   plain_data_parallel=strategy_info(run["strategy"]).plain_data_parallel)
        if reference["status"] == "completed":
            reference_speed = measure.throughput(reference["metrics"])["tokens_per_s"]
            row["speedup_vs_reference"] = speed["tokens_per_s"] / reference_speed
            if arm is reference:
                row.update(verdict="reference", differences=[])
            else:
                envelope = _envelope(calibration, arm["precision"], reference["precision"])
                row.update(verdict.judge(arm, reference, envelope=envelope, rounding=rounding))
        else:
            row["verdict"] = f"no reference (reference arm {reference['status']})"
        rows.append(row)
    profile = predicted.add_predictions(rows, experiment.out_dir)  # each row's run is read and let go there
    for row in rows:
        row.pop("run", None)
    first: dict = next((a["run"] for a in arms if a["status"] == "completed"), {})
    return {"experiment": str(experiment.out_dir), "recipe": experiment.recipe, "reference": reference["name"],
            "arms": rows, "machine": {k: first.get(k) for k in ("device", "device_type", "versions")},
            # the recommendation's baseline, named where no arm ran it
            "plain_data_parallel": [name for name in strategy_names() if strategy_info(name).plain_data_parallel],
            "tolerances": verdict.__doc__.strip(), "dropout_note": dropout_note(experiment.common),
            "rounding_note": rounding_note, "rounding": rounding, "hardware_profile": profile}


def _by(relative_diff: float) -> str:
    return f"by up to {relative_diff:.2g} relative" if relative_diff else "not at all"


def _rounding(arm: dict | None, reference: dict) -> tuple[dict | None, str | None]:
    """What the rounding reference moved (verdict.rounding_scale) and the report's line on it: what it cost, how
    far it moved weights, or why the fp32 bounds stand alone."""
    if arm is None:  # a bf16/fp16 reference: calibration judges
        return None, None
    if arm["status"] != "completed" or reference["status"] != "completed":
        why = arm.get("error") if arm["status"] != "completed" else f"the reference arm {reference['status']}"
        return None, f"rounding reference not available ({why}): arms are judged by the fp32 bounds alone"
    scale = verdict.rounding_scale(arm, reference)
    if scale is None:
        return None, ("rounding reference not used (it logged other steps or exported other tensors than the "
                      "reference): arms are judged by the fp32 bounds alone")
    cost = f"{arm['wall_s']:.0f} s" if arm.get("wall_s") is not None else "one more single-process run"
    noise = verdict.noise_driven_tensors(reference.get("run")) or set()  # not judged: left out here too
    judged = {name: d for name, d in scale["weights"].items() if name not in noise}
    moved = max(judged.items(), key=lambda item: item[1], default=("-", 0.0))
    widened = sum(verdict.ROUNDING_FACTOR * d > verdict.FP32_RTOL for d in judged.values())
    return scale, (f"rounding reference ({cost}): the reference again on one process from weights × (1 + "
                   f"{verdict.ROUNDING_PERTURBATION:g}·N(0,1)) moved final weights by up to {moved[1]:.2g} "
                   f"({moved[0]}) and the loss {_by(scale['loss'][-1] if scale['loss'] else 0.0)}; "
                   f"bounds are the larger of the fp32 ones and {verdict.ROUNDING_FACTOR:g}× that, per step and "
                   f"per tensor ({widened} of {len(judged)} judged tensors' bound widened past 1e-5)")


def _comm(run: dict) -> dict | None:
    """run.json's count of one step's collectives, and whether it includes set-up traffic: counted before
    COMM_COUNT_STEP (a run of 1 or 2 steps counts its last), on a step that also set things up; a count of nothing
    (one process) includes none."""
    comm = run.get("comm_per_step")
    return {**comm, "includes_setup": comm["step"] < COMM_COUNT_STEP and comm["total_bytes"] > 0} if comm else None


def _envelope(calibration: dict, *precisions: str) -> list[float] | None:
    low = [p for p in precisions if p != "fp32"]
    if not low:
        return None
    a, b = calibration.get(f"{CALIBRATION_PREFIX}{low[0]}-a"), calibration.get(f"{CALIBRATION_PREFIX}{low[0]}-b")
    if not a or not b or a["status"] != "completed" or b["status"] != "completed":
        return None
    return verdict.noise_envelope(a["metrics"], b["metrics"], low[0])


def _pipeline(run: dict) -> dict | None:
    """A pipeline arm's stage numbers: per rank its stages, measured idle and p2p fractions and peak memory; the
    schedule's theoretical bubble; bytes all ranks sent to each other in one step."""
    ranks = run.get("strategy_measurements") or []
    if not any(r and "bubble_measured" in r for r in ranks):
        return None
    peaks = [p["peak_mem_bytes"] for p in run.get("peak_memory") or []]
    measured = [r["bubble_measured"] for r in ranks if r.get("bubble_measured") is not None]
    return {"stages_per_rank": [r.get("stages") for r in ranks],
            "bubble_measured_per_rank": [r.get("bubble_measured") for r in ranks],
            "bubble_measured": sum(measured) / len(measured) if measured else None,
            # the fraction of the step each rank spent posting its sends and receives (communication, not idle)
            "p2p_measured_per_rank": [r.get("p2p_measured") for r in ranks],
            # the schedule's theory per rank (a zero-bubble order leaves ranks unequal idle), and their mean
            "bubble_theory_per_rank": [r.get("bubble_theory") for r in ranks],
            # the same with each stage as long as its FLOPs: the idle this split leaves, predicted
            "bubble_predicted_per_rank": [r.get("bubble_predicted") for r in ranks],
            "bubble_theory": _mean([r.get("bubble_theory") for r in ranks]), "peak_mem_bytes_per_rank": peaks,
            "p2p_send_bytes_per_step": (run.get("comm_per_step") or {}).get("p2p_send_bytes_all_ranks")}


def _mean(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def _last_eval(metrics: list[dict], key: str) -> float | None:
    return next((m[key] for m in reversed(metrics) if key in m), None)


def _last_metric(metrics: list[dict]) -> str | None:
    """The latest evaluation's accuracy or perplexity, in words."""
    for key, shown in (("eval_accuracy", "accuracy {:.3f}"), ("eval_perplexity", "perplexity {:.2f}")):
        value = _last_eval(metrics, key)
        if value is not None:
            return shown.format(value)
    return None


def write_plots(results: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in results["arms"] if r["status"] == "completed"]
    drifting = [r for r in done if r.get("drift") or r.get("sync_drift")]  # local SGD: a third panel, the drift
    fig, axes = plt.subplots(1, 3 if drifting else 2, figsize=(16 if drifting else 11, 4))
    ax1, ax2 = axes[0], axes[1]
    colour = {r["arm"]: f"C{i % 10}" for i, r in enumerate(done)}  # one arm, one colour in every panel
    for r in done:
        steps = range(1, len(r["losses"]) + 1)
        ax1.plot(steps, r["losses"], label=r["arm"], marker=".", color=colour[r["arm"]])
        ax2.plot(steps, r["grad_norms"], label=r["arm"], marker=".", color=colour[r["arm"]])
    ax1.set(title="training loss (global-batch mean)", xlabel="optimizer step", ylabel="loss")
    ax2.set(title="gradient norm (before clipping)", xlabel="optimizer step", ylabel="L2 norm")
    for r in drifting:
        if r.get("drift"):  # each step the replica check ran (train.consistency_check_every): 0 after a sync
            axes[2].plot([s for s, _ in r["drift"]], [d for _, d in r["drift"]], label=r["arm"], marker=".",
                         color=colour[r["arm"]])
        axes[2].scatter([s for s, _ in r["sync_drift"]], [d for _, d in r["sync_drift"]], marker="x",
                        color=colour[r["arm"]], label=f"{r['arm']}: just before each sync")
    if drifting:
        axes[2].set(title="replica drift: rms ‖replica − mean‖ / ‖mean‖", xlabel="optimizer step",
                    ylabel="relative norm")
        axes[2].legend(fontsize=8)
    if done:  # no arm completed: no curve to name
        ax1.legend(fontsize=8)
    fig.tight_layout()
    curves = out_dir / "curves.png"
    write_whole(curves, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(11, 4))
    names = [r["arm"] for r in done]
    peak = [max(r["peak_mem_bytes_per_rank"] or [0]) / 2 ** 20 for r in done]
    state = [max(r["model_state_bytes_per_rank"] or [0]) / 2 ** 20 for r in done]
    xs = range(len(done))
    ax.bar([x - 0.2 for x in xs], peak, width=0.4, label="peak memory (max over ranks)")
    ax.bar([x + 0.2 for x in xs], state, width=0.4, label="params+grads+optimizer state (max over ranks)")
    ax.set_xticks(list(xs), names, rotation=20)
    ax.set(title="memory per rank", ylabel="MiB")
    ax.legend(fontsize=8)
    fig.tight_layout()
    mem = out_dir / "memory.png"
    write_whole(mem, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)
    return [curves, mem]


def write_report(results: dict, out_dir: Path) -> None:
    """results.json first (the numbers), then the plots, report.md and report.html: each written whole, so that
    a full disk leaves none of them cut short (the OSError is the caller's to say: report_written)."""
    write_text_whole(out_dir / "results.json", json.dumps(results, indent=2, default=str))
    plots = write_plots(results, out_dir)
    write_text_whole(out_dir / "report.md", render_markdown(results, plots))
    write_text_whole(out_dir / "report.html", render_html(results, plots))


def report_written(results: dict, out_dir: Path) -> bool:
    """write_report, for compare and report alike: False where it could not be written (a full disk), said in one
    line on stderr: the arms' own folders are kept, and `toolkit report` writes it from them once there is room."""
    try:
        write_report(results, out_dir)
    except OSError as exc:
        print(f"toolkit: the report could not be written to {out_dir} ({os_error_text(exc)}); each arm's results "
              f"are kept in its folder there; once the disk has room, toolkit report {out_dir} writes it",
              file=sys.stderr, flush=True)
        return False
    return True
