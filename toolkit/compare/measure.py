"""Per-arm numbers for the report, all read from what the arm measured (metrics.jsonl, run.json)."""

from __future__ import annotations

import statistics
import time

import torch

# Dense peak FLOP/s per GPU by compute precision (vendor datasheets; SXM parts; fp32 = non-tensor-core)
GPU_PEAK_FLOPS = {
    "H200": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    "H100": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
    "L40S": {"bf16": 362e12, "fp16": 362e12, "fp32": 91.6e12},
    "A10": {"bf16": 125e12, "fp16": 125e12, "fp32": 31.2e12},
    "L4": {"bf16": 121e12, "fp16": 121e12, "fp32": 30.3e12},
}


def warmup_steps(num_steps: int) -> int:
    """Steps left out of throughput medians: the first fifth (at least 1) pays allocation and caches."""
    return max(1, num_steps // 5) if num_steps > 1 else 0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def throughput(metrics: list[dict]) -> dict:
    steady = metrics[warmup_steps(len(metrics)):] or metrics
    times = [m["step_time_s"] for m in steady]
    return {
        "tokens_per_s": statistics.median(m["tokens_per_s"] for m in steady),
        "samples_per_s": statistics.median(m["samples_per_s"] for m in steady),
        "step_time_s": statistics.median(times),
        "step_time_p10_s": percentile(times, 0.1),
        "step_time_p90_s": percentile(times, 0.9),
        "warmup_steps": warmup_steps(len(metrics)),
    }


def measured_cpu_matmul_flops(*, threads: int, dtype: torch.dtype = torch.float32, size: int = 1024) -> float:
    """Best-of-5 FLOP/s of a square matmul on this CPU with `threads` threads: the CPU 'peak'."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
        a @ b
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - start)
        return 2 * size ** 3 / best
    finally:
        torch.set_num_threads(previous)


def peak_flops_per_device(run: dict, *, cpu_peak_cache: dict) -> tuple[float | None, str]:
    """(peak FLOP/s of one device, where it came from)."""
    precision = run["precision"]
    if run["device_type"] == "cuda":
        for name, peaks in GPU_PEAK_FLOPS.items():
            if name in run["device"]:
                return peaks[precision], f"{name} datasheet {precision} dense"
        return None, f"unknown GPU {run['device']!r}: no peak in the table"
    threads = int(run.get("threads_per_rank", 1))
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    key = (threads, dtype)
    if key not in cpu_peak_cache:
        cpu_peak_cache[key] = measured_cpu_matmul_flops(threads=threads, dtype=dtype)
    return cpu_peak_cache[key], f"measured {dtype_label(dtype)} matmul, {threads} thread(s)/rank"


def dtype_label(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(dtype, str(dtype))


def mfu(run: dict, tokens_per_s: float, *, cpu_peak_cache: dict) -> dict:
    flops_per_token = run["flops"]["flops_per_token"]
    achieved = tokens_per_s * flops_per_token
    peak, source = peak_flops_per_device(run, cpu_peak_cache=cpu_peak_cache)
    total_peak = peak * run["world_size"] if peak else None
    return {"achieved_flops_per_s": achieved, "peak_flops_per_s": total_peak, "peak_source": source,
            "mfu": achieved / total_peak if total_peak else None}


def memory(run: dict) -> dict:
    ranks = run.get("model_state_bytes") or []
    peaks = run.get("peak_memory") or []
    return {
        "peak_mem_bytes_per_rank": [p["peak_mem_bytes"] for p in peaks],
        "peak_reserved_bytes_per_rank": [p.get("peak_reserved_bytes") for p in peaks],
        "model_state_bytes_per_rank": [r["params_bytes"] + r["grads_bytes"] + r["optim_bytes"] for r in ranks],
        "model_state_detail_per_rank": ranks,
    }
