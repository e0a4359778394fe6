"""The report's memory section: toolkit plan's prediction beside what each arm measured."""

from __future__ import annotations

MEMORY_NOTE = ("Model states (parameters, gradients, optimizer state) are predicted exactly from the model's "
               "shapes and each strategy's sharding rules, before the run (`toolkit plan`); the peak is an "
               "estimate (runtime + activations + model states; see toolkit/plan/predict.py). Other live tensors: a census "
               "of every tensor the process holds after the first backward, less the counted model states "
               "(a strategy's buckets and buffers, the batch). On CPU the peak is predicted for "
               "train.host_memory=predictable; an arm that ran `fast` reuses freed memory and keeps its high-water "
               "mark, above the prediction (toolkit/process/host_memory.py).")


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
                     f"{'n/a' if peak_error is None else f'{peak_error * 100:+.1f} %'}); other live tensors "
                     f"{other} MiB/rank{host_memory_note(r)}")
    return lines


def host_memory_note(arm: dict) -> str:
    """'; host memory fast' where a CPU arm's peak is not the one the plan predicts."""
    return f"; host memory {arm['host_memory']}" if arm.get("host_memory") == "fast" else ""
