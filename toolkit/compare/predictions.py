"""The report's predicted-and-measured sections: toolkit plan's memory prediction beside what each arm measured,
and its step-time prediction beside the step time each arm measured.

Each arm's step time as toolkit plan predicts it, beside the one it measured: the one place where prediction and
measurement stand side by side on this machine. The profile is this machine's, measured once the arms are done
(the machine idle; toolkit calibrate --hardware cpu's measurements, kept in the experiment folder as
hardware.yaml), or the one --hardware names; each arm's prediction takes its own recipe, world size and the
micro-batch shapes of its counted step."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any, Callable

from toolkit.atomic import cache_dir
from toolkit.compare.measure import largest_error
from toolkit.config.parallel import resolve
from toolkit.config.recipe import Recipe
from toolkit.config.typed import from_plain
from toolkit.cost import calibrate, step_time
from toolkit.cost import hardware as profiles
from toolkit.errors import RecipeError
from toolkit.model.precision import DTYPES
from toolkit.plan.predict import planned_model, predict
from toolkit.plan.scale import busiest_work

MEMORY_NOTE = ("Model states (parameters, gradients, optimizer state) are predicted exactly from the model's "
               "shapes and each strategy's sharding rules, before the run (`toolkit plan`); the peak is an "
               "estimate (runtime + activations + model states; see toolkit/plan/predict.py). Other live tensors: a census "
               "of every tensor the process holds after the first backward, less the counted model states "
               "(a strategy's buckets and buffers, the batch). On CPU the peak is predicted for "
               "train.host_memory=predictable; an arm that ran `fast` reuses freed memory and keeps its high-water "
               "mark, above the prediction (toolkit/process/host_memory.py).")


def peak_at_longest(run: dict, recipe_raw: dict) -> dict[str, Any]:
    """Where a rank's micro-batches were all shorter than data.max_length (each padded to its longest sample; a
    pipeline's step to that rounded up to a multiple of 8), toolkit plan's peak again at the length it computed
    on: the like-for-like prediction of what it measured (the plan's own, at max_length, is what batches of
    full-length samples would reach), each rank at its own. {} where every rank reached max_length, or the run
    recorded no prediction."""
    from toolkit.strategies import strategy_degrees
    from toolkit.strategies.pipeline.batches import padded_length

    predicted, peaks = run.get("memory_prediction") or {}, run.get("peak_memory") or []
    tokens = [p.get("longest_micro_batch_tokens") or 0 for p in peaks]
    if "peak_bytes" not in predicted or not tokens or not all(tokens):
        return {}
    full = predicted.get("peak_bytes_per_rank") or [predicted["peak_bytes"]] * len(peaks)
    try:
        recipe = from_plain(Recipe, recipe_raw)
        max_length, world = recipe.data.max_length, run["world_size"]
        if strategy_degrees(resolve(recipe, world_size=world), world_size=world).pp > 1:  # the step's padded length
            tokens = [padded_length([t], max_length=max_length) for t in tokens]
        if min(tokens) >= max_length:
            return {}
        model = planned_model(recipe)  # one meta model for every length
        by_length = {}  # each length's peak per rank
        for length in set(tokens):
            shorter = dataclasses.replace(recipe, data=dataclasses.replace(recipe.data, max_length=length))
            by_length[length] = full if length >= max_length else predict(
                shorter, world_size=world, runtime_bytes=predicted["runtime_bytes"],
                device_type=run.get("device_type", "cpu"), model=model, both=False).peak_bytes_per_rank
    except (RecipeError, KeyError):
        return {}
    want = [by_length[length][rank] for rank, length in enumerate(tokens)]
    return {"longest_micro_batch_tokens_per_rank": tokens, "max_length": max_length,
            "predicted_peak_bytes_per_rank_at_longest": want,
            "peak_prediction_error_at_longest": largest_error([p["peak_mem_bytes"] for p in peaks], want)}


def _at_longest(row: dict) -> str:
    """', predicted at data.max_length ...; at each rank's longest micro-batch ...' where some rank's batches were
    all shorter than data.max_length."""
    if "predicted_peak_bytes_per_rank_at_longest" not in row:
        return ""
    want = "/".join(f"{b / 2 ** 20:.0f}" for b in row["predicted_peak_bytes_per_rank_at_longest"])
    lengths = "/".join(str(t) for t in row["longest_micro_batch_tokens_per_rank"])
    error = row["peak_prediction_error_at_longest"]
    return (f", predicted at data.max_length {row['max_length']}; at each rank's longest micro-batch, "
            f"{lengths} tokens padded, {want} MiB/rank (largest error "
            f"{'n/a' if error is None else f'{error * 100:+.1f} %'})")


def memory_lines(results: dict) -> list[str]:
    lines = []
    for r in results["arms"]:
        if r["status"] != "completed" or not r.get("model_state_bytes_per_rank"):
            continue
        measured = "/".join(f"{b / 2 ** 20:.1f}" for b in r["model_state_bytes_per_rank"])
        other = "/".join(f"{b / 2 ** 20:.1f}" for b in r.get("other_live_bytes_per_rank") or []) or "n/a"
        if "predicted_model_state_bytes_per_rank" not in r:
            lines.append(f"{r['arm']}: model states {measured} MiB/rank; other live tensors {other} MiB/rank; "
                         f"no prediction ({r.get('prediction')})")
            continue
        predicted = "/".join(f"{b / 2 ** 20:.1f}" for b in r["predicted_model_state_bytes_per_rank"])
        peak = "/".join(f"{b / 2 ** 20:.0f}" for b in r["peak_mem_bytes_per_rank"])
        peak_want = "/".join(f"{b / 2 ** 20:.0f}" for b in
                             r.get("predicted_peak_bytes_per_rank") or [r["predicted_peak_bytes"]])
        peak_error = r.get("peak_prediction_error")
        lines.append(f"{r['arm']}: model states measured {measured} vs predicted {predicted} MiB/rank (error "
                     f"{r['model_state_prediction_error'] * 100:.2f} %); peak measured {peak} vs predicted "
                     f"{peak_want} MiB/rank (largest error "
                     f"{'n/a' if peak_error is None else f'{peak_error * 100:+.1f} %'}){_at_longest(r)}; other "
                     f"live tensors {other} MiB/rank{host_memory_note(r)}")
    return lines


def host_memory_note(arm: dict) -> str:
    """'; host memory fast' where a CPU arm's peak is not the one the plan predicts."""
    return f"; host memory {arm['host_memory']}" if arm.get("host_memory") == "fast" else ""


PROFILE = "hardware.yaml"  # in the experiment folder: the profile the predictions are made on


def measure_profile(out_dir: Path, recipe: Recipe, *, nproc: int, say: Callable[[str], None]) -> Path:
    """This machine's CPU profile for ranks of `nproc`, once per experiment folder: the one an earlier compare
    measured for the same shapes within a day (calibrate.cached_cpu_profile), else measured now; `say` tells which."""
    path = out_dir / PROFILE
    if path.is_file():
        return path
    shapes: dict[str, Any] = {"nproc": max(nproc, 2), "model": planned_model(recipe), "dtype": DTYPES[recipe.precision],
                              "tokens": recipe.batch.micro_batch_size * recipe.data.max_length}
    cached = calibrate.cached_cpu_profile(**shapes)
    if cached is not None:
        profile, measured_at = cached
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(measured_at))
        say(f"this machine's profile for the predicted step times: measured by an earlier compare at {when}, kept "
            f"a day (delete {cache_dir('calibration')} to measure anew)")
        header = f"measured by an earlier toolkit compare at {when}, on this machine for the same shapes"
    else:
        say("measuring this machine for the predicted step times (toolkit calibrate --hardware cpu)...")
        profile = calibrate.kept_cpu_profile(**shapes)
        header = "measured by toolkit compare once its arms were done (toolkit calibrate --hardware cpu)"
    profiles.write(profile, path, header=header)
    return path


def predicted_step(run: dict, recipe_raw: dict, profile: profiles.Hardware) -> dict[str, Any] | None:
    """{"predicted_step_time_s", "prediction_error"} for a completed arm (None where its layout is not modelled)."""
    comm = run.get("comm_per_step") or {}
    shapes = comm.get("micro_batch_shapes_per_rank")
    world = run["world_size"]
    try:
        recipe = resolve(from_plain(Recipe, recipe_raw), world_size=world)
        model = planned_model(recipe)
        threads = run.get("threads_per_rank")
        if threads:  # a rank computes on its own share of the cores, whatever the profile was measured at
            profile = calibrate.at_cores(profile, calibrate.rank_cores(threads, world=world,
                                                                        cores=os.cpu_count() or 1))
        cluster = step_time.Cluster(hardware=profile, num_nodes=1, gpus_per_node=max(world, profile.gpus_per_node))
        _, predicted = busiest_work(recipe, model, cluster, world_size=world,
                                    shapes=[[tuple(s) for s in mine] for mine in shapes] if shapes else None)
    except (RecipeError, KeyError, IndexError):
        return None
    return {"predicted_step_time_s": predicted.step_time_s, "predicted_largest": predicted.largest()}


STEP_NOTE = ("Each arm's step time as `toolkit plan --hardware` predicts it (toolkit/cost/step_time.py) from this "
             "machine's measured profile, or the one --hardware named (hardware.yaml in the experiment folder: on a "
             "CPU, matmul and attention FLOP/s at a rank's threads, memory bandwidth, a causal LM's loss per logit, "
             "the host's time per op beside the matmuls, gloo's all-reduce bus), its recipe, world size and the "
             "micro-batch shapes of its counted step, beside the median it measured.")


def add_predictions(rows: list[dict], out_dir: Path) -> str | None:
    """Each completed row's predicted step time and its error against the measured median, from the experiment
    folder's profile; which profile that is (its name and description), or None where there is none (a compare on
    a GPU without --hardware)."""
    path = out_dir / PROFILE
    if not path.is_file():
        return None
    profile = profiles.load(str(path))
    rows_profile = f"{profile.name}: {profile.description}" if profile.description else profile.name
    for row in rows:
        if row.get("status") != "completed" or "run" not in row:
            continue
        done = predicted_step(row.pop("run"), row["recipe"], profile)
        if done is not None and row.get("step_time_s"):
            row.update(done, prediction_error=done["predicted_step_time_s"] / row["step_time_s"] - 1)
    return rows_profile


def step_lines(results: dict) -> list[str]:
    """One line per arm: measured step time (its median, and the spread of its timed steps, p10-p90), predicted, the
    error and where the prediction falls against that spread (an error inside it is within the run's own noise),
    the prediction's largest costs."""
    out = []
    for row in results["arms"]:
        if "predicted_step_time_s" not in row:
            continue
        predicted, spread, where = row["predicted_step_time_s"], "", ""
        low, high = row.get("step_time_p10_s"), row.get("step_time_p90_s")
        if low is not None and high is not None:
            spread = f" (p10-p90 {low * 1e3:,.0f}-{high * 1e3:,.0f})"
            where = (", below its p10" if predicted < low else ", above its p90" if predicted > high
                     else ", within its p10-p90")
        out.append(f"{row['arm']}: measured {row['step_time_s'] * 1e3:,.0f} ms{spread}, predicted "
                   f"{predicted * 1e3:,.0f} ms ({100 * row['prediction_error']:+.0f} %{where}); "
                   f"predicted: {', '.join(row['predicted_largest'])}")
    return out
