"""Per-arm numbers for the report, all read from what the arm measured (metrics.jsonl, run.json)."""

from __future__ import annotations

import statistics

from toolkit.compare.experiment import CALIBRATION_PREFIX
from toolkit.observe.comm import count_step

# Dense peak FLOP/s per GPU by compute precision (vendor datasheets; SXM parts; fp32 = non-tensor-core)
GPU_PEAK_FLOPS = {
    "H200": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    "H100": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
    "L40S": {"bf16": 362e12, "fp16": 362e12, "fp32": 91.6e12},
    "A10": {"bf16": 125e12, "fp16": 125e12, "fp32": 31.2e12},
    "L4": {"bf16": 121e12, "fp16": 121e12, "fp32": 30.3e12},
}


# steady steps an arm's medians must be over before its speed is set against another arm's: fewer, and one slow or
# quick step (the machine's other work, a cache) decides the order
MIN_TIMED_STEPS = 5


def warmup_steps(num_steps: int) -> int:
    """Steps left out of throughput medians: the first fifth (at least 1) pays allocation and caches."""
    return max(1, num_steps // 5) if num_steps > 1 else 0


def steps_for_timed(num_timed: int, profiled: tuple[int, int] | None = None) -> int:
    """The fewest optimizer steps (--steps) whose medians are over `num_timed` steady steps: past the warm-up,
    without the step that counts collectives (count_step: where the loop puts it) and the train.profile_steps
    window `profiled`, as throughput leaves them out."""
    num_steps = num_timed
    while timed_steps(num_steps, profiled) < num_timed:
        num_steps += 1
    return num_steps


def timed_steps(num_steps: int, profiled: tuple[int, int] | None) -> int:
    """How many of a `num_steps` run's steps its throughput medians are over (throughput's steady steps)."""
    counted = count_step(done=0, total_steps=num_steps, profiled=profiled)
    first, last = profiled if profiled is not None else (0, -1)
    return sum(1 for step in range(warmup_steps(num_steps) + 1, num_steps + 1)
               if step != counted and not first <= step <= last)


def profile_window(row: dict) -> tuple[int, int] | None:
    """A results row's train.profile_steps (its recipe), or None."""
    window = ((row.get("recipe") or {}).get("train") or {}).get("profile_steps")
    return (int(window[0]), int(window[1])) if window else None


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def throughput(metrics: list[dict]) -> dict:
    """Medians over the steady steps, and how many there are (`num_timed_steps`); with none (a run of 1 or 2
    steps), over every step, warm-up and the counting step included, and `num_timed_steps` 0."""
    # the step that counted collectives ran a Python hook per op, profiled steps the profiler's: not representative
    steady = [m for m in metrics[warmup_steps(len(metrics)):] if "comm_bytes" not in m and not m.get("profiled")]
    timed = steady or metrics
    times = [m["step_time_s"] for m in timed]
    return {
        "tokens_per_s": statistics.median(m["tokens_per_s"] for m in timed),
        "samples_per_s": statistics.median(m["samples_per_s"] for m in timed),
        "step_time_s": statistics.median(times),
        "step_time_p10_s": percentile(times, 0.1),
        "step_time_p90_s": percentile(times, 0.9),
        "warmup_steps": warmup_steps(len(metrics)),
        "num_timed_steps": len(steady),
    }


def speed_doubt(a: dict, b: dict) -> tuple[str, str] | None:
    """Why two arms' (results rows') tokens/s do not tell which is faster: ("not measured enough" or "within
    noise", the numbers in words); None when they do: both timed over MIN_TIMED_STEPS steady steps or more, and
    their step-time p10–p90 bands apart (the arms run the same global batches, so step time orders them)."""
    if min(a["num_timed_steps"], b["num_timed_steps"]) < MIN_TIMED_STEPS:
        return "not measured enough", (
            f"{a['arm']} timed over {a['num_timed_steps']} steady step(s), {b['arm']} over {b['num_timed_steps']}; "
            f"fewer than {MIN_TIMED_STEPS} each: run --steps "
            f"{max(steps_for_timed(MIN_TIMED_STEPS, profile_window(r)) for r in (a, b))} or more")
    if a["step_time_p10_s"] <= b["step_time_p90_s"] and b["step_time_p10_s"] <= a["step_time_p90_s"]:
        return "within noise", (f"step time p10–p90 {_band_ms(a)} and {_band_ms(b)} overlap: more --steps measure "
                                "the difference better")
    return None


def _band_ms(row: dict) -> str:
    return f"{row['arm']} {row['step_time_p10_s'] * 1e3:.0f}–{row['step_time_p90_s'] * 1e3:.0f} ms"


def cpu_peak_group(run: dict) -> tuple | None:
    """What a CPU arm's measured peak is the peak of: the device type, the matmuls' dtype and the threads each rank
    ran them on. None for a run without a measured peak (a GPU's is its datasheet's)."""
    measured = run.get("cpu_matmul_peak")
    if run.get("device_type") != "cpu" or not measured:
        return None
    return run["device_type"], measured["dtype"], measured["threads"]


def shared_cpu_peaks(runs: dict[str, dict]) -> dict[str, dict]:
    """Per arm, the CPU peak its MFU divides by: of the arms whose peaks are peaks of the same thing
    (cpu_peak_group), the highest per-rank peak any of them measured, with the arm that measured it ("arm"), how
    many of the experiment's arms share it ("num_arms") and how many of its own runs besides them ("num_checks":
    the rounding reference, a run named with CALIBRATION_PREFIX, which the report does not show as an arm). Each
    arm measures at its own start, under whatever else the machine runs then: on a loaded machine two arms of one
    experiment measured 1.8× apart, and divided each by its own, tp at 265 tokens/s showed 0.91 % MFU and fsdp-tp2
    at 271 (same world, same FLOPs per token) 0.53 %. A peak is an upper bound: the highest measurement is the
    closest to it, and with one peak arms of one world size rank by MFU as
    they do by tokens/s."""
    groups: dict[tuple, list[str]] = {}
    for name, run in runs.items():
        key = cpu_peak_group(run)
        if key is not None:
            groups.setdefault(key, []).append(name)
    shared: dict[str, dict] = {}
    for names in groups.values():
        best = max(names, key=lambda name: runs[name]["cpu_matmul_peak"]["flops_per_s"])
        checks = sum(name.startswith(CALIBRATION_PREFIX) for name in names)
        shared.update(dict.fromkeys(names, {**runs[best]["cpu_matmul_peak"], "arm": best,
                                            "num_arms": len(names) - checks, "num_checks": checks}))
    return shared


def peak_flops_per_device(run: dict, *, shared: dict | None = None) -> tuple[float | None, str]:
    """(peak FLOP/s of one device, where it came from); on CPU `shared` (see shared_cpu_peaks) when given, else
    the run's own measurement."""
    precision = run["precision"]
    if run["device_type"] == "cuda":
        for name, peaks in GPU_PEAK_FLOPS.items():
            if name in run["device"]:
                return peaks[precision], f"{name} datasheet {precision} dense"
        return None, f"unknown GPU {run['device']!r}: no peak in the table"
    measured = shared or run.get("cpu_matmul_peak")
    if not measured:
        return None, "no measured CPU matmul peak in run.json"
    shape = "×".join(map(str, measured.get("shape") or ()))
    source = (f"measured {measured['dtype']} matmuls on each rank at start (best: {shape or 'square'}), "
              f"{measured['threads']} thread(s)/rank, ranks concurrently")
    if shared and shared["num_arms"] + shared["num_checks"] > 1:
        checks = shared["num_checks"]
        arms = f"{shared['num_arms']} arm{'s' if shared['num_arms'] > 1 else ''}"
        besides = {0: "", 1: " and the rounding reference's run"}.get(checks, f" and {checks} runs of its own")
        source += (f"; the highest per-rank peak of the {arms}{besides} that measured so, "
                   f"{shared['arm']}'s {shared['flops_per_s'] / 1e9:.2f} GFLOP/s, used for each of them")
    return measured["flops_per_s"], source


def mfu(run: dict, tokens_per_s: float, *, shared_peak: dict | None = None) -> dict:
    """Model FLOPs utilisation (`shared_peak`: see shared_cpu_peaks). A peak is an upper bound by definition: an
    achieved rate above it means the peak was measured wrong (on CPU: another kernel path, or the ranks ran it at a
    quieter moment), and the MFU is then reported as unknown, with why, rather than as a number above 100 %."""
    flops_per_token = run["flops"]["flops_per_token"]
    achieved = tokens_per_s * flops_per_token
    peak, peak_used = peak_flops_per_device(run, shared=shared_peak)
    total_peak = peak * run["world_size"] if peak else None
    value = achieved / total_peak if total_peak else None
    source = peak_used
    if value is not None and total_peak and value > 1:
        source = (f"{source}; unreliable: the step achieved {achieved / 1e9:.1f} GFLOP/s, above the "
                  f"{total_peak / 1e9:.1f} GFLOP/s peak, so no MFU is shown")
        value = None
    return {"achieved_flops_per_s": achieved, "peak_flops_per_s": total_peak, "peak_source": source,
            "peak_used": peak_used, "mfu": value}


def memory(run: dict) -> dict:
    ranks = run.get("model_state_bytes") or []
    peaks = run.get("peak_memory") or []
    states = [r["params_bytes"] + r["grads_bytes"] + r["optim_bytes"] for r in ranks]
    out = {
        "peak_mem_bytes_per_rank": [p["peak_mem_bytes"] for p in peaks],
        "peak_reserved_bytes_per_rank": [p.get("peak_reserved_bytes") for p in peaks],
        "model_state_bytes_per_rank": states,
        "model_state_detail_per_rank": ranks,
        "other_live_bytes_per_rank": [o["bytes"] for o in run.get("other_live_tensor_bytes") or []],
    }
    return {**out, "host_memory": run.get("host_memory"),  # CPU: the plan's peak is predicted for "predictable"
            **prediction_error(run.get("memory_prediction") or {}, states=states, peaks=out["peak_mem_bytes_per_rank"])}


def prediction_error(predicted: dict, *, states: list[int], peaks: list[int]) -> dict:
    """toolkit plan's prediction beside the measurement, rank by rank (a pipeline's ranks differ): model states
    (exact when right), and the peak's relative error (measured − predicted) / predicted of the rank it is
    largest for, with its sign."""
    if "model_state_bytes" not in predicted:
        return {"prediction": predicted.get("error", "no prediction in run.json")}
    want = [sum(r.values()) for r in predicted["model_state_bytes"]]
    want_peaks = predicted.get("peak_bytes_per_rank") or [predicted["peak_bytes"]] * len(peaks)
    return {"predicted_model_state_bytes_per_rank": want,
            "model_state_prediction_error": max((abs(m - p) / p for m, p in zip(states, want) if p), default=0.0),
            "predicted_peak_bytes": predicted["peak_bytes"], "predicted_peak_bytes_per_rank": want_peaks,
            "peak_prediction_error": largest_error(peaks, want_peaks), "prediction": "toolkit plan"}


def largest_error(measured: list[int], predicted: list[int]) -> float | None:
    """The relative error (measured − predicted) / predicted of the rank it is largest for, with its sign; None
    where no rank has a prediction."""
    errors = [(m - p) / p for m, p in zip(measured, predicted) if p]
    return max(errors, key=abs) if errors else None
